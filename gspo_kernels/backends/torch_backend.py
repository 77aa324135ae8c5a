"""Stages 1 and 3 in plain PyTorch: the portable fallback, and the float64 path for gradcheck.

It works on whole `[N, V]` rows in float32 (float64 for float64 logits), reusing two such
buffers in place, so it needs about 2 x N x V x 4 bytes of scratch and several passes over
them: slower and hungrier than the fused backends, but it runs anywhere, on any dtype, and
traces under torch.compile. It follows the same contract as the fused backends
(see `backends/__init__.py`), including the NaN and -inf conventions.
"""

from __future__ import annotations

import torch

name = "torch"

# Log-probabilities below this are probability 0 even in float32; clamping there changes no
# value but keeps 0 * -inf (a -inf logit) out of the products. Same constant as csrc/gspo_math.h.
_LOG_FLOOR = -200.0


def _scaled_rows(logits: torch.Tensor, inv_temperature: float) -> torch.Tensor:
    """A fresh float32 (or float64) copy of the logits as `[N, V]`, divided by the temperature."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    rows = logits.reshape(-1, logits.shape[-1]).to(dtype, copy=True)
    return rows.mul_(inv_temperature)


def _valid(targets: torch.Tensor, vocab: int) -> torch.Tensor:
    return (targets >= 0) & (targets < vocab)


def token_stats(logits: torch.Tensor, targets: torch.Tensor, inv_temperature: float):
    """Returns (logp, entropy, lse), each `[N]` float32 (float64 for float64 logits)."""
    z = _scaled_rows(logits, inv_temperature)
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
    shifted = e.mul_(z.clamp_(min=_LOG_FLOOR)).sum(dim=-1, keepdim=True)
    entropy = (log_sum - shifted / sum_e).squeeze(-1)
    return logp, entropy, (row_max + log_sum).squeeze(-1)


def _grad_rows(logits, targets, lse, entropy, grad_logp, grad_entropy, inv_temperature):
    log_p = _scaled_rows(logits, inv_temperature).sub_(lse.unsqueeze(-1))
    grad = torch.exp(log_p)
    g = grad_logp.to(grad.dtype).unsqueeze(-1)
    if grad_entropy is None:
        grad.mul_(-g)
    else:
        h = grad_entropy.to(grad.dtype).unsqueeze(-1)
        coef = log_p.clamp_(min=_LOG_FLOOR).add_(entropy.to(grad.dtype).unsqueeze(-1)).mul_(h).add_(g)
        grad.mul_(coef).neg_()
    vocab = grad.shape[-1]
    one_hot = torch.where(_valid(targets, vocab).unsqueeze(-1), g, torch.zeros_like(g))
    grad.scatter_add_(-1, targets.clamp(0, vocab - 1).long().unsqueeze(-1), one_hot)
    grad.mul_(inv_temperature)
    active = grad_logp != 0
    if grad_entropy is not None:
        active = active | (grad_entropy != 0)
    # No finite softmax in the row (a NaN or +inf logit, or all -inf): NaN, as the reference.
    grad.masked_fill_(~torch.isfinite(lse).unsqueeze(-1), float("nan"))
    # Rows with no upstream gradient (padding) get an exact zero, even if their logits are garbage.
    return grad.masked_fill_(~active.unsqueeze(-1), 0.0)


def logits_grad(logits, targets, lse, entropy, grad_logp, grad_entropy, inv_temperature):
    """dLoss/dlogits in a new tensor shaped and typed like `logits`."""
    grad = _grad_rows(logits, targets, lse, entropy, grad_logp, grad_entropy, inv_temperature)
    return grad.to(logits.dtype).reshape(logits.shape)


def logits_grad_(logits, targets, lse, entropy, grad_logp, grad_entropy, inv_temperature):
    """Same as logits_grad, written into the logits' own storage."""
    grad = _grad_rows(logits, targets, lse, entropy, grad_logp, grad_entropy, inv_temperature)
    logits.copy_(grad.reshape(logits.shape))
    return logits
