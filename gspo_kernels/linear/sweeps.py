"""Backward of the chunked fused-linear path: the logits formed again, a buffer at a time, the
stage-3 kernel run over them in place (dz), and the gradient products taken from dz.

Two sweeps over the same `[N, V]` product, each writing one gradient whole and accumulating the
other in float32 (deterministic either way: no atomics):

- rows: chunks of rows over the full vocab. A chunk's `d hidden` rows are one product
  (`dz @ weight`); `d weight` is summed over the chunks in a `[V, H]` accumulator.
- vocab: blocks of vocab columns over all N rows. A block's `d weight` rows (and `d bias`
  entries) are one product (`dz.T @ hidden`); `d hidden` is summed over the blocks in an
  `[N, H]` accumulator. A row's target lies in one block; the others see it as a foreign row,
  as a tensor-parallel rank does (token_stats/slice_grad.py), and their column 0 is rewritten from
  the formula.

`choose_sweep` takes the one with the smaller accumulator (vocab when N < V: at N = 16384,
H = 4096, V = 151936 that is 256 MiB against 2.3 GiB), and the one that needs none when only one
of the two gradients is asked for. Both hold as many logits at a time: a chunk of `chunk` rows x
V, or a block of N rows x (chunk x V / N) columns.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..backends.contract import GradInputs
from ..distributed.vocab_parallel import VocabSlice
from ..token_stats.slice_grad import slice_logits_grad
from .invariant import ProductBlocks, RowBlockProducts, group_rows
from .plan import align_down
from .products import Operands


def choose_sweep(rows: int, vocab: int, need_hidden: bool, need_weight: bool, weight_grad_fp32: bool,
                 weight_dtype: torch.dtype) -> str:
    """'rows' or 'vocab': the sweep whose accumulator is smaller (none when only one gradient
    is needed). The rows sweep's `d weight` accumulator is V x H in float32, or in the weight's
    own dtype with weight_grad_fp32=False; the vocab sweep's `d hidden` one is N x H in float32."""
    if not need_weight:
        return "rows"
    if not need_hidden:
        return "vocab"
    weight_bytes = 4 if weight_grad_fp32 else weight_dtype.itemsize
    return "vocab" if rows * 4 < vocab * weight_bytes else "rows"


@dataclass
class SavedPass:
    """What forward saved and backward was handed, for either sweep."""

    hidden: torch.Tensor  # [N, H]
    weight: torch.Tensor  # [V, H] (this rank's slice under tensor parallelism)
    bias: torch.Tensor | None
    owned: torch.Tensor | None  # [N] bool under tensor parallelism: the target is in this slice
    # every row's stage-3 inputs; targets local to the weight's vocab (0 where another rank owns it)
    inputs: GradInputs


def _block_grad(backend, ops, hidden_rows, inputs: GradInputs, owned) -> torch.Tensor:
    """dz of one buffer, over its freshly formed logits. owned: None when every row's target is
    in the buffer's columns, else the rows whose target is (the others' column 0 is rewritten)."""
    return slice_logits_grad(backend, ops.logits(hidden_rows), inputs, owned, in_place=True)


def rows_sweep(backend, saved: SavedPass, chunk: int, need, reduce_hidden_grad: bool, weight_grad_fp32: bool):
    """(d hidden, d weight, d bias) chunk of rows by chunk; need: which of the three to form.
    d hidden stays in the accumulation dtype when reduce_hidden_grad (a slice's partial sum,
    summed over the ranks before it is rounded), else it is in hidden's own."""
    need_h, need_w, need_b = need
    hidden, weight = saved.hidden, saved.weight
    ops = Operands(weight, saved.bias)
    d_hidden = None
    if need_h:
        d_hidden = torch.empty(hidden.shape, dtype=ops.accum_dtype if reduce_hidden_grad else hidden.dtype,
                               device=hidden.device)
    d_weight = None
    if need_w:
        d_weight = torch.zeros(weight.shape, dtype=ops.weight_grad_dtype(weight_grad_fp32), device=weight.device)
    d_bias = torch.zeros(weight.shape[0], dtype=ops.accum_dtype, device=weight.device) if need_b else None
    rows = hidden.shape[0]
    for start in range(0, rows, chunk):
        part = slice(start, min(start + chunk, rows))
        owned = None if saved.owned is None else saved.owned[part]
        inputs = saved.inputs.rows(part)
        dz = _block_grad(backend, ops, hidden[part], inputs, owned)
        if need_h:
            # A CPU's bf16 product is told dz's NaN rows from the per-row inputs: scanning dz for
            # them read every logit again (45% of a bf16 backward at N = 2304, V = 32768, H = 64 on
            # a 2-core AMX Xeon).
            bad = inputs.nan_rows() if ops.cpu_bf16 else None
            d_hidden[part] = ops.hidden_grad(dz, once=not reduce_hidden_grad, bad_rows=bad)
        if need_w:
            ops.add_weight_grad(d_weight, dz, hidden[part])
        if need_b:
            d_bias += dz.sum(0, dtype=d_bias.dtype)
    return d_hidden, d_weight, d_bias


