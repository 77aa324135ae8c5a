"""The three products of the kept-rows path, over the entries of the kept sets only (N k H
multiply-adds, not N V H):

    logits       x_e       = hidden[row_e] . weight[id_e]          (nnz,)
    d hidden     dh_r      = sum_{e in row r} dx_e weight[id_e]    (N, H)
    d weight     dW_v      = sum_{e with id v} dx_e hidden[row_e]  (V, H), and d bias

in float32 (float64 for float64 operands), each sum in a fixed order, rounded once: no atomics,
the same bits for the same sets. On a CPU they are C++ (csrc/cpu/kept_products.cpp: the logits
and d hidden over the rows in their own order, ids ascending, a block of weight rows at a time;
d weight over the entries grouped by block of rows, a thread's share each, and by id, so that
each id's sum takes its rows in order, a segment a block). Other devices and float64 take PyTorch
ops, a slab of entries at a time (a gathered copy of the slab's weight and hidden rows), with
the entries sorted by id for d weight.
"""

from __future__ import annotations

import torch

from ..backends import native_backend
from ..token_stats.kept_softmax import KeptEntries

# Float32 gathered rows per slab of the PyTorch ops: small on a CPU (they stay in cache), large on
# a GPU (each slab is a few kernel launches and a host sync: N = 16384 at k = 512, H = 4096 is
# 8.4M entries, 256 slabs of 1 GiB).
_SLAB_BYTES = {"cpu": 64 << 20}
_GPU_SLAB_BYTES = 1 << 30


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _native(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype != torch.float64 and native_backend.load_error() is None


def _slabs(offsets: torch.Tensor, width: int):
    """Row ranges [a, b) of a CSR, with their entry ranges [e0, e1), each about _SLAB_BYTES of
    float32 rows of `width` (a row with more entries is a slab of its own)."""
    budget = _SLAB_BYTES.get(offsets.device.type, _GPU_SLAB_BYTES)
    per_slab = max(1, budget // (4 * max(width, 1)))
    rows, nnz = offsets.numel() - 1, int(offsets[-1])
    cuts = []
    if nnz > per_slab:
        marks = torch.arange(per_slab, nnz, per_slab, device=offsets.device)
        cuts = (torch.searchsorted(offsets, marks, right=True) - 1).tolist()  # the row holding each mark
    bounds = sorted({0, rows, *cuts})
    starts = offsets[bounds].tolist()
    for i in range(len(bounds) - 1):
        if bounds[i + 1] > bounds[i]:
            yield bounds[i], bounds[i + 1], starts[i], starts[i + 1]


def _thread_share(rows: int) -> int:
    return max(1, -(-rows // max(1, torch.get_num_threads())))


def block_rows(hidden: torch.Tensor) -> int:
    """Hidden rows per block of d weight's grouping (kept_group: by block of rows, then id): a
    thread's share of the rows, so that the grouping runs one block a task and each id's sum
    meets its rows in as few segments as the threads allow. The bits do not depend on it
    (csrc/cpu/kept_products.cpp). On the 2-core AVX512-BF16 EPYC (N = 2048, H = 512, V = 32768,
    the bench's top-512 sets, interleaved, 15 rounds) d weight took a median 33.0 ms at 1024 rows
    a block against 40.8 ms at 256 (256 KiB of hidden rows: the earlier rule, measured on the AMX
    Xeon when the logits and d hidden walked these blocks too)."""
    return _thread_share(hidden.shape[0])


def row_tiles(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[int, int]:
    """(tile_rows, block_ids) of the C++ logits and d hidden: a thread's share of the rows up to
    TILE_ROWS a tile, and BLOCK_BYTES of weight rows a block. Each tile reads the whole weight
    once, a block at a time, so a tile of a thread's share reads it once a thread where smaller
    tiles read it again per tile (32 MiB each time at V = 32768, H = 512 bf16, more than the
    EPYC's L3 holds beside the rest). A tile's float32 sums of d hidden (and, without the bf16
    dot, its widened hidden rows) are its thread's scratch: tile_rows x H floats, 2 MiB at H = 512,
    16 MiB at H = 4096, about N x H floats at most over all threads. The bits do not depend on
    them (csrc/cpu/kept_products.cpp)."""
    tile_rows = min(TILE_ROWS, _thread_share(hidden.shape[0]))
    block_ids = max(1, BLOCK_BYTES // (weight.shape[1] * weight.element_size()))
    return tile_rows, block_ids


# On the 2-core AVX512-BF16 EPYC (N = 2048, H = 512, V = 32768, 512 random ids a row, 2 threads):
# the logits 11.4-11.8 ms and d hidden 16.7-17.9 ms at 1024 rows and 512 KiB to 1 MiB blocks,
# against 16.4 and 25.9 ms at 256 rows and 1 MiB (the earlier choice, from a grid on the AMX
# Xeon), 13.0 and 20.6 ms at 512 rows; one thread, 2048 rows against 1024 within the spread.
TILE_ROWS = 1024
BLOCK_BYTES = 512 << 10


class KeptProducts:
    """The products of one call's entries: NativeKeptProducts on a CPU, TorchKeptProducts elsewhere.
    logits() gives x without the bias; grads(dx, ...) gives (d hidden, d weight, d bias), d hidden
    in float32 or rounded to the weight's dtype, d weight in the weight's dtype, d bias float32."""

    @staticmethod
    def of(entries: KeptEntries, hidden: torch.Tensor, weight: torch.Tensor) -> "KeptProducts":
        if _native(hidden):
            return NativeKeptProducts(entries, hidden, weight)
        return TorchKeptProducts(entries, hidden, weight)


class NativeKeptProducts(KeptProducts):
    def __init__(self, entries: KeptEntries, hidden, weight) -> None:
        # The C++ products read rows of contiguous matrices: a transposed weight (an (H, V) buffer
        # seen as (V, H)) or strided hidden rows are copied once.
        self.entries, self.hidden, self.weight = entries, hidden.contiguous(), weight.contiguous()
        self.tiles = row_tiles(self.hidden, self.weight)

    def logits(self) -> torch.Tensor:
        return native_backend.kept_dots(self.hidden, self.weight, self.entries.offsets, self.entries.ids, *self.tiles)

    def grads(self, dx, need_hidden: bool, need_weight: bool, round_hidden: bool) -> tuple:
        d_hidden = d_weight = d_bias = None
        if need_hidden:
            d_hidden = native_backend.kept_hidden_grad(dx, self.weight, self.entries.offsets, self.entries.ids,
                                                       *self.tiles, round_hidden)
        if need_weight:  # by id: dx and the entries' rows grouped by block of rows and id
            vocab, blocks = self.weight.shape[0], block_rows(self.hidden)
            grouped_dx, offsets, rows = native_backend.kept_group(self.entries.offsets, self.entries.ids,
                                                                  dx.contiguous(), vocab, blocks)
            d_weight, d_bias = native_backend.kept_weight_grad(grouped_dx, self.hidden, offsets, rows, vocab, blocks)
        return d_hidden, d_weight, d_bias


class TorchKeptProducts(KeptProducts):
    def __init__(self, entries: KeptEntries, hidden, weight) -> None:
        self.entries, self.hidden, self.weight = entries, hidden, weight
        self.dtype = _compute_dtype(hidden)

    def logits(self) -> torch.Tensor:
        entries, hidden = self.entries, self.hidden
        x = torch.empty(entries.ids.numel(), dtype=self.dtype, device=hidden.device)
        for _, _, e0, e1 in _slabs(entries.offsets, 2 * hidden.shape[1]):
            w = self.weight[entries.ids[e0:e1]].to(self.dtype)
            h = hidden[entries.row_index[e0:e1]].to(self.dtype)
            x[e0:e1] = (w * h).sum(-1)
        return x

    def grads(self, dx, need_hidden: bool, need_weight: bool, round_hidden: bool) -> tuple:
        d_hidden = self._hidden_grad(dx, round_hidden) if need_hidden else None
        d_weight, d_bias = self._weight_grad(dx) if need_weight else (None, None)
        return d_hidden, d_weight, d_bias

    def _hidden_grad(self, dx, round_: bool) -> torch.Tensor:
        entries, weight = self.entries, self.weight
        out = torch.zeros(entries.rows, weight.shape[1], dtype=dx.dtype, device=dx.device)
        for a, b, e0, e1 in _slabs(entries.offsets, weight.shape[1]):
            if e1 > e0:
                parts = dx[e0:e1, None] * weight[entries.ids[e0:e1]].to(dx.dtype)
                out[a:b] = torch.segment_reduce(parts, "sum", offsets=entries.offsets[a:b + 1] - e0)
        return out.to(weight.dtype) if round_ else out

    def _weight_grad(self, dx) -> tuple[torch.Tensor, torch.Tensor]:
        vocab = self.weight.shape[0]
        order = torch.sort(self.entries.ids, stable=True).indices  # by id, rows ascending within
        offsets = torch.zeros(vocab + 1, dtype=torch.int64, device=dx.device)
        offsets[1:] = torch.cumsum(torch.bincount(self.entries.ids, minlength=vocab), 0)
        rows, grouped_dx = self.entries.row_index[order], dx[order]
        out = torch.empty(vocab, self.hidden.shape[1], dtype=dx.dtype, device=dx.device)
        for a, b, e0, e1 in _slabs(offsets, self.hidden.shape[1]):
            parts = grouped_dx[e0:e1, None] * self.hidden[rows[e0:e1]].to(dx.dtype)
            out[a:b] = torch.segment_reduce(parts, "sum", offsets=offsets[a:b + 1] - e0)
        return out.to(self.weight.dtype), torch.segment_reduce(grouped_dx, "sum", offsets=offsets)
