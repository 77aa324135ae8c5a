"""Which rows form which sequence: the only place that tells padded from packed.

Both operations are deterministic and sync-free: padded sums reduce a `[B, T]` view; packed
sums take differences of one float64 prefix sum (no atomics, so the same inputs give the
same bits on every run), and broadcasting back to rows is a gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
        """`[N]` per-row values -> `[S]` per-sequence sums."""
        if self.rows_per_seq is not None:
            return x.reshape(self.num_seqs, self.rows_per_seq).sum(dim=1)
        # float64 prefix sums: differences of large running totals stay exact to ~1e-16.
        prefix = torch.cumsum(x.to(torch.float64), dim=0)
        prefix = torch.cat([prefix.new_zeros(1), prefix])
        return (prefix[self.cu_seqlens[1:]] - prefix[self.cu_seqlens[:-1]]).to(x.dtype)

    def per_row(self, v: torch.Tensor) -> torch.Tensor:
        """`[S]` per-sequence values -> `[N]`, each row taking its sequence's value."""
        if self.rows_per_seq is not None:
            return v.unsqueeze(1).expand(self.num_seqs, self.rows_per_seq).reshape(-1)
        return v.index_select(0, self.seq_of_row)
