"""GSPO and the token log-probs from the hidden states and the output layer's weight shard
(Megatron's ColumnParallelLinear, `[V / tp, h]` on each tensor-parallel rank): the fused-linear
path, so that no rank ever holds its `[tokens, V / tp]` logits, not even in bf16.

The hidden states come as the output layer takes them: `[s, b, h]` replicated over the
tensor-parallel group, or with Megatron's sequence parallelism this rank's `[s / tp, b, h]` part
of the sequence dimension, which the output layer gathers over the group before its product and
whose gradient it reduce-scatters back. The same happens here: an all-gather forward; backward
sums each rank's partial `d hidden` over the group (in rank order with batch_invariant) and keeps
this rank's part. Packed (THD): `[t, 1, h]`, with cu_seqlens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...distributed.collectives import sum_over_ranks
from ...linear.api import fused_linear_gspo_loss, fused_linear_selective_log_softmax
from .logits import _FROM_MEGATRON, megatron_groups, packed_tokens, response_mask


class _GatherSequence(torch.autograd.Function):
    """Megatron's sequence-parallel gather of dim 0 over the tensor-parallel group; backward
    sums the gathered gradient over the group and keeps this rank's part."""

    @staticmethod
    def forward(ctx, part, group, in_rank_order: bool):
        world = dist.get_world_size(group)
        pieces = [torch.empty_like(part) for _ in range(world)]
        dist.all_gather(pieces, part.contiguous(), group=group)
        ctx.group, ctx.in_rank_order, ctx.rank, ctx.rows = group, in_rank_order, dist.get_rank(group), part.shape[0]
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad):
        total = sum_over_ranks(grad.contiguous(), ctx.group, ctx.in_rank_order)
        return total[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows], None, None


def _weight_and_bias(output_layer):
    """(weight, bias, sequence_parallel or None) of a ColumnParallelLinear, or of a weight tensor."""
    if isinstance(output_layer, torch.Tensor):
        return output_layer, None, None
    weight = getattr(output_layer, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError("output_layer must be the output layer (a ColumnParallelLinear, or any module with a "
                        f"`weight` of shape [V/tp, h]) or its weight tensor; got {type(output_layer).__name__}")
    bias = getattr(output_layer, "bias", None)
    if getattr(output_layer, "skip_bias_add", False):
        bias = None  # Megatron adds a skipped bias outside the layer: logits have none
    return weight, bias, getattr(output_layer, "sequence_parallel", None)


def _rows(hidden, sequence_parallel, tp_group, packed, batch_invariant):
    """The hidden states as fused linear reads them: `(b, s, h)`, packed `(t, h)`."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise ValueError(f"Megatron hidden states are [s, b, h] (with sequence parallelism [s/tp, b, h]); got {shape}")
    if sequence_parallel:
        if tp_group is None:
            raise ValueError("sequence_parallel=True gathers the hidden states over the tensor-parallel group: "
                             "initialise megatron.core.parallel_state or pass tp_group")
        hidden = _GatherSequence.apply(hidden, tp_group, batch_invariant)
    rows = hidden.transpose(0, 1)
    if packed:
        if rows.shape[0] != 1:
            raise ValueError(f"packed (THD) hidden states hold one batch row, [t, 1, h]; got {tuple(hidden.shape)}")
        rows = rows[0]
    return rows


def _sequence_parallel(flag, from_layer):
    return bool(from_layer) if flag is None else flag


def fused_output_gspo_loss(hidden, output_layer, labels, old_logprobs, advantages, *, loss_mask=None, cu_seqlens=None,
              sequence_parallel: bool | None = None, tp_group=_FROM_MEGATRON, cp_group=_FROM_MEGATRON,
              **per_call_and_options):
    """The GSPO loss from Megatron's hidden states `[s, b, h]` (`[s/tp, b, h]` with sequence
    parallelism; packed `[t, 1, h]` with cu_seqlens) and the output layer (a ColumnParallelLinear,
    or its `[V/tp, h]` weight): labels, old log-probs and the loss mask `[b, s]` (packed `[t]` or
    `[1, t]`), advantages `(b,)` or per token. sequence_parallel defaults to the layer's own flag.
    Every other keyword is fused_linear_gspo_loss's (its LinearConfig options and the loss's).
    Gradients reach the hidden states (this rank's part) and the weight and bias shards."""
    tp_group, cp_group = megatron_groups(tp_group, cp_group)
    weight, bias, layer_sp = _weight_and_bias(output_layer)
    sequence_parallel = _sequence_parallel(sequence_parallel, layer_sp)
    packed = cu_seqlens is not None
    batch_invariant = bool(per_call_and_options.get("batch_invariant", False))
    rows = _rows(hidden, sequence_parallel, tp_group, packed, batch_invariant)
    mask = response_mask(loss_mask)
    if packed:
        labels, old_logprobs, mask, advantages = (packed_tokens(v) for v in (labels, old_logprobs, mask, advantages))
    if sequence_parallel:  # the gather's backward sums d hidden over the group
        per_call_and_options["reduce_hidden_grad"] = False
    return fused_linear_gspo_loss(rows, weight, labels, old_logprobs, advantages, bias=bias, mask=mask,
                                  cu_seqlens=cu_seqlens, tp_group=tp_group, cp_group=cp_group, **per_call_and_options)


def fused_output_logprobs(hidden, output_layer, labels, *, loss_mask=None, packed: bool = False,
                   sequence_parallel: bool | None = None, temperature: float = 1.0, return_entropy: bool = False,
                   tp_group=_FROM_MEGATRON, **linear_options):
    """The token log-probs (and entropies) of the output layer's logits at the labels, from the
    hidden states as fused_output_gspo_loss takes them: shaped like the labels, float32, with the full
    backward to the hidden states and the weight and bias shards."""
    tp_group, _ = megatron_groups(tp_group, None)
    weight, bias, layer_sp = _weight_and_bias(output_layer)
    sequence_parallel = _sequence_parallel(sequence_parallel, layer_sp)
    rows = _rows(hidden, sequence_parallel, tp_group, packed, bool(linear_options.get("batch_invariant", False)))
    mask = response_mask(loss_mask)
    if packed:
        labels, mask = packed_tokens(labels), packed_tokens(mask)
    if sequence_parallel:
        linear_options["reduce_hidden_grad"] = False
    return fused_linear_selective_log_softmax(rows, weight, labels, bias=bias, temperature=temperature,
                                              return_entropy=return_entropy, mask=mask, tp_group=tp_group,
                                              **linear_options)
