"""What stage 3 reads besides the logits, bundled once for every backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GradInputs:
    """Per-row `[N]` tensors (float32 unless noted) and the temperature of one backward pass.

    Row rule, the same on every backend (csrc/gspo_math.h, row_action): a row outside
    `row_mask` gets zeros whatever its logits hold, and is not read; a row in the loss with no
    finite softmax (a NaN or +inf logit, or all -inf) or a target outside [0, V) gets NaN
    throughout; a row whose upstream gradients are both 0 gets zeros, unread.
    """

    targets: torch.Tensor  # int64
    lse: torch.Tensor
    entropy: torch.Tensor
    grad_logp: torch.Tensor
    grad_entropy: torch.Tensor | None  # None: no entropy term
    row_mask: torch.Tensor | None  # bool; None: every row is in the loss
    inv_temperature: float

    def rows(self, part: slice) -> "GradInputs":
        """The same inputs for a slice of the rows (a chunk)."""
        return GradInputs(self.targets[part], self.lse[part], self.entropy[part], self.grad_logp[part],
                          None if self.grad_entropy is None else self.grad_entropy[part],
                          None if self.row_mask is None else self.row_mask[part], self.inv_temperature)

    def op_args(self) -> tuple:
        """The arguments after `logits`, in the order of the ops' schemas (csrc/ops.cpp)."""
        return (self.targets, self.lse, self.entropy, self.grad_logp, self.grad_entropy, self.row_mask,
                self.inv_temperature)


def upstream_grads(grad_logp, grad_entropy, lse):
    """The autograd gradients of (logp, entropy) as the kernels take them: contiguous rows in
    lse's dtype (autograd may hand over expanded, stride-0 ones), a zero grad_logp for None,
    and grad_entropy left None so that stage 3 skips the entropy term."""
    grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp.to(lse.dtype).contiguous()
    if grad_entropy is not None:
        grad_entropy = grad_entropy.to(lse.dtype).contiguous()
    return grad_logp, grad_entropy


def nan_lse_for_bad_targets(lse: torch.Tensor, targets: torch.Tensor, vocab: int) -> torch.Tensor:
    """lse NaN for the rows whose target is outside [0, vocab): the row rule then makes such a row
    (when in the loss) NaN even where the kernel is handed another column as its target (a vocab
    block of the fused-linear backward, the tile kernels' -1)."""
    valid = (targets >= 0) & (targets < vocab)
    return torch.where(valid, lse, torch.full_like(lse, float("nan")))
