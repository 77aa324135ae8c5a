"""Fused-linear Triton kernels: stages 1 and 3 over `hidden @ weight.T (+ bias)` with the
logits only ever in on-chip tiles (in the spirit of Cut Cross Entropy).

Forward: one program per block of BLOCK_N rows walks the vocab in BLOCK_V tiles; each tile's
logits are a tl.dot over the hidden size, reduced at once into the online-softmax statistics
(common.py's merge, as the row kernels) and the target logit. Nothing `[N, V]` is written.

Backward: one program per (row block, vocab tile) recomputes the tile, forms its gradient dz
(common.py's formula and row rule, as the row kernels), and adds dz @ W into d hidden and dz.T @ H
into d weight with float32 atomics, so results are not bit-reproducible from run to run; or,
batch-invariant, two kernels without atomics (linear_hidden_grad_kernel, linear_weight_grad_kernel).
Gradient filtering: a tile in which each row's probability mass is below `filter_eps` (holding
no row's target and no NaN row) skips both products; FILTER=False turns it off. Rows are in the loss or not
through `row_mask`; a row whose lse is not finite (no softmax, or a target no rank holds, set
by the caller) gets NaN; a target < 0 adds no one-hot term (vocab-parallel: the target lives
on another rank).

Each kernel groups its flat launch arguments once into tuples (Triton takes tuples as jit
arguments since 3.2; the GPU machine runs 3.6): the pointers of a tile's inputs, the problem's
sizes and strides, the logit map; _logits_tile and _grad_tile take those whole. The products
after dz are written once (_hidden_grad_part, _weight_grad_part, _add_to) for the atomic and
the batch-invariant kernels.
"""

import triton
import triton.language as tl

from .common import (INTERPRETED, block_softmax_stats, finish_stats, grad_term, logit_slope, map_logits,
                     merge_softmax_stats, row_rule)


# In the interpreter tl.dot is numpy's matmul, whose BLAS gives a row different bits at another
# row of the tile (OpenBLAS, Haswell kernels: measured); a broadcast sum over k adds in k order
# for every (row, column), as a GPU's MMA does for every row of its tile. Interpreter only.
_SUM_DOT: tl.constexpr = tl.constexpr(INTERPRETED)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """a @ b + acc in float32. IEEE: float32 products (float32 inputs, and the interpreter,
    whose numpy dot cannot take 16-bit operands: they are upcast first, exactly)."""
    # One branch taken, one return: compiled Triton type-checks code after a constexpr branch's
    # return too (a float32 dz against float16 weights).
    if _SUM_DOT:
        out = acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
    elif IEEE:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _dz_operand(dz, h_ptr):
    """dz as the backward's products take it: rounded to bfloat16 for bfloat16 inputs, float32
    otherwise (float16's range does not hold large gradients; its products are IEEE)."""
    out = dz
    if h_ptr.dtype.element_ty == tl.bfloat16:
        out = dz.to(tl.bfloat16)
    return out


@triton.jit
def _hidden_grad_part(dz_in, w_ptr, cols, kk, vocab, hidden_size, stride_w, IEEE: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_H: tl.constexpr):
    """dz @ W[cols, kk]: the tile's part of its rows' d hidden at columns kk, float32."""
    w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_w + kk[None, :],
                mask=(cols[:, None] < vocab) & (kk[None, :] < hidden_size), other=0.0)
    return _dot(dz_in, w, tl.zeros((BLOCK_N, BLOCK_H), dtype=tl.float32), IEEE)


@triton.jit
def _weight_grad_part(dz_in, h_ptr, rows, kk, n_rows, hidden_size, stride_h, IEEE: tl.constexpr,
                      BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    """dz.T @ H[rows, kk]: the tile's part of its vocab rows' d weight at columns kk, float32."""
    h = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + kk[None, :],
                mask=(rows[:, None] < n_rows) & (kk[None, :] < hidden_size), other=0.0)
    return _dot(tl.trans(dz_in), h, tl.zeros((BLOCK_V, BLOCK_H), dtype=tl.float32), IEEE)


