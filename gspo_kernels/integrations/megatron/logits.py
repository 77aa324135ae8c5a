"""GSPO and the token log-probs on Megatron-Core's vocab-parallel logits, as its output layer
(a ColumnParallelLinear) lays them out: each tensor-parallel rank holds the slice
[rank * V / tp, (rank + 1) * V / tp) of the vocabulary, sequence-first `[s, b, V / tp]`
(or batch-first `[b, s, V / tp]`), or packed in Megatron's THD format, `[t, 1, V / tp]` with
cu_seqlens. Labels and the loss mask are batch-first `[b, s]` (packed: `[1, t]` or `[t]`), as
Megatron's data iterators give them.

Nothing is copied: a sequence-first shard is read through a transposed view, and the kernels
keep O(tokens) statistics where megatron-core's own cross entropy keeps a float32 softmax of
the shard for backward. The groups default to megatron.core.parallel_state's (tensor and
context parallel) when it is initialised; context parallelism needs nothing more than each
rank's own tokens, whichever way Megatron chunked the sequences (docs/distributed.md)."""

from __future__ import annotations

import torch

from ...inputs.checks import check_values
from ...loss import gspo_loss as _gspo_loss
from ...token_stats.on_logits import selective_log_softmax

_FROM_MEGATRON = object()  # a group argument not given: megatron.core.parallel_state's


def _parallel_state():
    try:
        from megatron.core import parallel_state
    except ImportError:
        return None
    return parallel_state if parallel_state.model_parallel_is_initialized() else None


def megatron_groups(tp_group=_FROM_MEGATRON, cp_group=_FROM_MEGATRON):
    """(tp_group, cp_group): the ones given, else megatron.core.parallel_state's when it is
    initialised and the size is above 1, else None (one rank holds the whole dimension)."""
    state = _parallel_state()
    if tp_group is _FROM_MEGATRON:
        tp_group = None
        if state is not None and state.get_tensor_model_parallel_world_size() > 1:
            tp_group = state.get_tensor_model_parallel_group()
    if cp_group is _FROM_MEGATRON:
        cp_group = None
        if state is not None and state.get_context_parallel_world_size() > 1:
            cp_group = state.get_context_parallel_group()
    return tp_group, cp_group


def _batch_first(logits: torch.Tensor, sequence_first: bool, packed: bool) -> torch.Tensor:
    """Megatron's logits as gspo_kernels reads them: `(b, s, V)` padded, `(t, V)` packed; views only."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"Megatron logits are 3-D, [s, b, V/tp] (sequence_first=True) or [b, s, V/tp]; got {shape}")
    rows = logits.transpose(0, 1) if sequence_first else logits
    if not packed:
        return rows
    if rows.shape[0] != 1:
        raise ValueError(f"packed (THD) logits hold one batch row: [t, 1, V/tp] or [1, t, V/tp]; got "
                         f"{tuple(logits.shape)} with sequence_first={sequence_first}")
    return rows[0]


def packed_tokens(value):
    """A packed per-token input as `[t]`: Megatron's `[1, t]` or `[t]`."""
    if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[0] == 1:
        return value[0]
    return value


def response_mask(loss_mask):
    """Megatron's loss mask (float 0/1, or bool) as a bool mask; a weight other than 0 and 1
    is refused, since the loss would silently treat it as 1 (on the host for a CPU tensor, by an
    asynchronous device-side assert on a GPU: no sync)."""
    if loss_mask is None or not isinstance(loss_mask, torch.Tensor) or not loss_mask.dtype.is_floating_point:
        return loss_mask
    check_values(((loss_mask == 0) | (loss_mask == 1)).all(),
                 "loss_mask must hold only 0 and 1: per-token weights other than 0/1 are not a mask; pass them "
                 "to gk.policy_loss as token_weights")
    return loss_mask != 0


def token_logprobs(logits, labels, *, sequence_first: bool = True, packed: bool = False, temperature: float = 1.0,
                   return_entropy: bool = False, loss_mask=None, tp_group=_FROM_MEGATRON, backend: str = "auto",
                   logit_scale: float = 1.0, logit_softcap: float | None = None, kept_tokens=None):
    """log_softmax(logits / temperature) at the labels over the whole vocabulary, from this
    rank's vocab shard: what megatron-core's `-vocab_parallel_cross_entropy` gives, shaped like
    the labels (`[b, s]`, packed `[t]`), float32; with return_entropy also the per-token entropy.
    logit_scale, logit_softcap: the model's own transforms, as selective_log_softmax takes them.
    Differentiable; backward writes this shard's gradient in one pass. loss_mask: rows outside it
    get an exact zero gradient and are not read in backward. kept_tokens (a gk.KeptTokens over the
    global vocabulary, rows in the labels' order `[b, s]` or `[t]`): over the engine's kept sets."""
    tp_group, _ = megatron_groups(tp_group, None)
    rows = _batch_first(logits, sequence_first, packed)
    mask = response_mask(loss_mask)
    if packed:
        labels, mask = packed_tokens(labels), packed_tokens(mask)
    return selective_log_softmax(rows, labels, temperature, return_entropy, backend=backend, mask=mask,
                                 tp_group=tp_group, logit_scale=logit_scale, logit_softcap=logit_softcap,
                                 kept_tokens=kept_tokens)


def gspo_loss(logits, labels, old_logprobs, advantages, *, loss_mask=None, sequence_first: bool = True,
              cu_seqlens=None, tp_group=_FROM_MEGATRON, cp_group=_FROM_MEGATRON, **per_call_and_options):
    """gk.gspo_loss on Megatron's vocab-parallel logits: padded `[s, b, V/tp]` (or batch-first
    with sequence_first=False) with `[b, s]` labels, old log-probs and loss mask and `(b,)` or
    `[b, s]` advantages; packed THD `[t, 1, V/tp]` with cu_seqlens `(S+1,)` and `[t]` (or
    `[1, t]`) per-token inputs. Every other keyword is gk.gspo_loss's (its per-call tensors and
    its loss options). Returns (loss, metrics), the whole problem's on every rank."""
    tp_group, cp_group = megatron_groups(tp_group, cp_group)
    packed = cu_seqlens is not None
    rows = _batch_first(logits, sequence_first, packed)
    mask = response_mask(loss_mask)
    if packed:
        labels, old_logprobs, mask, advantages = (packed_tokens(v) for v in (labels, old_logprobs, mask, advantages))
        for key in ("ref_logprobs", "rollout_logprobs"):
            if key in per_call_and_options:
                per_call_and_options[key] = packed_tokens(per_call_and_options[key])
    return _gspo_loss(rows, labels, old_logprobs, advantages, mask=mask, cu_seqlens=cu_seqlens, tp_group=tp_group,
                      cp_group=cp_group, **per_call_and_options)
