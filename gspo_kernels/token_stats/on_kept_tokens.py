"""Stages 1 and 3 over the engine's kept sets (kept_tokens): the logits of each row's kept ids are
gathered (nnz values), their softmax taken over the set alone (kept_softmax.py), and backward
writes the gradient of those logits only; every other logit's gradient is 0.

The work beside the gradient's zero fill is O(nnz) whatever the backend option says (C++ for
float32 on a CPU, PyTorch ops elsewhere: kept_softmax.py). Backward reads the saved mapped logits
of the entries, not the logits: with inplace=True it zeroes the logits' storage and writes the
gradient there.
"""

from __future__ import annotations

import torch

from ..backends.layout import writable_in_place
from ..config.logit_map import LogitMap
from ..distributed.vocab_parallel import VocabSlice
from ..inputs.kept_tokens import KeptTokens
from .kept_softmax import KeptEntries, kept_grad, kept_stats
from .upstream import upstream_grads


def _entry_index(logits: torch.Tensor, entries: KeptEntries) -> tuple:
    """The advanced index of the entries in `(B, T, V)` or `(N, V)` logits (no copy of a strided view)."""
    if logits.dim() == 3:
        steps = logits.shape[1]
        return entries.row_index // steps, entries.row_index % steps, entries.ids
    return entries.row_index, entries.ids


class KeptTokenStatsFunction(torch.autograd.Function):
    """(logits, targets) -> (logp, entropy) over each row's kept set, both of the targets' shape."""

    @staticmethod
    def forward(ctx, logits, targets, row_mask, logit_map: LogitMap, kept: KeptTokens, target_pos: torch.Tensor,
                tp_slice: VocabSlice | None, inplace: bool):
        entries = KeptEntries.of(kept, target_pos, tp_slice)
        index = _entry_index(logits, entries)
        stats_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        z = logit_map.apply_(logits[index].to(stats_dtype))
        logp, entropy, lse = kept_stats(z, entries)
        if tp_slice is not None:
            _, owned = tp_slice.local_targets(targets.reshape(-1))
            logp, entropy, lse = tp_slice.merge(logp, entropy, lse, owned)
        ctx.save_for_backward(logits, z, lse, entropy, row_mask)
        ctx.entries, ctx.index, ctx.logit_map, ctx.inplace = entries, index, logit_map, inplace
        ctx.set_materialize_grads(False)
        shape = targets.shape
        return logp.reshape(shape), entropy.reshape(shape)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        none = (None,) * 7
        if (grad_logp is None and grad_entropy is None) or not ctx.needs_input_grad[0]:
            return (None,) + none
        logits, z, lse, entropy, row_mask = ctx.saved_tensors
        grad_logp, grad_entropy = upstream_grads(grad_logp, grad_entropy, lse)
        mask = None if row_mask is None else row_mask.reshape(-1)
        dx = kept_grad(z, ctx.entries, lse, entropy, grad_logp, grad_entropy, mask, ctx.logit_map)
        if ctx.inplace and writable_in_place(logits):
            grad = logits.zero_()
            torch.autograd.graph.increment_version(logits)
        else:
            grad = torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)
        grad[ctx.index] = dx.to(logits.dtype)  # a NaN row is NaN at its kept logits: the others are not read
        return (grad,) + none


def kept_token_stats(logits, targets, logit_map: LogitMap, kept: KeptTokens, inplace: bool = False,
                     row_mask: torch.Tensor | None = None, tp_slice: VocabSlice | None = None):
    """logp and entropy over each row's kept set, after checking the sets against the call:
    targets are the contiguous int64 token-shaped ids, row_mask as in token_stats."""
    target_pos = check_kept_tokens(kept, targets, row_mask, logits.shape[-1], tp_slice)
    return KeptTokenStatsFunction.apply(logits, targets, row_mask, logit_map, kept, target_pos, tp_slice, inplace)


def check_kept_tokens(kept, targets, row_mask, local_vocab: int, tp_slice: VocabSlice | None) -> torch.Tensor:
    """kept is a KeptTokens of the call's rows, over its vocabulary (the global one with tp);
    returns each row's target position among the entries (KeptTokens.target_positions)."""
    if not isinstance(kept, KeptTokens):
        raise TypeError("kept_tokens must be a gspo_kernels.KeptTokens (CSR offsets and token ids per token row: "
                        f"KeptTokens(offsets, token_ids, vocab_size)); got {type(kept).__name__}")
    if tp_slice is None:
        vocab = local_vocab
    elif tp_slice.start + tp_slice.size > kept.vocab_size:
        raise ValueError(f"this rank's vocab slice [{tp_slice.start}, {tp_slice.start + tp_slice.size}) reaches past "
                         f"kept_tokens.vocab_size = {kept.vocab_size}")
    else:
        vocab = kept.vocab_size
    return kept.check_call(targets.numel(), vocab, targets.reshape(-1),
                           None if row_mask is None else row_mask.reshape(-1))


def no_other_kept_set(kept_tokens, sampling, sampling_threshold) -> None:
    """kept_tokens replaces the sampling options and sampling_threshold: one description of the set."""
    if kept_tokens is None:
        return
    if (sampling is not None and sampling.active) or sampling_threshold is not None:
        raise ValueError("pass the sampler's kept set one way: kept_tokens (the engine's own sets) or "
                         "sampling_top_k/_top_p/_min_p or sampling_threshold, not two")
