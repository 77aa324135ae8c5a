"""Batch-invariant products of the chunked fused-linear path (LinearConfig.batch_invariant).

A matmul library picks its algorithm (tiling, split-K, kernel) by the product's shape, so a
row's logits follow the number of rows they were multiplied with. Here every product has a
shape fixed by the device and the model alone: `rows` hidden rows (the last block padded with
zero rows) against one vocab block of `vocab` weight rows (the last block of the vocabulary is
narrower, the same in every call). Sums over vocab blocks (`d hidden`) run in block order.
Nothing here follows N or chunk_size, so a row gets the same bits alone or in any batch.

What is fixed is the shape, not the library: the bits are those of this torch, BLAS and device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .products import Operands, upcast_block_rows

# Hidden rows per product. A GPU wants tall products to fill its tensor cores. A CPU's too: on a
# 2-core AMD EPYC with AVX2 only (no AVX-512; torch 2.14.1, loaded by other runs, 2026-12-02) a
# (R x 512) @ (512 x 8192) product ran at 12, 19, 26 and 29 GFLOP/s for R = 64, 128, 256, 512;
# 256 is the default chunk at V = 32768.
INVARIANT_ROWS = {"cpu": 256, "cuda": 512}
# A vocab block's float32 weight rows (columns = budget / (4 H)). On a CPU half the default path's
# upcast block: the backward's block of `d weight` is a float32 sum besides its upcast weight
# rows (8 MiB each at H = 512, 4096 columns: 78 against the default path's 74 MiB peak at
# N = 2048, V = 32768, bf16; with 8192 columns it was 103).
# On a GPU the products take the 16-bit weight as it is: larger blocks, fewer launches.
BLOCK_BYTES = {"cpu": 8 << 20, "cuda": 128 << 20}


@dataclass(frozen=True)
class ProductBlocks:
    """The fixed shape of every product: `rows` hidden rows x `vocab` weight rows."""

    rows: int
    vocab: int

    @staticmethod
    def of(device: torch.device, hidden_size: int) -> "ProductBlocks":
        kind = device.type if device.type in INVARIANT_ROWS else "cpu"
        vocab = max(1, BLOCK_BYTES[kind] // (4 * max(1, hidden_size)))
        return ProductBlocks(INVARIANT_ROWS[kind], min(vocab, upcast_block_rows(hidden_size)) if kind == "cpu" else vocab)

    def round_chunk(self, chunk: int) -> int:
        """chunk rounded up to whole row blocks (only the batch's last block is padded)."""
        return -(-chunk // self.rows) * self.rows

    def vocab_slices(self, vocab: int) -> list[slice]:
        return [slice(start, min(start + self.vocab, vocab)) for start in range(0, vocab, self.vocab)]

    def row_slices(self, rows: int) -> list[slice]:
        return [slice(start, min(start + self.rows, rows)) for start in range(0, rows, self.rows)]


def _padded(t: torch.Tensor, rows: int, copy: bool = False) -> torch.Tensor:
    """t `[k, X]` with zero rows below it up to `rows` (t itself when k == rows, unless copy)."""
    if t.shape[0] == rows and not copy:
        return t
    out = t.new_zeros(rows, t.shape[1])
    out[:t.shape[0]] = t
    return out


class RowBlockProducts:
    """The products of one vocab block (an Operands) taken `blocks.rows` hidden rows at a time."""

    def __init__(self, ops: Operands, blocks: ProductBlocks):
        self.ops = ops
        self.blocks = blocks

    def logits(self, hidden_rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`[n, Vb]` float32 logits of the block, into `out` (a view) when given."""
        n = hidden_rows.shape[0]
        if out is None:
            out = torch.empty(n, self.ops.vocab, dtype=self.ops.accum_dtype, device=hidden_rows.device)
        for part in self.blocks.row_slices(n):
            # Always a fresh copy: a GPU library may pick its kernel by the operands' alignment, and
            # the caller's rows may start anywhere (a view at an offset); it is rows x H, small.
            block = _padded(hidden_rows[part], self.blocks.rows, copy=True)
            out[part] = self.ops.logits(block)[:part.stop - part.start]
        return out

    def add_hidden_grad(self, d_hidden: torch.Tensor, dz: torch.Tensor, bad_rows: torch.Tensor | None = None) -> None:
        """d_hidden `[n, H]` (float32) += dz @ weight_block: each row block's product formed
        whole, then added, so a row's sum is the same whichever block and offset it lands in.
        bad_rows: dz's NaN rows `[n]`, as Operands.hidden_grad takes them."""
        for part in self.blocks.row_slices(dz.shape[0]):  # dz is a fresh buffer: its blocks are aligned alike
            bad = None if bad_rows is None else _padded(bad_rows[part].unsqueeze(-1), self.blocks.rows).squeeze(-1)
            product = self.ops.hidden_grad(_padded(dz[part], self.blocks.rows), bad_rows=bad)
            d_hidden[part] += product[:part.stop - part.start]


def invariant_logits(weight: torch.Tensor, bias: torch.Tensor | None, hidden_rows: torch.Tensor,
                     blocks: ProductBlocks) -> torch.Tensor:
    """`[n, V]` float32 logits of hidden_rows, every product of the fixed shape."""
    out = None
    for cols in blocks.vocab_slices(weight.shape[0]):
        ops = Operands(weight[cols], None if bias is None else bias[cols])
        if out is None:
            out = torch.empty(hidden_rows.shape[0], weight.shape[0], dtype=ops.accum_dtype, device=hidden_rows.device)
        RowBlockProducts(ops, blocks).logits(hidden_rows, out[:, cols])
    return out


def group_rows(blocks: ProductBlocks, chunk: int, vocab: int) -> int:
    """Rows per group of the backward's vocab sweep: as many logits as a chunk holds in forward
    (chunk x V), over a vocab block's columns, in whole row blocks. Only the order in which
    `d weight` and `d bias` are summed follows it, not any row's bits."""
    return blocks.round_chunk(max(chunk, chunk * vocab // max(1, min(blocks.vocab, vocab))))
