"""Stages 1 and 3 in plain PyTorch: the portable fallback, and the float64 path for gradcheck.

It materialises a few float32 `[N, V]` temporaries, so it is the slow and memory-hungry
backend; its value is that it runs anywhere, on any dtype, and traces under torch.compile.
It follows the same contract as the fused backends (see `backends/__init__.py`).
"""

from __future__ import annotations

import torch

name = "torch"


def _rows(logits: torch.Tensor) -> torch.Tensor:
    return logits.reshape(-1, logits.shape[-1])


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _log_probs(logits: torch.Tensor, lse: torch.Tensor, inv_temperature: float) -> torch.Tensor:
    z = _rows(logits).to(_compute_dtype(logits)) * inv_temperature
    return z - lse.unsqueeze(-1)


def token_stats(logits: torch.Tensor, targets: torch.Tensor, inv_temperature: float):
    """Returns (logp, entropy, lse), each `[N]` float32 (float64 for float64 logits)."""
    z = _rows(logits).to(_compute_dtype(logits)) * inv_temperature
    # Shift by the row max before anything else: z - max is exact, so log q and the entropy
    # keep their accuracy when the logits sit far from zero.
    row_max = z.amax(dim=-1, keepdim=True)
    # An all -inf row shifts by 0 (its results are NaN either way); +inf stays, giving NaN.
    row_max = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
    log_sum = torch.logsumexp(z - row_max, dim=-1, keepdim=True)
    log_q = z - row_max - log_sum
    lse = (row_max + log_sum).squeeze(-1)
    q = log_q.exp()
    # q == 0 where a logit is -inf (a masked-out vocabulary entry): 0 * -inf must count as 0.
    entropy = -torch.where(q == 0, torch.zeros_like(q), q * log_q).sum(-1)
    vocab = z.shape[-1]
    valid = (targets >= 0) & (targets < vocab)
    picked = log_q.gather(-1, targets.clamp(0, vocab - 1).long().unsqueeze(-1)).squeeze(-1)
    logp = torch.where(valid, picked, torch.full_like(picked, float("nan")))
    return logp, entropy, lse


def _grad_rows(logits, targets, lse, entropy, grad_logp, grad_entropy, inv_temperature):
    log_q = _log_probs(logits, lse, inv_temperature)
    q = log_q.exp()
    g = grad_logp.to(q.dtype).unsqueeze(-1)
    coef = g
    if grad_entropy is not None:
        h = grad_entropy.to(q.dtype).unsqueeze(-1)
        coef = g + h * (log_q + entropy.to(q.dtype).unsqueeze(-1))
    # Only an exact zero (a -inf logit) is guarded: a NaN must stay NaN.
    grad = -torch.where(q == 0, torch.zeros_like(q), q * coef)
    vocab = q.shape[-1]
    valid = ((targets >= 0) & (targets < vocab)).unsqueeze(-1)
    onehot_g = torch.zeros_like(q).scatter_(-1, targets.clamp(0, vocab - 1).long().unsqueeze(-1), g)
    grad = grad + torch.where(valid, onehot_g, torch.zeros_like(onehot_g))
    active = grad_logp != 0
    if grad_entropy is not None:
        active = active | (grad_entropy != 0)
    # Rows with no upstream gradient (padding) get an exact zero, even if their logits are garbage.
    return torch.where(active.unsqueeze(-1), grad * inv_temperature, torch.zeros_like(grad))


def logits_grad(logits, targets, lse, entropy, grad_logp, grad_entropy, inv_temperature):
    """dLoss/dlogits in a new tensor shaped and typed like `logits`."""
    grad = _grad_rows(logits, targets, lse, entropy, grad_logp, grad_entropy, inv_temperature)
    return grad.to(logits.dtype).reshape(logits.shape)


def logits_grad_(logits, targets, lse, entropy, grad_logp, grad_entropy, inv_temperature):
    """Same as logits_grad, written into the logits' own storage."""
    grad = _grad_rows(logits, targets, lse, entropy, grad_logp, grad_entropy, inv_temperature)
    logits.copy_(grad.reshape(logits.shape))
    return logits
