"""Stages 1 and 3 in plain PyTorch: the portable fallback, and the float64 path for gradcheck.

It works on whole `[N, V]` rows in float32 (float64 for float64 logits), reusing two such
buffers in place, so it needs about 2 x N x V x 4 bytes of scratch and several passes over
them: slower and hungrier than the fused backends, but it runs anywhere, on any dtype, and
traces under torch.compile. It follows the same contract as the fused backends
(see `backends/__init__.py`), including the NaN and -inf conventions.
"""

from __future__ import annotations

import torch

from ..config.logit_map import LogitMap
from .contract import LOG_FLOOR, GradInputs, StatsInputs


def _scaled_rows(logits: torch.Tensor, logit_map: LogitMap) -> torch.Tensor:
    """A fresh float32 (or float64) copy of the logits as `[N, V]`, through the logit map."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    rows = logits.reshape(-1, logits.shape[-1]).to(dtype, copy=True)
    return logit_map.apply_(rows)


def _valid(targets: torch.Tensor, vocab: int) -> torch.Tensor:
    return (targets >= 0) & (targets < vocab)


def _outside_kept(logits: torch.Tensor, kept_min: torch.Tensor | None):
    """`[N, V]` bool: the logits below their row's kept_min (None when every token is kept)."""
    if kept_min is None:
        return None
    rows = logits.reshape(-1, logits.shape[-1])
    return rows.to(kept_min.dtype) < kept_min.reshape(-1, 1)


def token_stats(logits: torch.Tensor, inputs: StatsInputs):
    """Returns (logp, entropy, lse), each float32 (float64 for float64 logits) of the targets'
    shape."""
    shape, targets = inputs.targets.shape, inputs.targets.reshape(-1)
    z = _scaled_rows(logits, inputs.logit_map)
    outside = _outside_kept(logits, inputs.kept_min)
    if outside is not None:
        z.masked_fill_(outside, float("-inf"))
    vocab = z.shape[-1]
    row_max = z.amax(dim=-1, keepdim=True)  # NaN-propagating: a NaN row stays NaN
    # An all -inf row shifts by 0 (its results are NaN either way); +inf stays, giving NaN.
    row_max = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
    z.sub_(row_max)
    e = torch.exp(z)
    sum_e = e.sum(dim=-1, keepdim=True)
    log_sum = sum_e.log()
    valid = _valid(targets, vocab)
    picked = z.gather(-1, targets.clamp(0, vocab - 1).long().unsqueeze(-1))
    # (z_y - max) - log(sum): no rounding of lse when the logits are large.
    logp = torch.where(valid, (picked - log_sum).squeeze(-1), torch.full_like(log_sum.squeeze(-1), float("nan")))
    shifted = e.mul_(z.clamp_(min=LOG_FLOOR)).sum(dim=-1, keepdim=True)
    entropy = (log_sum - shifted / sum_e).squeeze(-1)
    return logp.reshape(shape), entropy.reshape(shape), (row_max + log_sum).reshape(shape)


def softmax_terms_(z: torch.Tensor, inputs: GradInputs) -> torch.Tensor:
    """Each logit's gradient but the target's one-hot term and the map's slope,
    -p (g + h (log p + H)), in place on z `[N, k]` (the mapped logits, -inf outside the kept
    set; inputs as `[N]` rows). The fix-up of a vocab slice's foreign rows (token_stats/
    slice_grad.py) takes it too."""
    log_p = z.sub_(inputs.lse.unsqueeze(-1))
    grad = torch.exp(log_p)
    g = inputs.grad_logp.to(grad.dtype).unsqueeze(-1)
    if inputs.grad_entropy is None:
        return grad.mul_(-g)
    h = inputs.grad_entropy.to(grad.dtype).unsqueeze(-1)
    coef = log_p.clamp_(min=LOG_FLOOR).add_(inputs.entropy.to(grad.dtype).unsqueeze(-1)).mul_(h).add_(g)
    return grad.mul_(coef).neg_()


def _grad_rows(logits, inputs: GradInputs):
    inputs = inputs.as_rows()
    lse, targets = inputs.lse, inputs.targets
    z = _scaled_rows(logits, inputs.logit_map)
    slope = inputs.logit_map.slope(z)  # before z becomes log p in place
    outside = _outside_kept(logits, inputs.kept_min)
    if outside is not None:
        z.masked_fill_(outside, float("-inf"))
    grad = softmax_terms_(z, inputs)
    g = inputs.grad_logp.to(grad.dtype).unsqueeze(-1)
    vocab = grad.shape[-1]
    valid = _valid(targets, vocab)
    one_hot_rows = valid if outside is None else valid & ~outside.gather(-1, targets.clamp(0, vocab - 1)
                                                                            .long().unsqueeze(-1)).squeeze(-1)
    one_hot = torch.where(one_hot_rows.unsqueeze(-1), g, torch.zeros_like(g))
    grad.scatter_add_(-1, targets.clamp(0, vocab - 1).long().unsqueeze(-1), one_hot)
    grad.mul_(slope)
    # The row rule of GradInputs, applied after the fact (this backend reads every row anyway).
    has_upstream = inputs.grad_logp != 0
    if inputs.grad_entropy is not None:
        has_upstream = has_upstream | (inputs.grad_entropy != 0)
    make_nan = ~torch.isfinite(lse) | ~valid
    if inputs.row_mask is not None:
        make_nan = make_nan & inputs.row_mask
        has_upstream = has_upstream & inputs.row_mask
    grad.masked_fill_(~has_upstream.unsqueeze(-1), 0.0)
    return grad.masked_fill_(make_nan.unsqueeze(-1), float("nan"))


def logits_grad(logits, inputs: GradInputs):
    """dLoss/dlogits in a new tensor shaped and typed like `logits`."""
    return _grad_rows(logits, inputs).to(logits.dtype).reshape(logits.shape)


def logits_grad_(logits, inputs: GradInputs):
    """Same as logits_grad, written into the logits' own storage."""
    logits.copy_(_grad_rows(logits, inputs).reshape(logits.shape))
    return logits
