"""Which rows form which sequence: the only place that tells padded from packed.

Per-token tensors keep the caller's token shape: `[B, T]` padded, `[N]` packed. Per-sequence
values are `[B, 1]` padded (a sequence is a row of the `[B, T]` tensor: its sum is one
`sum(dim=1, keepdim=True)`, and the value reaches its tokens by broadcasting, no op at all) and
`[S]` packed (reaching the tokens by one gather). No flattening, no expanding, no copy: each
would be one more op to dispatch, which is what a small micro-batch pays for. Packed
sums reduce each sequence's own rows over cu_seqlens, in float64 (backends/segment_ops.py: one
op where the extension serves the device, else torch.segment_reduce): no atomics, and no
value in one sequence can reach another. A running prefix sum would not
isolate them (an inf in sequence 0 turns every later difference into inf - inf = NaN, and a
huge finite value swallows the later sequences' digits).

Stage 2 differentiates by hand (gradient.py), so nothing here needs a backward.

Context parallelism lives here too: with a `group`, this rank holds a part of every
sequence's rows, and every reduction over rows (per sequence, or over all tokens) is summed
over the group's ranks before anything uses it, so stage 2 sees the whole batch's sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends import segment_ops
from ..distributed.collectives import all_reduce_max, replicated_sum


@dataclass(frozen=True)
class Segments:
    num_seqs: int
    rows_per_seq: int | None = None  # padded: T
    cu_seqlens: torch.Tensor | None = None  # packed: (S + 1,) int64
    rows: int | None = None  # packed: N
    seq_of_row: torch.Tensor | None = None  # packed, where the extension's segment ops do not serve the device
    group: object = None  # context parallel: the ranks that hold the other parts of each sequence

    @staticmethod
    def padded(batch: int, seq_len: int, group=None) -> "Segments":
        return Segments(num_seqs=batch, rows_per_seq=seq_len, group=group)

    @staticmethod
    def packed(cu_seqlens: torch.Tensor, rows: int, group=None, known_valid: bool = False) -> "Segments":
        native = segment_ops.native_for(cu_seqlens.device)
        seq_of_row = None if native else segment_ops.row_to_sequence(cu_seqlens, rows, known_valid)
        return Segments(num_seqs=cu_seqlens.numel() - 1, cu_seqlens=cu_seqlens, rows=rows, seq_of_row=seq_of_row,
                        group=group)

    @property
    def padded_layout(self) -> bool:
        return self.rows_per_seq is not None

    def _packed_sum(self, x: torch.Tensor) -> torch.Tensor:
        # No row -> sequence index was built exactly where the extension's ops serve the device.
        return segment_ops.segment_sum(x, self.cu_seqlens, native=self.seq_of_row is None)

    def seq_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token values (the token shape) -> per-sequence sums (`[B, 1]` padded, `[S]`
        packed; 0 for an empty sequence), over every rank's part of the sequence. With a
        trailing column dim (k columns at once): `[B, 1, k]` padded, `[S, k]` packed."""
        local = x.sum(dim=1, keepdim=True) if self.padded_layout else self._packed_sum(x)
        return replicated_sum(local, self.group)

    def column_sums(self, x: torch.Tensor) -> torch.Tensor:
        """k per-token columns (the token shape plus k) -> their per-sequence sums `[S, k]`."""
        local = x.sum(dim=1) if self.padded_layout else self._packed_sum(x)
        return replicated_sum(local, self.group)

    def seq_sums(self, columns, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """seq_sum of each per-token column (bool or float, all of the token shape) in `dtype`,
        in as few ops as the layout allows: one sum per padded column, one stacked segment
        reduction (and one collective) for the rest."""
        if self.padded_layout and self.group is None:
            return tuple(c.sum(dim=1, keepdim=True, dtype=dtype) for c in columns)
        stacked = torch.stack(columns, dim=-1)  # takes the float column's dtype
        if stacked.dtype != dtype:
            stacked = stacked.to(dtype)
        return self.seq_sum(stacked).unbind(-1)  # a packed sum accumulates in float64

    def per_row(self, v: torch.Tensor) -> torch.Tensor:
        """Per-sequence values (seq_sum's shape, or `[S]`) -> each token's sequence's value,
        broadcastable against the token shape (`[B, 1]` padded, `[N]` packed)."""
        if self.padded_layout:
            return v if v.dim() == 2 else v.unsqueeze(1)
        return segment_ops.segment_expand(v, self.cu_seqlens, self.seq_of_row, self.rows)

    def per_sequence(self, v: torch.Tensor) -> torch.Tensor:
        """Per-sequence values as `[S]`."""
        return v.view(-1) if self.padded_layout else v

    def as_column(self, v: torch.Tensor) -> torch.Tensor:
        """Per-sequence values as `[S, 1]`, to scale column_sums' rows."""
        return v if self.padded_layout else v.unsqueeze(1)

    def reduce(self, local_sums: torch.Tensor) -> torch.Tensor:
        """Sums over this rank's rows (any shape) -> the sums over all ranks' rows."""
        return replicated_sum(local_sums, self.group)

    def total(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of a per-token tensor over every rank's rows."""
        return self.reduce(x.sum())

    def max(self, x: torch.Tensor) -> torch.Tensor:
        """The max of a non-negative per-token tensor over every rank's rows (0 where no rank
        has a row)."""
        local = x.max() if x.numel() else x.new_zeros(())
        return all_reduce_max(local, self.group)