@triton.jit
def _add_to(out_ptr, index, count, kk, hidden_size, part):
    """out[index, kk] += part with a plain load and store: the batch-invariant kernels are the
    only writers of what they sum, and add their tiles in a fixed order."""
    out = out_ptr + index[:, None].to(tl.int64) * hidden_size + kk[None, :]
    ok = (index[:, None] < count) & (kk[None, :] < hidden_size)
    tl.store(out, tl.load(out, mask=ok, other=0.0) + part, mask=ok)


@triton.jit
def _logits_tile(operands, rows, cols, sizes, logit_map, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 IEEE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    """(BLOCK_N, BLOCK_V) float32 logits through the logit map (common.map_logits); -inf
    outside the vocab. operands: (h, w, b) pointers; sizes: (n_rows, vocab, hidden_size,
    stride_h, stride_w); logit_map: (inv_temperature, softcap)."""
    h_ptr, w_ptr, b_ptr = operands
    n_rows, vocab, hidden_size, stride_h, stride_w = sizes
    inv_temperature, softcap = logit_map
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    ks = tl.arange(0, BLOCK_H)
    row_ok = rows[:, None] < n_rows
    col_ok = cols[:, None] < vocab
    for k0 in range(0, hidden_size, BLOCK_H):
        kk = k0 + ks
        k_ok = kk[None, :] < hidden_size
        h = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + kk[None, :], mask=row_ok & k_ok, other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_w + kk[None, :], mask=col_ok & k_ok, other=0.0)
        acc = _dot(h, tl.trans(w), acc, IEEE)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < vocab, other=0.0).to(tl.float32)[None, :]
    return tl.where(cols[None, :] < vocab, map_logits(acc, inv_temperature, softcap, HAS_SOFTCAP), -float("inf"))


