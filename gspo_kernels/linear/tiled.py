"""The fused-linear loss's Triton path: stages 1 and 3 in kernels that hold the logits only in
on-chip tiles (backends/triton/tile_kernels.py), behind one autograd Function.

Against the chunked path (chunked.py): no float32 chunk of logits in global memory and no
`dz` buffer, at the price of float32 atomics in backward (results vary in the last bits from run
to run) and a float32 `d hidden` accumulator. batch_invariant=True trades the atomics for two
backward kernels that each sum in a fixed order (the forward's tiles are of a fixed shape already). Gradient filtering (filter_eps > 0) skips the
products of tiles in which each row's probability mass is below filter_eps.
"""

from __future__ import annotations

import torch

from .. import backends
from ..backends.contract import GradInputs
from ..distributed.collectives import sum_over_ranks
from ..token_stats.upstream import nan_lse_for_bad_targets, upstream_grads



class TiledLinearTokenStats(torch.autograd.Function):
    """(hidden `[N, H]`, weight `[V, H]`, bias) -> (logp, entropy) `[N]`; see LinearPlan."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, row_mask, plan):
        triton_tiles = backends.triton_tiles  # LinearPlan.of checked that they run here
        tp_slice = plan.tp_slice
        if tp_slice is None:
            kernel_targets = targets
        else:
            local, owned = tp_slice.local_targets(targets)
            kernel_targets = torch.where(owned, local, torch.full_like(local, -1))  # -1: no one-hot here
        logp, entropy, lse = triton_tiles.token_stats(hidden, weight, bias, kernel_targets, plan.logit_map)
        if tp_slice is not None:
            logp, entropy, lse = tp_slice.merge(logp, entropy, lse, owned)  # lse NaN where no single owner
        else:
            lse = nan_lse_for_bad_targets(lse, targets, weight.shape[0])  # the kernels' row rule reads only lse
        ctx.save_for_backward(hidden, weight, bias, kernel_targets, lse, entropy, row_mask)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse, entropy, row_mask = ctx.saved_tensors
        plan = ctx.plan
        none = (None,) * 3
        if grad_logp is None and grad_entropy is None:
            return (None, None, None) + none
        grad_logp, grad_entropy = upstream_grads(grad_logp, grad_entropy, lse)
        need = tuple(ctx.needs_input_grad[:3])
        inputs = GradInputs(targets, lse, entropy, grad_logp, grad_entropy, row_mask, plan.logit_map)
        g = backends.triton_tiles.grads(hidden, weight, bias, inputs, need, plan.linear.grad_filter_eps,
                                        plan.linear.batch_invariant)
        d_hidden = g.hidden
        if d_hidden is not None and plan.reduce_hidden_grad:
            d_hidden = sum_over_ranks(d_hidden, plan.tp_slice.group, plan.linear.batch_invariant)
        return (None if d_hidden is None else d_hidden.to(hidden.dtype),
                None if g.weight is None else g.weight.to(weight.dtype),
                None if g.bias is None else g.bias.to(bias.dtype)) + none
