"""The one-pass schedule of the fused-linear loss: the gradient formed in forward, while each
group of whole sequences' logits are at hand.

A token's loss coefficients (g = dLoss/dlogp, h = dLoss/dH) read only its own sequence and the
whole batch's aggregation weight, so once a group of whole sequences has its log-probs, stage 2
gives its coefficients (sequence/gspo_objective.py: sequence_coefficients), stage 3 turns the
group's logits into dz in place, and `d hidden` rows, `d weight` and `d bias` are taken from dz
at once. The logits are formed once: 6NVH multiply-adds where two passes take 8NVH (2NVH with a
frozen lm_head: forward and `d hidden` only, 4NVH in all). Backward only scales the gradients by
the loss's upstream gradient. Memory: the group's logits, the float32 `d weight` accumulator
(V x H float32, or in the weight's dtype per weight_grad_fp32, then it is the gradient returned)
and `d hidden` (N x H float32) from
forward to backward.

Under no_grad, or with nothing to differentiate, forward forms no gradient. A second backward
is refused: the gradients are handed over once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import backends
from ..backends.contract import GradInputs, StatsInputs
from ..distributed.collectives import sum_over_ranks
from ..inputs.batch import LossBatch
from ..inputs.sequence_groups import SequenceGroup, group_aggregation
from ..sequence.gspo_objective import aggregation_weight, gspo_objective, sequence_coefficients
from ..token_stats.kept_set import kept_set_stats
from ..token_stats.slice_grad import slice_logits_grad
from ..token_stats.upstream import nan_lse_for_bad_targets, upstream_grads
from .plan import LinearPlan
from .products import Operands


@dataclass
class OnePassLoss:
    """One call's loss inputs for the one-pass schedule; `metrics` is filled by the pass."""

    config: object  # GSPOConfig
    batch: LossBatch
    groups: list[SequenceGroup]
    metrics: dict | None = None


def one_pass_loss(hidden, weight, bias, plan: LinearPlan, job: OnePassLoss):
    """(loss, metrics) of the fused-linear loss on the one-pass schedule."""
    need = tuple(torch.is_grad_enabled() and t is not None and t.requires_grad for t in (hidden, weight, bias))
    if not any(need):
        loss, _ = _run(hidden, weight, bias, plan, job, need)
        return loss, job.metrics
    loss = OnePassLinearLoss.apply(hidden, weight, bias, plan, job, need)
    return loss, job.metrics


