"""The public loss: checks inputs, runs stage 1 (kernel), stage 2 (PyTorch), and wires stage 3
(kernel) into autograd through the token-stats Function."""

from __future__ import annotations

import torch

from . import backends
from .config import GSPOConfig, resolve_config
from .distributed.vocab_parallel import VocabSlice
from .inputs.batch import CallInputs, prepare_batch
from .inputs.checks import TokenLayout
from .sequence.gspo_objective import gspo_objective
from .token_stats.kept_set import SamplingFilter
from .token_stats.on_logits import token_stats


def _gspo_loss_with_config(config: GSPOConfig, logits, target_ids, old_logprobs, advantages, call: CallInputs):
    batch = prepare_batch(config, TokenLayout.of_logits(logits), target_ids, old_logprobs, advantages, call)
    tp_slice = VocabSlice.of_rank(call.tp_group, call.vocab_start, logits.shape[-1])
    backend_name = backends.resolve(config.backend, logits.device, logits.dtype)
    logit_map = config.logit_map
    logp, entropy = token_stats(logits, batch.targets, logit_map, backend_name, config.inplace,
                                batch.row_mask, tp_slice, SamplingFilter.of(config), call.sampling_threshold,
                                call.kept_tokens)
    return gspo_objective(config, batch, logp, entropy)


def gspo_loss(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    normalizer: torch.Tensor | float | None = None,
    entropy_threshold: torch.Tensor | float | None = None,
    tp_group=None,
    vocab_start: int | None = None,
    cp_group=None,
    sampling_threshold: torch.Tensor | None = None,
    kept_tokens=None,
    config: GSPOConfig | None = None,
    **options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO policy loss (Qwen, arXiv 2507.18071) with a fused logits gradient.

    Shapes: padded logits `(B, T, V)` with per-token inputs `(B, T)` and advantages `(B,)` or
    `(B, T)`; packed logits `(N, V)` with `cu_seqlens (S+1,)`, per-token inputs `(N,)` and
    advantages `(S,)` or `(N,)` (when S == N they are read per sequence).

    The keyword arguments above are this call's tensors. Every other keyword is a loss option
    (level, eps_low, eps_high, temperature, logit_scale, logit_softcap, loss_agg, objective, beta, ...: the fields of
    GSPOConfig, defined in docs/semantics.md); alternatively pass a ready
    `config=GSPOConfig(...)`, validated once.

    Returns the scalar loss (float32; float64 for float64 logits) and a dict of detached
    metrics: token_logprobs, entropy (per token), seq_ratio (per sequence), clip_frac,
    clip_frac_low, clip_frac_high, seq_clip_frac_low, seq_clip_frac_high, entropy_mean, kl
    when ref_logprobs is given, and those of the corrections in use. With inplace=True the
    backward pass may overwrite the logits with their gradient: do not read the logits after
    calling backward.

    Distributed (docs/distributed.md): tp_group for vocab-parallel logits (this rank's slice
    of V starting at vocab_start, default rank * V_local; global target ids), cp_group for
    context parallelism (this rank's part of every sequence). Every rank then returns the
    loss and metrics of the whole problem, and its gradient is its slice of the whole one.

    kept_tokens (a KeptTokens): the engine's kept set of every token row; the log-probs (and
    entropies) are then those of the softmax over each set (selective_log_softmax).
    """
    call = CallInputs(mask=mask, cu_seqlens=cu_seqlens, ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs,
                      normalizer=normalizer, entropy_threshold=entropy_threshold, cp_group=cp_group, tp_group=tp_group,
                      vocab_start=vocab_start, sampling_threshold=sampling_threshold, kept_tokens=kept_tokens)
    return _gspo_loss_with_config(resolve_config(config, options), logits, target_ids, old_logprobs, advantages, call)


class GSPOLoss(torch.nn.Module):
    """`nn.Module` form of gspo_loss: options fixed (and validated) once at construction.

        loss_fn = GSPOLoss(level="sequence", eps_low=3e-4, eps_high=4e-4)
        loss, metrics = loss_fn(logits, target_ids, old_logprobs, advantages, mask=mask)
    """

    def __init__(self, **options) -> None:
        super().__init__()
        self.config = GSPOConfig(**options)

    def forward(self, logits, target_ids, old_logprobs, advantages, **tensors):
        """Takes gspo_loss's per-call keywords: mask, cu_seqlens, ref_logprobs,
        rollout_logprobs, normalizer, entropy_threshold, tp_group, vocab_start, cp_group,
        sampling_threshold, kept_tokens."""
        call = CallInputs.of("GSPOLoss", tensors, refused=("token_weights",))
        return _gspo_loss_with_config(self.config, logits, target_ids, old_logprobs, advantages, call)

    def extra_repr(self) -> str:
        return repr(self.config)
