"""Stage 3 over a slice of the vocabulary: a tensor-parallel rank's slice, or one block of
columns of the fused-linear vocab sweep on one process.

The kernels know nothing of slices: they get local target ids, with column 0 standing in for
the rows whose target lies outside the slice (a valid read, so no NaN), and then only those
rows carry a one-hot term they must not have, at column 0. It is rewritten (an O(N) fix-up)
by the torch backend's per-element term and the logit map's slope, so the gradient over the
slice is exactly the slice of the whole one.
"""

from __future__ import annotations

import torch

from ..backends.contract import GradInputs
from ..backends.torch_backend import softmax_terms_


def fix_foreign_rows(grad: torch.Tensor, first_logit: torch.Tensor, inputs: GradInputs, owned: torch.Tensor) -> None:
    """Rewrites column 0 of `grad` (a vocab slice's gradient, `[..., V_local]`) for the rows in
    the loss whose target is outside the slice: there the kernel added the one-hot term
    g * dz/dx at column 0, where the true gradient has only the softmax term.
    first_logit: the logits at column 0 (the rows' shape, like the inputs), read before an
    in-place kernel ran."""
    foreign = ~owned
    if inputs.row_mask is not None:
        foreign = foreign & inputs.row_mask
    dtype = inputs.lse.dtype
    z = inputs.logit_map.apply_(first_logit.to(dtype, copy=True))
    slope = inputs.logit_map.slope(z)
    if inputs.kept_min is not None:  # outside the sampler's kept set: probability 0, gradient 0
        z = torch.where(first_logit.to(inputs.kept_min.dtype) < inputs.kept_min, float("-inf"), z)
    value = (softmax_terms_(z.reshape(-1, 1), inputs.as_rows()).reshape(z.shape) * slope)
    column = grad.select(-1, 0)
    fixed = torch.where(foreign, value, column.reshape(value.shape).to(dtype))
    column.copy_(fixed.reshape(column.shape))


def first_logit(logits: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A copy of column 0 of `(B, T, V)` or `(N, V)` logits (any row strides), of `shape`
    (the per-row inputs' shape)."""
    return logits.select(-1, 0).reshape(shape).clone()


def slice_logits_grad(backend, logits: torch.Tensor, inputs: GradInputs, owned: torch.Tensor | None,
                      in_place: bool) -> torch.Tensor:
    """Stage 3 over a vocab slice's logits: the backend's kernel, then column 0 rewritten for the
    rows whose target lies outside the slice (owned: the rows whose target is in it; None: all).
    in_place: the kernel may write over `logits`. Not when a fix-up follows under torch.compile:
    inductor (torch 2.14) deferred the read of column 0 past the in-place kernel there and gave
    wrong gradients, so the kernel writes a new buffer instead (one more buffer of the slice's
    logits; gspo_loss's inplace=True with tp_group then leaves the saved logits intact)."""
    column0 = None if owned is None else first_logit(logits, inputs.lse.shape)
    if in_place and (owned is None or not torch.compiler.is_compiling()):
        grad = backend.logits_grad_(logits, inputs)
    else:
        grad = backend.logits_grad(logits, inputs)
    if owned is not None:
        fix_foreign_rows(grad, column0, inputs, owned)
    return grad
