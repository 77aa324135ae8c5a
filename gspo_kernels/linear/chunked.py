"""The chunked fused-linear path, every backend: rows are taken `chunk` at a time; a chunk's
logits z = hidden @ weight.T (+ bias) are formed in float32 by one matmul (products.py), the
backend's stage-1 kernel reads them, and they are dropped. Backward (sweeps.py) forms the logits
again a buffer at a time, runs the stage-3 kernel over them in place (dz), and takes `d hidden`,
`d weight` and `d bias` from dz by matmuls: over chunks of rows, accumulating `d weight` in
float32, or over blocks of vocab columns, accumulating `d hidden`, whichever accumulator is
smaller (no atomics: the same inputs give the same bits).

Nothing `[N, V]` is kept: what survives forward is the inputs and O(N) statistics. Peak memory
is one float32 buffer of logits plus the smaller accumulator; on a CPU, for 16-bit inputs, also
float32 copies of the operands while a pass runs (CPUs without native bf16 multiply it 10-80x
slower than fp32, so both operands are upcast there).
"""

from __future__ import annotations

import torch

from .. import backends
from ..backends.contract import GradInputs, StatsInputs
from ..distributed.collectives import sum_over_ranks
from ..token_stats.kept_set import kept_set_stats
from ..token_stats.upstream import nan_lse_for_bad_targets, upstream_grads

from .plan import LinearPlan
from .invariant import invariant_logits
from .products import Operands
from .sweeps import SavedPass, choose_sweep, rows_sweep, vocab_sweep


class FusedLinearTokenStats(torch.autograd.Function):
    """(hidden `[N, H]`, weight `[V, H]`, bias) -> (logp, entropy) `[N]`, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, row_mask, plan: LinearPlan):
        backend = backends.get(plan.backend_name)
        rows = hidden.shape[0]
        stats_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        logp, entropy, lse = (torch.empty(rows, dtype=stats_dtype, device=hidden.device) for _ in range(3))
        kept_min = None if plan.sampling is None else torch.empty(rows, dtype=torch.float32, device=hidden.device)
        owned = None
        if plan.tp_slice is not None:
            targets, owned = plan.tp_slice.local_targets(targets)
        ops = Operands(weight, bias)
        for start in range(0, rows, plan.chunk):
            part = slice(start, min(start + plan.chunk, rows))
            if plan.blocks is None:
                logits = ops.logits(hidden[part])
            else:
                logits = invariant_logits(weight, bias, hidden[part], plan.blocks)
            inputs = StatsInputs(targets[part], plan.logit_map)
            if kept_min is None:
                logp[part], entropy[part], lse[part] = backend.token_stats(logits, inputs)
            else:  # the sampler's kept set, from this chunk's logits
                logp[part], entropy[part], lse[part], kept_min[part] = kept_set_stats(
                    backend, logits, inputs, plan.sampling, plan.backend_name)
        if plan.tp_slice is not None:
            # One merge for all rows after the loop: two collectives per call, not per chunk.
            logp, entropy, lse = plan.tp_slice.merge(logp, entropy, lse, owned)  # lse NaN where no single owner
        else:
            lse = nan_lse_for_bad_targets(lse, targets, weight.shape[0])  # for the vocab sweep's blocks
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy, row_mask, owned, kept_min)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse, entropy, row_mask, owned, kept_min = ctx.saved_tensors
        plan = ctx.plan
        none = (None,) * 3
        if grad_logp is None and grad_entropy is None:
            return (None, None, None) + none
        backend = backends.get(plan.backend_name)
        need = tuple(ctx.needs_input_grad[:3])
        grad_logp, grad_entropy = upstream_grads(grad_logp, grad_entropy, lse)
        saved = SavedPass(hidden, weight, bias, owned,
                          GradInputs(targets, lse, entropy, grad_logp, grad_entropy, row_mask, plan.logit_map,
                                     kept_min))
        reduce_hidden_grad = plan.reduce_hidden_grad
        fp32 = plan.weight_grad_fp32
        if plan.blocks is not None:  # one sweep whatever N is: a row's d hidden must not follow it
            sweep = "vocab"
        else:
            sweep = choose_sweep(hidden.shape[0], weight.shape[0], need[0], need[1], fp32, weight.dtype)
        if sweep == "vocab":
            d_hidden, d_weight, d_bias = vocab_sweep(backend, saved, plan.chunk, need, plan.blocks)
        else:
            # A slice's partial d hidden is summed over ranks in float32, then rounded once.
            d_hidden, d_weight, d_bias = rows_sweep(backend, saved, plan.chunk, need, reduce_hidden_grad, fp32)
        if d_hidden is not None and reduce_hidden_grad:
            d_hidden = sum_over_ranks(d_hidden, plan.tp_slice.group, plan.linear.batch_invariant)
        return (None if d_hidden is None else d_hidden.to(hidden.dtype),
                None if d_weight is None else d_weight.to(weight.dtype),
                None if d_bias is None else d_bias.to(bias.dtype)) + none
