"""What the autograd Functions hand the kernels from autograd, and the bad-target rule."""

from __future__ import annotations

import torch


def upstream_grads(grad_logp, grad_entropy, lse):
    """The autograd gradients of (logp, entropy) as the kernels take them: contiguous rows in
    lse's dtype (autograd may hand over expanded, stride-0 ones), a zero grad_logp for None,
    and grad_entropy left None so that stage 3 skips the entropy term."""
    grad_logp = torch.zeros_like(lse) if grad_logp is None else _as_rows(grad_logp, lse)
    if grad_entropy is not None:
        grad_entropy = _as_rows(grad_entropy, lse)
    return grad_logp, grad_entropy


def _as_rows(grad: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """A gradient of the token shape as lse's contiguous `[N]` rows (no op where it is one)."""
    grad = grad.to(lse.dtype).contiguous()
    return grad if grad.shape == lse.shape else grad.reshape(lse.shape)


def nan_lse_for_bad_targets(lse: torch.Tensor, targets: torch.Tensor, vocab: int) -> torch.Tensor:
    """lse NaN for the rows whose target is outside [0, vocab): the row rule then makes such a row
    (when in the loss) NaN even where the kernel is handed another column as its target (a vocab
    block of the fused-linear backward, the tile kernels' -1)."""
    valid = (targets >= 0) & (targets < vocab)
    return torch.where(valid, lse, torch.full_like(lse, float("nan")))
