"""Fused linear over the engine's kept sets (kept_tokens): only the lm_head rows of each token's
kept ids are multiplied (kept_products.py), N k H multiply-adds in place of N V H, and their
softmax is taken over the set (token_stats/kept_softmax.py). Backward scatters `d weight` into
the kept ids' rows, summed in a fixed order (no atomics).

Nothing of size V is formed but the gradients of weight and bias. It replaces the chunked and
tile paths whenever kept_tokens is given: nothing in the loss needs the whole vocabulary (its
entropy is the set's, as the log-probs are).
"""

from __future__ import annotations

import torch

from ..distributed.collectives import sum_over_ranks
from ..inputs.kept_tokens import KeptTokens
from ..token_stats.kept_softmax import KeptEntries, kept_grad, kept_stats
from ..token_stats.upstream import upstream_grads
from .kept_products import KeptProducts
from .plan import LinearPlan


def _as_full_product(d_weight: torch.Tensor, hidden: torch.Tensor, entries: KeptEntries) -> torch.Tensor:
    """d weight as the full vocabulary's product dz.T @ hidden gives it where hidden has a
    non-finite value in column j (a rare path, a loop over such columns). There each id a row
    does not keep contributes 0 times it, which is NaN: column j is NaN but at the ids that every
    such row keeps, and wholly NaN when one of the values is NaN (NaN times anything)."""
    # A float32 column sum is finite when the column is (a NaN or inf carries into it; a finite
    # column that overflows only sends it to the exact test): one reduction, where isfinite's
    # compare, abs and any took 2.5 ms of a 21 ms step at k = 64 (2-core AMX Xeon, N = 2048).
    if bool(torch.isfinite(hidden.sum(0, dtype=torch.float32)).all()):  # a host sync, as check_call's
        return d_weight
    bad = ~torch.isfinite(hidden)
    columns = bad.any(0)
    for j in columns.nonzero().flatten().tolist():
        rows = bad[:, j].nonzero().flatten()
        if bool(torch.isnan(hidden[rows, j]).any()):
            d_weight[:, j] = float("nan")
            continue
        in_rows = torch.isin(entries.row_index, rows)
        times_kept = torch.zeros(d_weight.shape[0], dtype=torch.int64, device=d_weight.device)
        times_kept.index_add_(0, entries.ids[in_rows], torch.ones_like(entries.ids[in_rows]))
        everywhere = times_kept == rows.numel()
        d_weight[~everywhere, j] = float("nan")
    return d_weight


class KeptRowsTokenStats(torch.autograd.Function):
    """(hidden `[N, H]`, weight `[V, H]`, bias) -> (logp, entropy) `[N]` over each row's kept set."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, row_mask, plan: LinearPlan, kept: KeptTokens,
                target_pos: torch.Tensor):
        entries = KeptEntries.of(kept, target_pos, plan.tp_slice)
        products = KeptProducts.of(entries, hidden, weight)
        x = products.logits()
        if bias is not None:
            x = x + bias.index_select(0, entries.ids).to(x.dtype)
        z = plan.logit_map.apply_(x)
        logp, entropy, lse = kept_stats(z, entries)
        if plan.tp_slice is not None:
            _, owned = plan.tp_slice.local_targets(targets)
            logp, entropy, lse = plan.tp_slice.merge(logp, entropy, lse, owned)
        ctx.save_for_backward(hidden, weight, bias, z, lse, entropy, row_mask)
        ctx.plan, ctx.entries, ctx.products = plan, entries, products
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        none = (None,) * 5
        if grad_logp is None and grad_entropy is None:
            return (None, None, None) + none
        hidden, weight, bias, z, lse, entropy, row_mask = ctx.saved_tensors
        plan, entries, products = ctx.plan, ctx.entries, ctx.products
        grad_logp, grad_entropy = upstream_grads(grad_logp, grad_entropy, lse)
        dx = kept_grad(z, entries, lse, entropy, grad_logp, grad_entropy, row_mask, plan.logit_map)
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        # A slice's partial d hidden is summed over ranks in float32, then rounded once; each id's
        # d weight is summed in float32 whatever weight_grad_fp32 says, then rounded once.
        d_hidden, d_weight, d_bias = products.grads(dx, need_hidden, need_weight or need_bias,
                                                    round_hidden=not plan.reduce_hidden_grad)
        if d_hidden is not None:
            if plan.reduce_hidden_grad:
                d_hidden = sum_over_ranks(d_hidden, plan.tp_slice.group, plan.linear.batch_invariant)
            d_hidden = d_hidden.to(hidden.dtype)
        d_weight = _as_full_product(d_weight, hidden, entries) if need_weight else None
        d_bias = d_bias.to(bias.dtype) if need_bias else None
        return (d_hidden, d_weight, d_bias) + none
