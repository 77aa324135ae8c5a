"""Which rows form which sequence: the only place that tells padded from packed.

Both operations are deterministic and sync-free. Padded sums reduce a `[B, T]` view. Packed
sums reduce each sequence's own rows (torch.segment_reduce over cu_seqlens, in float64): no
atomics, and no value in one sequence can reach another. A running prefix sum would not
isolate them (an inf in sequence 0 turns every later difference into inf - inf = NaN, and a
huge finite value swallows the later sequences' digits). Broadcasting back to rows is a
gather whose backward is the same segment sum, not an atomic scatter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _packed_sum(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    # unsafe=True skips segment_reduce's own offset checks, which read values on the host;
    # inputs.py has validated cu_seqlens already (on the host, or by a device-side assert).
    sums = torch.segment_reduce(x.to(torch.float64), "sum", offsets=cu_seqlens, unsafe=True)
    return sums.to(x.dtype)


class _PackedBroadcast(torch.autograd.Function):
    """`[S]` -> `[N]`, each row taking its sequence's value; backward sums each sequence's rows."""

    @staticmethod
    def forward(ctx, values, seq_of_row, cu_seqlens):
        ctx.save_for_backward(cu_seqlens)
        return values.index_select(0, seq_of_row)

    @staticmethod
    def backward(ctx, grad):
        (cu_seqlens,) = ctx.saved_tensors
        return _packed_sum(grad, cu_seqlens), None, None


@dataclass(frozen=True)
class Segments:
    num_seqs: int
    rows_per_seq: int | None = None  # padded: T
    cu_seqlens: torch.Tensor | None = None  # packed: (S + 1,) int64
    seq_of_row: torch.Tensor | None = None  # packed: (N,) int64

    @staticmethod
    def padded(batch: int, seq_len: int) -> "Segments":
        return Segments(num_seqs=batch, rows_per_seq=seq_len)

    @staticmethod
    def packed(cu_seqlens: torch.Tensor, rows: int) -> "Segments":
        row_ids = torch.arange(rows, device=cu_seqlens.device)
        seq_of_row = torch.searchsorted(cu_seqlens[1:], row_ids, right=True)
        # Rows past the last boundary can only come from an invalid cu_seqlens (which fails its
        # check); clamping keeps the gather in bounds even then.
        seq_of_row = seq_of_row.clamp_(max=cu_seqlens.numel() - 2)
        return Segments(num_seqs=cu_seqlens.numel() - 1, cu_seqlens=cu_seqlens, seq_of_row=seq_of_row)

    def seq_sum(self, x: torch.Tensor) -> torch.Tensor:
        """`[N]` per-row values -> `[S]` per-sequence sums (0 for an empty sequence)."""
        if self.rows_per_seq is not None:
            return x.reshape(self.num_seqs, self.rows_per_seq).sum(dim=1)
        return _packed_sum(x, self.cu_seqlens)

    def per_row(self, v: torch.Tensor) -> torch.Tensor:
        """`[S]` per-sequence values -> `[N]`, each row taking its sequence's value."""
        if self.rows_per_seq is not None:
            return v.unsqueeze(1).expand(self.num_seqs, self.rows_per_seq).reshape(-1)
        return _PackedBroadcast.apply(v, self.seq_of_row, self.cu_seqlens)