def vocab_sweep(backend, saved: SavedPass, chunk: int, need, blocks: ProductBlocks | None = None):
    """(d hidden in float32, d weight, d bias) block of vocab columns by block.

    Default: blocks of `chunk * V / N` columns over every row at once. With blocks (batch
    invariance): blocks of `blocks.vocab` columns over groups of rows (invariant.group_rows), every product of
    the fixed shape (invariant.py); `d weight` and `d bias` then sum over the groups in order."""
    need_h, need_w, need_b = need
    hidden, weight, bias = saved.hidden, saved.weight, saved.bias
    rows, vocab = hidden.shape[0], weight.shape[0]
    if blocks is None:
        width = vocab if rows == 0 else max(1, min(vocab, align_down(chunk * vocab // rows, hidden.device)))
        columns = [slice(start, min(start + width, vocab)) for start in range(0, vocab, width)]
        groups = [slice(0, rows)]
    else:
        columns = blocks.vocab_slices(vocab)
        size = group_rows(blocks, chunk, vocab)
        groups = [slice(start, min(start + size, rows)) for start in range(0, rows, size)]
    d_hidden = d_weight = d_bias = None
    if need_w:
        d_weight = torch.empty_like(weight)
    if need_b:
        d_bias = torch.empty_like(bias)
    rows_mm = None
    nan = None  # dz's NaN rows, for a CPU's bf16 product (rows_sweep says why)

    def block_grads(ops, products, inputs, owned):
        """This column block's (d weight, d bias), its d hidden added in place. Over every row at
        once each is one product, written once; over groups of rows, summed in float32 in order."""
        if len(groups) == 1:
            dz = _block_grad(backend, products, rows_mm, inputs, owned)
            if need_h:
                products.add_hidden_grad(d_hidden, dz, nan)
            return (ops.weight_grad(dz, hidden, rows_mm) if need_w else None), (dz.sum(0, dtype=ops.accum_dtype) if need_b else None)
        block_width = ops.weight16.shape[0]
        weight_sum = torch.zeros(block_width, weight.shape[1], dtype=ops.accum_dtype, device=weight.device) if need_w else None
        bias_sum = torch.zeros(block_width, dtype=ops.accum_dtype, device=weight.device) if need_b else None
        for part in groups:
            dz = _block_grad(backend, products, rows_mm[part], inputs.rows(part), owned[part])
            if need_w:
                ops.add_weight_grad(weight_sum, dz, rows_mm[part])
            if need_b:
                bias_sum += dz.sum(0, dtype=bias_sum.dtype)
            if need_h:
                products.add_hidden_grad(d_hidden[part], dz, None if nan is None else nan[part])
        return weight_sum, bias_sum

    for cols in columns:
        ops = Operands(weight[cols], None if bias is None else bias[cols])
        if rows_mm is None:
            rows_mm = ops.rows(hidden)  # upcast once (CPU), not once per block
            if need_h:
                d_hidden = torch.zeros(hidden.shape, dtype=ops.accum_dtype, device=hidden.device)
                nan = saved.inputs.nan_rows() if ops.cpu_bf16 else None  # the same for every block
        local, in_block = VocabSlice(cols.start, cols.stop - cols.start).local_targets(saved.inputs.targets)
        owned = in_block if saved.owned is None else in_block & saved.owned
        products = ops if blocks is None else RowBlockProducts(ops, blocks)
        d_w, d_b = block_grads(ops, products, replace(saved.inputs, targets=local), owned)
        if need_w:
            d_weight[cols] = d_w
        if need_b:
            d_bias[cols] = d_b
    return d_hidden, d_weight, d_bias
