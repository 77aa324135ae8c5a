"""One GSPO problem cut the way each parallel split holds it: the slices a rank receives,
and the matching slices of the whole problem's results. Shared by the multi-process tests,
the benchmark and the torchrun example, so that all three split a problem the same way."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def even_parts(total: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of `parts` contiguous pieces of range(total), the first ones one longer
    when it does not divide (13, 12, 12 for 37 over 3); pieces may be empty."""
    base, extra = divmod(total, parts)
    bounds, start = [], 0
    for k in range(parts):
        stop = start + base + (1 if k < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


@dataclass(frozen=True)
class TokenPart:
    """Which rows of the whole problem a context-parallel (or data-parallel) rank holds."""

    rows: torch.Tensor  # `[N_local]` int64 indices into the whole problem's rows
    cu_seqlens: torch.Tensor | None  # packed: this rank's (S+1,) boundaries
    columns: tuple[int, int] | None  # padded: the [start, stop) of T this rank holds


def context_part(rank: int, world: int, batch: int = 0, seq_len: int = 0,
                 cu_seqlens: torch.Tensor | None = None) -> TokenPart:
    """Context parallel: every sequence's tokens cut into `world` contiguous parts, this
    rank's in sequence order. Padded: columns of a `(B, T)` batch; packed: each sequence's
    rows, with a local cu_seqlens listing the same S sequences (empty parts allowed)."""
    if cu_seqlens is None:
        start, stop = even_parts(seq_len, world)[rank]
        rows = (torch.arange(batch).unsqueeze(1) * seq_len + torch.arange(start, stop)).reshape(-1)
        return TokenPart(rows, None, (start, stop))
    bounds = cu_seqlens.tolist()
    rows, lengths = [], []
    for s in range(len(bounds) - 1):
        start, stop = even_parts(bounds[s + 1] - bounds[s], world)[rank]
        rows.extend(range(bounds[s] + start, bounds[s] + stop))
        lengths.append(stop - start)
    local_cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    return TokenPart(torch.tensor(rows, dtype=torch.int64), local_cu, None)


def data_part(rank: int, world: int, batch: int = 0, seq_len: int = 0,
              cu_seqlens: torch.Tensor | None = None) -> tuple[TokenPart, tuple[int, int]]:
    """Data parallel: whole sequences, `[start, stop)` of them to this rank. Returns the
    rows and the sequence range (advantages and counts follow the sequences)."""
    if cu_seqlens is None:
        start, stop = even_parts(batch, world)[rank]
        rows = torch.arange(start * seq_len, stop * seq_len)
        return TokenPart(rows, None, (0, seq_len)), (start, stop)
    start, stop = even_parts(cu_seqlens.numel() - 1, world)[rank]
    first, last = int(cu_seqlens[start]), int(cu_seqlens[stop])
    return TokenPart(torch.arange(first, last), cu_seqlens[start:stop + 1] - first, None), (start, stop)
