"""Per-sequence sums and the per-row gather of a packed batch (rows cu_seqlens[s] .. cu_seqlens[s+1]
form sequence s), in one op each where the extension has its kernels for the device
(csrc/cpu/segments.cpp, csrc/cuda/segments.cu), else in torch: a float64 segment_reduce between
two casts (three ops), and an index_select by a row -> sequence index that costs three more ops
to build. A small micro-batch pays per op dispatched (gspo_kernels.bench.host counts them), so
stage 2's packed layout uses the one-op kernels wherever it can; both ways sum each sequence
on its own, in float64."""

from __future__ import annotations

import torch

from . import native_backend


def _extension_has_segment_ops() -> bool:
    # An extension built before these ops existed loads fine but lacks them.
    if native_backend._C is None:
        return False
    try:
        torch.ops.gspo_kernels.segment_sum
        torch.ops.gspo_kernels.segment_expand
    except (AttributeError, RuntimeError):
        return False
    return True


# Read once at import, so that torch.compile traces a constant.
_HAS_SEGMENT_OPS = _extension_has_segment_ops()


def native_for(device: torch.device) -> bool:
    """Whether the one-op kernels serve tensors on `device` (meta: their shape functions)."""
    if not _HAS_SEGMENT_OPS:
        return False
    if device.type in ("cpu", "meta"):
        return True
    return device.type == "cuda" and native_backend.with_cuda()


if _HAS_SEGMENT_OPS:

    @torch.library.register_fake("gspo_kernels::segment_sum")
    def _(values, cu_seqlens):
        return values.new_empty((cu_seqlens.shape[0] - 1,) + tuple(values.shape[1:]))

    @torch.library.register_fake("gspo_kernels::segment_expand")
    def _(values, cu_seqlens, rows):
        return values.new_empty((rows,))


def row_to_sequence(cu_seqlens: torch.Tensor, rows: int, known_valid: bool) -> torch.Tensor:
    """The torch way's index: each row's sequence, `[rows]` int64."""
    row_ids = torch.arange(rows, device=cu_seqlens.device)
    seq_of_row = torch.searchsorted(cu_seqlens[1:], row_ids, right=True)
    if not known_valid:
        # Rows past the last boundary can only come from an invalid cu_seqlens, whose
        # device-side check fails later; clamping keeps the gather in bounds until then.
        seq_of_row = seq_of_row.clamp_(max=cu_seqlens.numel() - 2)
    return seq_of_row


def segment_sum(values: torch.Tensor, cu_seqlens: torch.Tensor, native: bool) -> torch.Tensor:
    """`[N]` or `[N, k]` floats -> their per-sequence sums `[S]` or `[S, k]`, in their dtype
    (0 for an empty sequence)."""
    if native:
        return torch.ops.gspo_kernels.segment_sum(values, cu_seqlens)
    # unsafe=True skips segment_reduce's own offset checks, which read values on the host;
    # the caller has validated cu_seqlens already (on the host, or by a device-side assert).
    sums = torch.segment_reduce(values.to(torch.float64), "sum", offsets=cu_seqlens, unsafe=True)
    return sums.to(values.dtype)


def segment_expand(values: torch.Tensor, cu_seqlens: torch.Tensor, seq_of_row: torch.Tensor | None,
                   rows: int) -> torch.Tensor:
    """`[S]` per-sequence values -> `[rows]`, each row its sequence's value. seq_of_row:
    row_to_sequence's index on the torch way, None on the native one."""
    if seq_of_row is None:
        return torch.ops.gspo_kernels.segment_expand(values, cu_seqlens, rows)
    return values.index_select(0, seq_of_row)
