"""The three matmuls of the chunked fused-linear path, in the dtype each device multiplies best.

On a GPU the products take the 16-bit operands as they are and give float32 results
(`out_dtype`): a chunk's logits come out in float32, more exact than the 16-bit logits an
lm_head usually writes. A CPU with native bf16 (AVX512-BF16, AMX) multiplies the bf16 operands as
they are too, but torch gives a CPU's bf16 product only rounded to bf16 (no `out_dtype` there):
the logits are then the bf16 logits the model's own lm_head writes, and each gradient product is
rounded once to bf16 before it is summed in float32. A CPU without them multiplies bf16 10-80x
slower than fp32, so there both operands are upcast (exact products, float32 sums).
"""

from __future__ import annotations

import functools
import os

import torch

# Devices that multiply 16-bit operands natively (tensor cores). There the weight is never
# upcast: products take 16-bit operands and give float32 results. (Tests add "cpu" to cover
# the path.)
NATIVE_16BIT_MATMUL = {"cuda"}


@functools.lru_cache(maxsize=None)
def _cpu_multiplies_bf16() -> bool:
    try:  # torch's own reading of the CPU (cpuinfo), as its oneDNN dispatch sees it
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:
        return False


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX) through torch's oneDNN,
    which must be built and enabled. GSPO_CPU_BF16_PRODUCTS=0 in the environment says no, for
    bits that do not depend on the CPU (every product then multiplies in float32)."""
    if os.environ.get("GSPO_CPU_BF16_PRODUCTS", "1") == "0":
        return False
    return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled and _cpu_multiplies_bf16()


def as_matmul_dtype(t: torch.Tensor) -> torch.Tensor:
    # float32 products of 16-bit inputs: exact products, float32 sums. float64 stays float64
    # (the gradcheck path).
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


@functools.lru_cache(maxsize=None)
def _has_fp32_out_mm(device: torch.device) -> bool:
    """Whether torch.mm(..., out_dtype=torch.float32) runs on this device (CUDA, recent torch)."""
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


@functools.lru_cache(maxsize=None)
def _has_fp32_accumulating_addmm(device: torch.device) -> bool:
    """Whether torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc) sums 16-bit products into a
    float32 acc in place on this device (CUDA, recent torch), checked on a small case."""
    try:
        a = torch.ones(2, 3, dtype=torch.bfloat16, device=device)
        acc = torch.ones(2, 2, dtype=torch.float32, device=device)
        torch.addmm(acc, a, a.t(), out_dtype=torch.float32, out=acc)
        return acc.dtype == torch.float32 and bool((acc == 4).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """16-bit a @ b with a float32 result: accumulated in fp32 and not rounded to 16 bits where
    the device can (out_dtype), else the 16-bit result upcast (the usual lm_head precision)."""
    if _has_fp32_out_mm(a.device):
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def _cpu_bf16_rows_product(dz16: torch.Tensor, weight16: torch.Tensor, bad: torch.Tensor | None = None):
    """dz16 @ weight16 (bf16; dz16 is not changed) with each row NaN exactly where dz16's row
    holds a non-finite value (bad: those rows `[R]`, when the caller knows them; else found
    here). oneDNN's bf16 kernels on an AMX Xeon (torch 2.14.1) multiply rows in pairs: a NaN row
    of a 35 x 33 by 33 x 8 product also turned the row beside it NaN (rows 0 and 1, for M = 33
    to 79), so a padding row next to a bad row of the loss got NaN where it must get exact
    zeros. The bad rows go in as zeros and come out NaN."""
    bad = (~torch.isfinite(dz16).all(-1) if bad is None else bad).unsqueeze(-1)
    if not bool(bad.any()):
        return _rows_in_blocks(dz16, weight16)
    out = _rows_in_blocks(torch.where(bad, torch.zeros((), dtype=dz16.dtype, device=dz16.device), dz16), weight16)
    return out.masked_fill_(bad, float("nan"))


# Rows of one CPU bf16 product `dz @ weight` (K = V): oneDNN's time per row on a 2-core AMX Xeon
# (torch 2.14.1, V = 32768, H = 512, ms per 2048 rows) was 49 at M = 256, 44 at 320, 83-91 at
# 384 to 512, 72 at 1280 and 37-39 at 1536 and more: a group's 512 rows go as two products of 256.
# Other CPU kinds: not measured.
CPU_BF16_PRODUCT_ROWS = 256


def _rows_in_blocks(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b, CPU_BF16_PRODUCT_ROWS rows of a at a time where a has 2 to 4 blocks of them."""
    rows = a.shape[0]
    if rows <= CPU_BF16_PRODUCT_ROWS or rows > 4 * CPU_BF16_PRODUCT_ROWS:
        return a @ b
    out = torch.empty(rows, b.shape[1], dtype=a.dtype, device=a.device)
    for start in range(0, rows, CPU_BF16_PRODUCT_ROWS):
        part = slice(start, min(start + CPU_BF16_PRODUCT_ROWS, rows))
        torch.mm(a[part], b, out=out[part])
    return out


