"""Memory layouts the fuzz passes its tensors in: what real callers hand the entry points.

Per-token inputs (targets, mask, log-probs, per-token advantages) come as strided views (`m[::2]`),
a column of a wider table (`flags[:, 0]`), transposed storage, an offset into a larger buffer,
or stride-0 expansions (`torch.tensor(True).expand(N)`); logits (and fused-linear hidden states)
as `logits[:, :-1]`, a transposed buffer, an offset, or with a vocab stride other than 1.
Whatever sits in the buffer around the elements is junk that changes the result if read (NaN
for floats, True for bool masks, an out-of-range id for targets), so a kernel that reads at the
wrong stride or offset fails loudly instead of passing by luck.
"""

from __future__ import annotations

import torch

PER_TOKEN_LAYOUTS = ("contiguous", "strided", "column", "transposed", "offset", "expanded", "row_expanded")
LOGITS_VIEWS = ("contiguous", "sliced", "transposed", "offset", "vocab_strided", "vocab_major")
JUNK_ID = 10**6


def _junk(shape, like: torch.Tensor) -> torch.Tensor:
    if like.dtype == torch.bool:
        return torch.ones(shape, dtype=torch.bool)
    if like.dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=like.dtype)
    return torch.full(shape, JUNK_ID if like.dtype != torch.uint8 else 7, dtype=like.dtype)


def lay_out(t: torch.Tensor, kind: str) -> torch.Tensor:
    """`t` behind layout `kind`. "expanded" and "row_expanded" change the values (a stride-0 view
    can only repeat one value, or one row); every other kind keeps them."""
    shape = tuple(t.shape)
    if kind == "strided":  # every other element of a buffer twice as long (m[::2]-style)
        base = _junk(shape[:-1] + (2 * shape[-1],), t)
        base[..., ::2] = t
        return base[..., ::2]
    if kind == "column" or (kind == "transposed" and t.dim() == 1):  # flags[:, 1] of a 3-wide table
        base = _junk(shape + (3,), t)
        base[..., 1] = t
        return base[..., 1]
    if kind == "transposed":  # column-major storage
        return t.t().contiguous().t()
    if kind == "offset":  # a slice of a larger flat buffer: storage_offset 3
        flat = _junk((t.numel() + 5,), t)
        flat[3:3 + t.numel()] = t.reshape(-1)
        return flat[3:3 + t.numel()].view(shape)
    if kind == "expanded" and t.numel() > 0:  # one value for every token, stride 0 everywhere
        return t.reshape(-1)[0].clone().expand(shape)
    if kind == "row_expanded" and t.dim() == 2 and t.shape[0] > 0:  # the first sequence's row, stride 0 on dim 0
        return t[:1].clone().expand(shape)
    if kind == "row_expanded" and t.numel() > 0:
        return t.reshape(-1)[0].clone().expand(shape)
    return t.contiguous()


def logits_base(values: torch.Tensor, kind: str) -> tuple[torch.Tensor, callable]:
    """(base, view) with view(base) equal to `values` in layout `kind`; the rest of base is NaN.
    Gradients are taken with respect to base, so a write outside the view shows up there."""
    shape = tuple(values.shape)
    lead, vocab = shape[:-1], shape[-1]
    padded = values.dim() == 3
    if kind == "sliced":
        if padded:  # logits[:, :-1]: the last position of every row cut off
            base = _junk((shape[0], shape[1] + 1, vocab), values)
            base[:, :-1] = values
            return base, lambda b: b[:, :-1]
        base = _junk((shape[0], vocab + 3), values)  # packed rows with a row stride > V
        base[:, :vocab] = values
        return base, lambda b: b[:, :vocab]
    if kind == "transposed":
        if padded:  # a (T, B, V) buffer seen as (B, T, V)
            base = values.transpose(0, 1).contiguous()
            return base, lambda b: b.transpose(0, 1)
        base = values.t().contiguous()  # (V, N) seen as (N, V): vocab stride N
        return base, lambda b: b.t()
    if kind == "offset":
        n = values.numel()
        base = _junk((n + 7,), values)
        base[7:] = values.reshape(-1)
        return base, lambda b: b[7:].view(shape)
    if kind == "vocab_strided":  # every other vocab entry of a (..., 2V) buffer
        base = _junk(lead + (2 * vocab,), values)
        base[..., ::2] = values
        return base, lambda b: b[..., ::2]
    if kind == "vocab_major":  # (V, ...) storage: the vocab dim has the largest stride
        dims = tuple(range(1, values.dim())) + (0,)
        base = values.permute(values.dim() - 1, *range(values.dim() - 1)).contiguous()
        return base, lambda b: b.permute(*dims)
    return values.clone(), lambda b: b
