"""Which rows form which sequence: the only place that tells padded from packed.

Both operations are deterministic and sync-free. Padded sums reduce a `[B, T]` view. Packed
sums reduce each sequence's own rows (torch.segment_reduce over cu_seqlens, in float64): no
atomics, and no value in one sequence can reach another. A running prefix sum would not
isolate them (an inf in sequence 0 turns every later difference into inf - inf = NaN, and a
huge finite value swallows the later sequences' digits). Broadcasting back to rows is a
gather whose backward is the same segment sum, not an atomic scatter.

Context parallelism lives here too: with a `group`, this rank holds a part of every
sequence's rows, and every reduction over rows (per sequence, or over all tokens) is summed
over the group's ranks before anything uses it, so stage 2 sees the whole batch's sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..distributed.collectives import all_reduce_max, replicated_loss, replicated_sum


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
    group: object = None  # context parallel: the ranks that hold the other parts of each sequence

    @staticmethod
    def padded(batch: int, seq_len: int, group=None) -> "Segments":
        return Segments(num_seqs=batch, rows_per_seq=seq_len, group=group)

    @staticmethod
    def packed(cu_seqlens: torch.Tensor, rows: int, group=None) -> "Segments":
        row_ids = torch.arange(rows, device=cu_seqlens.device)
        seq_of_row = torch.searchsorted(cu_seqlens[1:], row_ids, right=True)
        # Rows past the last boundary can only come from an invalid cu_seqlens (which fails its
        # check); clamping keeps the gather in bounds even then.
        seq_of_row = seq_of_row.clamp_(max=cu_seqlens.numel() - 2)
        return Segments(num_seqs=cu_seqlens.numel() - 1, cu_seqlens=cu_seqlens, seq_of_row=seq_of_row, group=group)

    def seq_sum(self, x: torch.Tensor) -> torch.Tensor:
        """`[N]` (or `[N, k]`: k columns at once) per-row values -> `[S]` (`[S, k]`)
        per-sequence sums (0 for an empty sequence), over every rank's part of the sequence."""
        if self.rows_per_seq is not None:
            local = x.reshape(self.num_seqs, self.rows_per_seq, *x.shape[1:]).sum(dim=1)
        else:
            local = _packed_sum(x, self.cu_seqlens)
        return replicated_sum(local, self.group)

    def reduce(self, local_sums: torch.Tensor) -> torch.Tensor:
        """Sums over this rank's rows (any shape) -> the sums over all ranks' rows."""
        return replicated_sum(local_sums, self.group)

    def replicated_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The scalar loss every rank computed from the summed values (collectives.py says
        why its gradient is divided by the group's size)."""
        return replicated_loss(loss, self.group)

    def total(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of an `[N]` per-row tensor over every rank's rows."""
        return self.reduce(x.sum())

    def max(self, x: torch.Tensor) -> torch.Tensor:
        """The max of a non-negative `[N]` per-row tensor over every rank's rows (detached;
        0 where no rank has a row)."""
        local = x.detach().max() if x.numel() else x.new_zeros(())
        return all_reduce_max(local, self.group)

    def per_row(self, v: torch.Tensor) -> torch.Tensor:
        """`[S]` per-sequence values -> `[N]`, each row taking its sequence's value."""
        if self.rows_per_seq is not None:
            return v.unsqueeze(1).expand(self.num_seqs, self.rows_per_seq).reshape(-1)
        return _PackedBroadcast.apply(v, self.seq_of_row, self.cu_seqlens)