def accumulate_(acc: torch.Tensor, x: torch.Tensor) -> None:
    """acc (float32) += x (bf16): the extension's one-pass op where it is built (torch's
    mixed-dtype add_ casts x into a fresh float32 buffer first: 3x the time on a 2-core AMX
    Xeon at 32768 x 512), else add_."""
    op = getattr(torch.ops.gspo_kernels, "accumulate_", None) if _extension_loaded() else None
    if op is None or acc.device.type != "cpu":
        acc.add_(x)
    else:
        op(acc, x)


@functools.lru_cache(maxsize=None)
def _extension_loaded() -> bool:
    from ..backends import native_backend
    return native_backend.load_error() is None


# float32 weight rows upcast at a time on a CPU: the copy a product needs, not the whole weight
# (V x H x 4 bytes: 2.3 GiB at V = 151936, H = 4096).
UPCAST_BLOCK_BYTES = 64 << 20


def upcast_block_rows(hidden_size: int) -> int:
    """Weight rows per float32 block: 8192 at H = 512, 1024 at H = 4096."""
    return max(1, UPCAST_BLOCK_BYTES // (4 * max(1, hidden_size)))


class Operands:
    """The products of one weight (or a block of its vocab rows) and its bias.

    Where the weight must be upcast (16-bit on a CPU), each product walks it a block of
    `upcast_block_rows` rows at a time, so that no float32 copy of the whole weight is made;
    elsewhere one block spans it (no copy at all)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.dtype = weight.dtype
        self.native = weight.device.type in NATIVE_16BIT_MATMUL and weight.dtype in (torch.bfloat16, torch.float16)
        # A CPU with native bf16 multiplies the bf16 operands as they are, every product rounded
        # once to bf16 (the logits too: a chunk's logits are then bf16, as an lm_head writes them).
        self.cpu_bf16 = weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and cpu_has_native_bf16()
        self.weight16 = weight
        self.bias16 = bias
        self._product_scratch = None
        upcast = not self.native and not self.cpu_bf16 and weight.dtype not in (torch.float32, torch.float64)
        vocab = weight.shape[0]
        width = upcast_block_rows(weight.shape[1]) if upcast else max(1, vocab)
        self.blocks = [slice(start, min(start + width, vocab)) for start in range(0, vocab, width)]
        self._single = None
        self.accum_dtype = torch.float32 if self.native or self.cpu_bf16 or upcast else weight.dtype
        # A product written once (not summed into an accumulator) may return the 16-bit result
        # of a 16-bit product: the same single rounding a GPU applies to its float32 result.
        # Where a CPU multiplies bf16 natively that is ~2x faster than float32 (2-core EPYC
        # with AVX512-BF16: 250 against 450 ms for d weight at N = 2048, V = 32768, H = 512).
        self.native_once = self.native or self.cpu_bf16

    @property
    def vocab(self) -> int:
        return self.weight16.shape[0]

    def _weight(self, cols: slice) -> torch.Tensor:
        """Weight rows `cols` as this device multiplies them (a float32 copy of the block on a CPU).
        A weight of one block keeps its copy: it is at most one block, and its owner (a block of
        the vocab sweep, or of the batch-invariant products) multiplies it many times."""
        if len(self.blocks) == 1:
            if self._single is None:
                self._single = self.weight16 if self.native or self.cpu_bf16 else as_matmul_dtype(self.weight16)
            return self._single
        block = self.weight16[cols]
        return block if self.native or self.cpu_bf16 else as_matmul_dtype(block)

    def _bias(self, cols: slice) -> torch.Tensor | None:
        if self.bias16 is None:
            return None
        block = self.bias16[cols]
        if self.cpu_bf16:
            return block
        return block.float() if self.native else as_matmul_dtype(block)

    def rows(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """hidden rows as this device multiplies them (upcast once, for a caller that reuses them)."""
        return hidden_rows if self.native or self.cpu_bf16 else as_matmul_dtype(hidden_rows)

    def logits(self, hidden_rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """A chunk's logits `[R, V]`: float32 (float64 for float64 inputs), bf16 where a CPU
        multiplies bf16 natively. out: a buffer of that shape and dtype to write them into (a
        CPU maps a fresh large buffer page by page on first touch: reusing one saves that)."""
        h = self.rows(hidden_rows)
        if len(self.blocks) == 1:
            return self._block_logits(h, self.blocks[0], out)
        if out is None:
            out = torch.empty(h.shape[0], self.vocab, dtype=self.accum_dtype, device=h.device)
        for cols in self.blocks:
            out[:, cols] = self._block_logits(h, cols)
        return out

    def _block_logits(self, h: torch.Tensor, cols: slice, out: torch.Tensor | None = None) -> torch.Tensor:
        weight, bias = self._weight(cols), self._bias(cols)
        if self.native:
            z = _mm_fp32(h, weight.t())
            z = z if bias is None else z.add_(bias)
            return z if out is None else out.copy_(z)
        if bias is None:
            return torch.mm(h, weight.t(), out=out)
        return torch.addmm(bias, h, weight.t(), out=out)

    @property
    def logits_dtype(self) -> torch.dtype:
        return self.weight16.dtype if self.cpu_bf16 else self.accum_dtype

    def weight_grad_dtype(self, weight_grad_fp32: bool) -> torch.dtype:
        """The dtype `d weight` is summed in over chunks or groups: the accumulation dtype, or with
        weight_grad_fp32=False a 16-bit weight's own (half the buffer, one rounding per chunk)."""
        low_precision = not weight_grad_fp32 and self.dtype in (torch.bfloat16, torch.float16)
        return self.dtype if low_precision else self.accum_dtype

    def _operand(self, dz: torch.Tensor) -> torch.Tensor:
        # Natively, dz is rounded to the weight's 16-bit dtype for the products, as the unfused
        # path's 16-bit logits gradient is; the products still sum in float32.
        return dz.to(self.dtype) if self.native else dz

    def hidden_grad(self, dz: torch.Tensor, once: bool = False, bad_rows: torch.Tensor | None = None):
        """dz @ weight: `[R, H]` in the accumulation dtype, or (once: for a caller that writes it
        once in the weight's dtype) possibly in the weight's dtype. bad_rows: dz's non-finite
        rows `[R]` where the caller knows them (a CPU's bf16 product must not spread them)."""
        if self.native:
            return _mm_fp32(self._operand(dz), self.weight16)
        if self.cpu_bf16:  # dz rounded to bf16 as on a GPU
            product = _cpu_bf16_rows_product(dz.to(self.dtype), self.weight16, bad_rows)
            return product if once else product.float()
        d_hidden = torch.zeros(dz.shape[0], self.weight16.shape[1], dtype=self.accum_dtype, device=dz.device)
        self.add_hidden_grad(d_hidden, dz)
        return d_hidden

    def add_hidden_grad(self, d_hidden: torch.Tensor, dz: torch.Tensor, bad_rows: torch.Tensor | None = None) -> None:
        """d_hidden (accumulation dtype) += dz @ weight, a weight block at a time. bad_rows as in
        hidden_grad."""
        if self.native or self.cpu_bf16:
            d_hidden.add_(self.hidden_grad(dz, bad_rows=bad_rows))
            return
        for cols in self.blocks:
            d_hidden.addmm_(dz[:, cols], self._weight(cols))

    def weight_grad(self, dz: torch.Tensor, hidden_rows: torch.Tensor, rows_mm: torch.Tensor | None = None):
        """dz.T @ hidden, summed over every row given, for a caller that writes it once: `[Vb, H]`
        in float32 or the weight's dtype. rows_mm: hidden_rows as `rows` gave them, if at hand."""
        if self.native:
            return _mm_fp32(self._operand(dz).t(), hidden_rows)
        if self.native_once:  # CPU with native bf16: dz rounded to bf16 as on a GPU
            return dz.to(self.dtype).t() @ hidden_rows
        return dz.t() @ (as_matmul_dtype(hidden_rows) if rows_mm is None else rows_mm)

    def add_weight_grad(self, d_weight: torch.Tensor, dz: torch.Tensor, hidden_rows: torch.Tensor,
                        first: bool = False) -> None:
        """d_weight += dz.T @ hidden_rows; first: d_weight holds nothing yet (may be uninitialised)."""
        if d_weight.dtype == self.dtype and self.dtype != self.accum_dtype:  # 16-bit accumulator
            # The sum is formed inside the product (float32), rounded once per call.
            if first:
                torch.mm(dz.t().to(self.dtype), hidden_rows, out=d_weight)
            else:
                d_weight.addmm_(dz.t().to(self.dtype), hidden_rows)
            return
        if first and not self.native and not self.cpu_bf16:  # float32 products: the first writes it
            torch.mm(dz.t(), as_matmul_dtype(hidden_rows), out=d_weight)
            return
        if first:
            d_weight.zero_()
        if self.cpu_bf16:
            # The bf16 product into one buffer kept for every call: a fresh V x H one would be
            # mapped page by page again each time.
            if self._product_scratch is None or self._product_scratch.shape != d_weight.shape:
                self._product_scratch = torch.empty(d_weight.shape, dtype=self.dtype, device=d_weight.device)
            torch.mm(dz.t().to(self.dtype), hidden_rows.to(self.dtype), out=self._product_scratch)
            accumulate_(d_weight, self._product_scratch)
        elif self.native and _has_fp32_accumulating_addmm(d_weight.device):
            # Summed into the float32 accumulator by the product itself (C = C + A B): no
            # V x H float32 product to write and read again per chunk.
            torch.addmm(d_weight, self._operand(dz).t(), hidden_rows, out_dtype=torch.float32, out=d_weight)
        elif self.native:
            d_weight.add_(self.weight_grad(dz, hidden_rows))
        else:
            d_weight.addmm_(dz.t(), as_matmul_dtype(hidden_rows))