@triton.jit
def linear_token_stats_kernel(
    h_ptr, w_ptr, b_ptr, targets_ptr, logp_ptr, entropy_ptr, lse_ptr,
    n_rows, vocab, hidden_size, stride_h, stride_w, inv_temperature, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    target = tl.load(targets_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    m = tl.full((BLOCK_N,), -float("inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    a = tl.zeros((BLOCK_N,), tl.float32)
    z_target = tl.zeros((BLOCK_N,), tl.float32)
    operands, sizes = (h_ptr, w_ptr, b_ptr), (n_rows, vocab, hidden_size, stride_h, stride_w)
    for v0 in range(0, vocab, BLOCK_V):
        idx = v0 + cols
        z = _logits_tile(operands, rows, idx, sizes, (inv_temperature, softcap), HAS_BIAS, HAS_SOFTCAP, IEEE,
                         BLOCK_N, BLOCK_V, BLOCK_H)
        bm, bs, ba = block_softmax_stats(z, 1)
        m, s, a = merge_softmax_stats(m, s, a, bm, bs, ba)
        z_target += tl.sum(tl.where(idx[None, :] == target[:, None], z, 0.0), 1)
    logp, entropy, lse = finish_stats(m, s, a, z_target, (target >= 0) & (target < vocab))
    tl.store(logp_ptr + rows, logp, mask=row_ok)
    tl.store(entropy_ptr + rows, entropy, mask=row_ok)
    tl.store(lse_ptr + rows, lse, mask=row_ok)


@triton.jit
def _grad_tile(
    ptrs, rows, cols, sizes, logit_map, filter_eps,
    HAS_BIAS: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, HAS_ROW_MASK: tl.constexpr, FILTER: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """(dz, active) of one (rows, cols) tile: its float32 gradient, recomputed from the logits,
    and whether its products are needed (always, unless FILTER). ptrs: the pointers of
    (h, w, b, targets, lse, entropy, grad_logp, grad_entropy, row_mask); sizes and logit_map as _logits_tile takes them."""
    h_ptr, w_ptr, b_ptr, targets_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr, row_mask_ptr = ptrs
    n_rows, vocab = sizes[0], sizes[1]
    inv_temperature, softcap = logit_map
    row_ok = rows < n_rows
    g = tl.load(grad_logp_ptr + rows, mask=row_ok, other=0.0)
    hg = g
    entropy = g
    if HAS_ENTROPY_GRAD:
        hg = tl.load(grad_entropy_ptr + rows, mask=row_ok, other=0.0)
        entropy = tl.load(entropy_ptr + rows, mask=row_ok, other=0.0)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    target = tl.load(targets_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    if HAS_ROW_MASK:
        in_loss = tl.load(row_mask_ptr + rows, mask=row_ok, other=0) != 0
    else:
        in_loss = row_ok
    # A target < 0 is not bad here: it lives on another rank (no one-hot term); a target no
    # rank holds arrives as a NaN lse, set by the caller. (A vector of False, not the scalar:
    # Triton 3.2's interpreter cannot broadcast a bool constant, no int1 type in its builder.)
    make_nan, compute = row_rule(lse, rows < 0, g, hg, in_loss, HAS_ENTROPY_GRAD)
    z = _logits_tile((h_ptr, w_ptr, b_ptr), rows, cols, sizes, logit_map, HAS_BIAS, HAS_SOFTCAP, IEEE, BLOCK_N,
                     BLOCK_V, BLOCK_H)
    col_ok = cols[None, :] < vocab
    log_p = z - tl.where(compute, lse, 0.0)[:, None]
    dz, p = grad_term(log_p, g[:, None], hg[:, None], entropy[:, None], cols[None, :] == target[:, None],
                      compute[:, None] & col_ok, make_nan[:, None] & col_ok,
                      logit_slope(z, inv_temperature, softcap, HAS_SOFTCAP), HAS_ENTROPY_GRAD)
    active = 1
    if FILTER:
        # Skip the tile when each row's probability mass in it is below filter_eps, no row's
        # target is in it and no row in it is NaN: a row then loses at most eps of its softmax
        # mass to the tile (docs/fused_linear.md, "Gradient filtering", for the bound).
        live = compute[:, None] & col_ok
        hits_target = tl.sum(tl.where(live & (cols[None, :] == target[:, None]), 1, 0)) > 0
        # NaN rows, and rows whose upstream gradient is not finite: their NaN reaches every tile.
        bad_upstream = (g != g) | (tl.abs(g) == float("inf"))
        if HAS_ENTROPY_GRAD:
            bad_upstream = bad_upstream | (hg != hg) | (tl.abs(hg) == float("inf"))
        has_nan = tl.sum(tl.where(make_nan | (compute & bad_upstream), 1, 0)) > 0
        active = (tl.max(tl.sum(tl.where(live, p, 0.0), 1)) >= filter_eps) | hits_target | has_nan
    return dz, active


@triton.jit
def linear_grad_kernel(
    h_ptr, w_ptr, b_ptr, targets_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr, row_mask_ptr,
    dh_ptr, dw_ptr, db_ptr,
    n_rows, vocab, hidden_size, stride_h, stride_w, inv_temperature, softcap, filter_eps,
    HAS_BIAS: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, HAS_ROW_MASK: tl.constexpr, NEED_DH: tl.constexpr,
    NEED_DW: tl.constexpr, NEED_DB: tl.constexpr, FILTER: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    ptrs = (h_ptr, w_ptr, b_ptr, targets_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr, row_mask_ptr)
    sizes = (n_rows, vocab, hidden_size, stride_h, stride_w)
    dz, active = _grad_tile(ptrs, rows, cols, sizes, (inv_temperature, softcap), filter_eps, HAS_BIAS,
                            HAS_ENTROPY_GRAD, HAS_ROW_MASK, FILTER, HAS_SOFTCAP, IEEE, BLOCK_N, BLOCK_V, BLOCK_H)
    if active:
        # bfloat16 inputs: dz rounded once to their dtype for the tensor-core products (as
        # Liger and Cut Cross Entropy do); float32 and float16 inputs keep it in float32 (IEEE
        # products: a float16 dz would overflow past 65504, as large ratios' gradients do).
        dz_in = _dz_operand(dz, h_ptr)
        ks = tl.arange(0, BLOCK_H)
        for k0 in range(0, hidden_size, BLOCK_H):
            kk = k0 + ks
            k_ok = kk[None, :] < hidden_size
            if NEED_DH:
                part = _hidden_grad_part(dz_in, w_ptr, cols, kk, vocab, hidden_size, stride_w, IEEE, BLOCK_N, BLOCK_H)
                tl.atomic_add(dh_ptr + rows[:, None].to(tl.int64) * hidden_size + kk[None, :], part,
                              mask=(rows[:, None] < n_rows) & k_ok, sem="relaxed")
            if NEED_DW:
                part = _weight_grad_part(dz_in, h_ptr, rows, kk, n_rows, hidden_size, stride_h, IEEE, BLOCK_V,
                                         BLOCK_H)
                tl.atomic_add(dw_ptr + cols[:, None].to(tl.int64) * hidden_size + kk[None, :], part,
                              mask=(cols[:, None] < vocab) & k_ok, sem="relaxed")
    if NEED_DB:  # cheap, so never filtered: d bias stays exact
        tl.atomic_add(db_ptr + cols, tl.sum(dz, 0), mask=cols < vocab, sem="relaxed")


# Batch-invariant backward (LinearConfig.batch_invariant): two kernels, each the only writer of
# what it sums, adding its tiles in a fixed order with plain loads and stores instead of atomics.
# The price: the logits tiles are recomputed twice (once per kernel) instead of once.


@triton.jit
def linear_hidden_grad_kernel(
    h_ptr, w_ptr, b_ptr, targets_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr, row_mask_ptr, dh_ptr,
    n_rows, vocab, hidden_size, stride_h, stride_w, inv_temperature, softcap,
    HAS_BIAS: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, HAS_ROW_MASK: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """d hidden of one block of rows: the vocab tiles' dz @ W added in vocab order. A row's sum
    then follows only its own dz and the fixed tile shape, not the rows beside it."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_H)
    ptrs = (h_ptr, w_ptr, b_ptr, targets_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr, row_mask_ptr)
    sizes = (n_rows, vocab, hidden_size, stride_h, stride_w)
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        dz, active = _grad_tile(ptrs, rows, cols, sizes, (inv_temperature, softcap), 0.0, HAS_BIAS, HAS_ENTROPY_GRAD,
                                HAS_ROW_MASK, False, HAS_SOFTCAP, IEEE, BLOCK_N, BLOCK_V, BLOCK_H)
        dz_in = _dz_operand(dz, h_ptr)
        for k0 in range(0, hidden_size, BLOCK_H):
            kk = k0 + ks
            part = _hidden_grad_part(dz_in, w_ptr, cols, kk, vocab, hidden_size, stride_w, IEEE, BLOCK_N, BLOCK_H)
            _add_to(dh_ptr, rows, n_rows, kk, hidden_size, part)
        tl.debug_barrier()  # this tile's stores before the next tile's loads, across the program's threads


@triton.jit
def linear_weight_grad_kernel(
    h_ptr, w_ptr, b_ptr, targets_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr, row_mask_ptr,
    dw_ptr, db_ptr,
    n_rows, vocab, hidden_size, stride_h, stride_w, inv_temperature, softcap,
    HAS_BIAS: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, HAS_ROW_MASK: tl.constexpr, NEED_DW: tl.constexpr,
    NEED_DB: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """d weight and d bias of one vocab tile: the row blocks' dz.T @ H added in row order."""
    cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    ks = tl.arange(0, BLOCK_H)
    ptrs = (h_ptr, w_ptr, b_ptr, targets_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr, row_mask_ptr)
    sizes = (n_rows, vocab, hidden_size, stride_h, stride_w)
    bias_sum = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for n0 in range(0, n_rows, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        dz, active = _grad_tile(ptrs, rows, cols, sizes, (inv_temperature, softcap), 0.0, HAS_BIAS, HAS_ENTROPY_GRAD,
                                HAS_ROW_MASK, False, HAS_SOFTCAP, IEEE, BLOCK_N, BLOCK_V, BLOCK_H)
        if NEED_DB:
            bias_sum += tl.sum(dz, 0)
        if NEED_DW:
            dz_in = _dz_operand(dz, h_ptr)
            for k0 in range(0, hidden_size, BLOCK_H):
                kk = k0 + ks
                part = _weight_grad_part(dz_in, h_ptr, rows, kk, n_rows, hidden_size, stride_h, IEEE, BLOCK_V,
                                         BLOCK_H)
                _add_to(dw_ptr, cols, vocab, kk, hidden_size, part)
            tl.debug_barrier()  # as in linear_hidden_grad_kernel
    if NEED_DB:
        tl.store(db_ptr + cols, bias_sum, mask=cols < vocab)