class OnePassLinearLoss(torch.autograd.Function):
    """(hidden `[N, H]`, weight `[V, H]`, bias) -> the loss, its gradients formed in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, plan: LinearPlan, job: OnePassLoss, need):
        loss, grads = _run(hidden, weight, bias, plan, job, need)
        ctx.grads = grads
        ctx.dtypes = tuple(None if t is None else t.dtype for t in (hidden, weight, bias))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError("fused_linear_gspo_loss (one-pass schedule) formed its gradients in forward and has "
                               "handed them over already: a second backward through the same forward (retain_graph) "
                               "cannot be served. Run forward again, or pass schedule='two_pass'")
        grads, ctx.grads = ctx.grads, None
        out = []
        for grad, dtype in zip(grads, ctx.dtypes):
            if grad is None:
                out.append(None)
                continue
            # Scaled in the accumulation dtype and rounded once, in one pass (loss scaling,
            # gradient accumulation: grad_loss need not be 1); in place where it is in the
            # input's dtype already (no second V x H buffer).
            # A CPU reads grad_loss without a sync; a traced backward may not branch on it.
            if not torch.compiler.is_compiling() and grad_loss.device.type == "cpu" and bool(grad_loss == 1):
                out.append(grad if grad.dtype == dtype else grad.to(dtype))
            elif grad.dtype == dtype:
                out.append(_scale_(grad, grad_loss))
            else:
                out.append(torch.mul(grad, grad_loss.to(grad.dtype),
                                     out=torch.empty(grad.shape, dtype=dtype, device=grad.device)))
        return (*out, None, None, None)


def _run(hidden, weight, bias, plan: LinearPlan, job: OnePassLoss, need):
    """(loss, (d hidden, d weight, d bias) in the accumulation dtype, each None where not needed)."""
    config, batch = job.config, job.batch
    backend = backends.get(plan.backend_name)
    rows, vocab = hidden.shape[0], weight.shape[0]
    stats_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logp, entropy = (torch.empty(rows, dtype=stats_dtype, device=hidden.device) for _ in range(2))
    targets = batch.targets.reshape(-1)
    row_mask = batch.row_mask.reshape(-1) if batch.row_mask is not None else None
    owned = None
    if plan.tp_slice is not None:
        targets, owned = plan.tp_slice.local_targets(targets)
    ops = Operands(weight, bias)
    grads = _Gradients(hidden, weight, bias, ops, need, plan)
    aggregation = aggregation_weight(config, batch, stats_dtype) if grads.any else None
    longest = max(group.rows.stop - group.rows.start for group in job.groups)
    # One logits buffer for every group on a CPU, where a fresh one is mapped page by page each
    # time (a GPU's caching allocator hands the same block back anyway).
    on_cpu = hidden.device.type == "cpu"
    buffer = torch.empty(longest, vocab, dtype=ops.logits_dtype, device=hidden.device) if on_cpu else None
    for group in job.groups:
        part = group.rows
        logits = ops.logits(hidden[part], None if buffer is None else buffer[:part.stop - part.start])
        inputs = StatsInputs(targets[part], plan.logit_map)
        kept_min = None
        if plan.sampling is None:
            lp, ent, lse = backend.token_stats(logits, inputs)
        else:  # the sampler's kept set, from this group's logits
            lp, ent, lse, kept_min = kept_set_stats(backend, logits, inputs, plan.sampling, plan.backend_name)
        if plan.tp_slice is not None:  # two collectives per group, O(rows)
            lp, ent, lse = plan.tp_slice.merge(lp, ent, lse, owned[part])
        else:
            lse = nan_lse_for_bad_targets(lse, targets[part], vocab)
        logp[part], entropy[part] = lp, ent
        if not grads.any:
            continue
        shape = group.batch.token_shape
        g, h = sequence_coefficients(config, group.batch, lp.view(shape), ent.view(shape),
                                     group_aggregation(aggregation, group.seqs))
        grad_logp, grad_entropy = upstream_grads(g, h, lse)
        inputs = GradInputs(targets[part], lse, ent, grad_logp, grad_entropy,
                            None if row_mask is None else row_mask[part], plan.logit_map, kept_min)
        dz = slice_logits_grad(backend, logits, inputs, None if owned is None else owned[part], in_place=True)
        grads.add(part, dz, inputs)
    loss, job.metrics = gspo_objective(config, batch, logp.view(batch.token_shape), entropy.view(batch.token_shape))
    return loss, grads.finish()


class _Gradients:
    """The gradients a pass forms, group by group: `d hidden` rows written once, `d weight` and
    `d bias` summed over the groups in order (no atomics: the same inputs give the same bits)."""

    def __init__(self, hidden, weight, bias, ops: Operands, need, plan: LinearPlan):
        need_h, need_w, need_b = need
        self.any = any(need)
        self.hidden, self.ops, self.plan = hidden, ops, plan
        self.d_hidden = torch.empty(hidden.shape, dtype=ops.accum_dtype, device=hidden.device) if need_h else None
        # The first group writes it (no zero fill: a fresh buffer's pages are mapped once).
        self.d_weight = torch.empty(weight.shape, dtype=ops.weight_grad_dtype(plan.weight_grad_fp32),
                                    device=weight.device) if need_w else None
        self.first = True
        self.d_bias = torch.zeros(weight.shape[0], dtype=ops.accum_dtype, device=weight.device) if need_b else None

    def add(self, part: slice, dz: torch.Tensor, inputs: GradInputs) -> None:
        if self.d_weight is not None:
            self.ops.add_weight_grad(self.d_weight, dz, self.hidden[part], first=self.first)
        self.first = False
        if self.d_bias is not None:
            self.d_bias += dz.sum(0, dtype=self.d_bias.dtype)
        if self.d_hidden is not None:
            self.d_hidden[part] = self.ops.hidden_grad(dz, bad_rows=inputs.nan_rows() if self.ops.cpu_bf16 else None)

    def finish(self):
        d_hidden = self.d_hidden
        if d_hidden is not None and self.plan.reduce_hidden_grad:
            # A slice's partial d hidden, summed over the ranks in float32 before it is rounded.
            d_hidden = sum_over_ranks(d_hidden, self.plan.tp_slice.group, self.plan.linear.batch_invariant)
        return d_hidden, self.d_weight, self.d_bias


def _scale_(grad: torch.Tensor, scale: torch.Tensor, block_bytes: int = 64 << 20) -> torch.Tensor:
    """grad *= scale in place, multiplied in float32 for a 16-bit grad (scale rounded to bf16
    would be off by up to 2^-9: 1/3 becomes 0.33398), a block of rows at a time so that no
    float32 copy of the whole V x H gradient is made."""
    if grad.dtype in (torch.float32, torch.float64):
        return grad.mul_(scale.to(grad.dtype))
    scale = scale.float()
    rows = max(1, block_bytes // max(1, 4 * grad[0].numel()))
    for start in range(0, grad.shape[0], rows):
        block = grad[start:start + rows]
        block.copy_(block.float().mul_(scale))
    return grad
