"""A loss call's inputs checked once, before any kernel runs, and gathered in a LossBatch:
per-token tensors of the token shape and the sequences (Segments). Each tensor's own check is in
checks.py; what needs the sequence layout (cu_seqlens, advantages per sequence, the context-
parallel limits) is here. cu_seqlens on a GPU is checked by an asynchronous device-side assert
(checks.py says why).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from ..config import GSPOConfig
from ..distributed.collectives import check_group
from .checks import (INDEX_DTYPES, TokenLayout, check_mask, check_targets, check_values, per_token_logprobs,
                     require_device, require_shape, require_tensor)
from .segments import Segments


def _check_cu_seqlens(cu: torch.Tensor, rows: int) -> bool:
    """Checks cu_seqlens; True when that was done on the host (so it is known valid now)."""
    if cu.device.type == "cpu" and not torch.compiler.is_compiling():
        bounds = cu.tolist()  # a CPU tensor's values, read without dispatching an op
        if bounds[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0; got {bounds[0]}")
        if any(b < a for a, b in zip(bounds, bounds[1:])):
            raise ValueError("cu_seqlens must be non-decreasing")
        if bounds[-1] != rows:
            raise ValueError(f"cu_seqlens must end at N = {rows} (the number of logits rows); got {bounds[-1]}")
        return True
    valid = (cu[0] == 0) & (cu[-1] == rows) & (cu[1:] >= cu[:-1]).all()
    torch._assert_async(valid, "cu_seqlens must start at 0, be non-decreasing and end at N")
    return False


def _segments(layout: TokenLayout, cu_seqlens, cp_group) -> Segments:
    if not layout.packed:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens is for packed (N, V) logits; padded (B, T, V) logits take none")
        return Segments.padded(layout.shape[0], layout.shape[1], cp_group)
    if cu_seqlens is None:
        raise ValueError(
            "2-D logits are the packed layout (N, V) and need cu_seqlens (S+1,); "
            "for one padded batch pass (B, T, V)"
        )
    cu = require_tensor("cu_seqlens", cu_seqlens)
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with S+1 >= 2 entries; got shape {tuple(cu.shape)}")
    if cu.dtype not in INDEX_DTYPES:
        raise TypeError(f"cu_seqlens must be int32 or int64; got {cu.dtype}")
    if cu.device != layout.device and cu.device.type != "cpu":
        raise ValueError(f"cu_seqlens is on {cu.device} but logits are on {layout.device}")
    valid = _check_cu_seqlens(cu, layout.rows)
    return Segments.packed(cu.to(device=layout.device, dtype=torch.int64), layout.rows, cp_group, valid)


def _advantages(value, segments: Segments, token_shape, device) -> tuple[torch.Tensor, bool]:
    t = require_tensor("advantages", value)
    if not t.dtype.is_floating_point:
        raise TypeError(f"advantages must be a float tensor; got {t.dtype}")
    require_device("advantages", t, device)
    per_seq_shape = (segments.num_seqs,)
    if tuple(t.shape) == per_seq_shape:
        return t, False
    if tuple(t.shape) == tuple(token_shape):
        return t, True
    raise ValueError(
        f"advantages must have shape {per_seq_shape} (one per sequence) or {tuple(token_shape)} "
        f"(one per token); got {tuple(t.shape)}"
    )


def _normalizer(value, device):
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"normalizer must be a scalar; got shape {tuple(value.shape)}")
        require_device("normalizer", value, device)
        value = value.reshape(())
        check_values((value > 0) & torch.isfinite(value), "normalizer must be finite and > 0")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"normalizer must be a finite number > 0 or a scalar tensor; got {value!r}")
    return float(value)


@dataclass(frozen=True)
class LossBatch:
    """The loss inputs after checking: per-token tensors of the token shape (`[B, T]` padded,
    `[N]` packed, contiguous where the kernels read them: targets, mask) plus the sequence
    layout."""

    targets: torch.Tensor | None  # None where the log-probs are given (policy_loss)
    token_shape: torch.Size
    mask: torch.Tensor
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    advantages_per_token: bool
    segments: Segments
    normalizer: torch.Tensor | float | None
    horizon: int | None
    rollout_logprobs: torch.Tensor | None = None
    entropy_threshold: torch.Tensor | None = None
    token_weights: torch.Tensor | None = None  # detached per-token weights of the policy term
    masked: bool = True  # False: no mask was given, every row is in the response

    @property
    def row_mask(self) -> torch.Tensor | None:
        """The mask as the kernels read it (the token shape, contiguous); None (every row) when
        no mask was given."""
        return self.mask if self.masked else None


def _rollout_logprobs(config: GSPOConfig, value, token_shape, device):
    rollout = per_token_logprobs("rollout_logprobs", value, token_shape, device)
    if config.rollout_correction is not None and rollout is None:
        raise ValueError(f"rollout_correction={config.rollout_correction!r} needs rollout_logprobs")
    if rollout is not None and config.rollout_correction is None and config.off_policy_mask_threshold is None:
        raise ValueError("rollout_logprobs are read only by rollout_correction or off_policy_mask_threshold; "
                         "set one of them, or drop rollout_logprobs")
    return rollout


def _entropy_threshold(config: GSPOConfig, value, device):
    if value is None:
        return None
    if config.top_entropy_quantile >= 1.0:
        raise ValueError("entropy_threshold replaces the top_entropy_quantile threshold; set top_entropy_quantile < 1")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"entropy_threshold must be a scalar; got shape {tuple(value.shape)}")
        require_device("entropy_threshold", value, device)
        return value.reshape(()).detach()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"entropy_threshold must be a float or a scalar tensor; got {type(value).__name__}")
    return torch.tensor(float(value), device=device)


def _token_weights(value, token_shape, device):
    if value is None:
        return None
    t = require_tensor("token_weights", value)
    require_shape("token_weights", t, token_shape, "one weight per token, like target_ids")
    if not t.dtype.is_floating_point:
        raise TypeError(f"token_weights must be a float tensor; got {t.dtype}")
    require_device("token_weights", t, device)
    return t.detach()


def _check_context_parallel(config: GSPOConfig, cp_group, entropy_threshold, max_len_needed: bool) -> None:
    """What a rank cannot compute from its own part of each sequence: say so, not guess."""
    if cp_group is None:
        return
    check_group("cp_group", cp_group)
    if config.top_entropy_quantile < 1.0 and entropy_threshold is None:
        raise ValueError("top_entropy_quantile with cp_group needs entropy_threshold: the quantile over "
                         "every rank's tokens, which one rank's part of the sequences cannot give")
    if max_len_needed:
        raise ValueError("loss_agg='seq-mean-token-sum-norm' with cp_group needs max_len: this rank's T is "
                         "only its part of the horizon")


@dataclass(frozen=True)
class CallInputs:
    """The per-call keywords of the entry points (gspo_loss, GSPOLoss, fused_linear_gspo_loss,
    policy_loss) as the caller passed them, before any check: collected once at the public
    signature and handed on whole. Every field is optional; docs/distributed.md holds the groups."""

    mask: object = None
    cu_seqlens: object = None
    ref_logprobs: object = None
    rollout_logprobs: object = None
    normalizer: object = None
    entropy_threshold: object = None
    token_weights: object = None  # policy_loss only
    cp_group: object = None
    tp_group: object = None  # read by stage 1 (the vocab slice), not by prepare_batch
    vocab_start: object = None
    sampling_threshold: object = None  # stage 1: per token, the smallest raw logit the sampler kept
    kept_tokens: object = None  # stage 1: the engine's kept sets (a KeptTokens)

    @staticmethod
    def of(entry: str, keywords: dict, refused: tuple = ()) -> "CallInputs":
        """CallInputs from an nn.Module's `**tensors`, with an error naming the keywords `entry`
        takes for a misspelt or refused one."""
        names = [f.name for f in fields(CallInputs) if f.name not in refused]
        unknown = sorted(set(keywords) - set(names))
        if unknown:
            raise TypeError(f"{entry} got unexpected keyword(s) {unknown}; its per-call keywords are "
                            f"{', '.join(names)} (loss options go to its constructor)")
        return CallInputs(**keywords)


def prepare_batch(config: GSPOConfig, layout: TokenLayout, target_ids, old_logprobs, advantages,
                  call: CallInputs) -> LossBatch:
    """Every per-call input checked against the token layout and flattened to rows.
    target_ids: None where there are none (policy_loss takes log-probs). call.cp_group: the
    context-parallel group whose ranks hold the other parts of every sequence
    (docs/distributed.md), or None."""
    mask, cu_seqlens, ref_logprobs, cp_group = call.mask, call.cu_seqlens, call.ref_logprobs, call.cp_group
    entropy_threshold = call.entropy_threshold
    targets = None if target_ids is None else check_targets(target_ids, layout)
    device, token_shape = layout.device, layout.shape
    _check_context_parallel(config, cp_group, entropy_threshold,
                            config.loss_agg == "seq-mean-token-sum-norm" and config.max_len is None)
    segments = _segments(layout, cu_seqlens, cp_group)
    adv, adv_per_token = _advantages(advantages, segments, token_shape, device)
    ref = per_token_logprobs("ref_logprobs", ref_logprobs, token_shape, device)
    if config.beta > 0 and ref is None:
        raise ValueError("beta > 0 adds a KL penalty and needs ref_logprobs")
    horizon = config.max_len
    if config.loss_agg == "seq-mean-token-sum-norm" and horizon is None:
        if layout.packed:
            raise ValueError("loss_agg='seq-mean-token-sum-norm' on packed input needs max_len (the horizon)")
        horizon = max(token_shape[1], 1)  # T = 0: no token to weight, and no division by 0
    return LossBatch(
        targets=targets,
        token_shape=token_shape,
        mask=check_mask(mask, layout),
        old_logprobs=per_token_logprobs("old_logprobs", old_logprobs, token_shape, device),
        ref_logprobs=ref,
        advantages=adv,
        advantages_per_token=adv_per_token,
        segments=segments,
        normalizer=_normalizer(call.normalizer, device),
        horizon=horizon,
        rollout_logprobs=_rollout_logprobs(config, call.rollout_logprobs, token_shape, device),
        entropy_threshold=_entropy_threshold(config, entropy_threshold, device),
        token_weights=_token_weights(call.token_weights, token_shape, device),
        masked=mask is not None,
    )
