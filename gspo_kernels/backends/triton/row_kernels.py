"""Triton kernels for stage 1 (token stats) and stage 3 (logits gradient) on materialised
logits: one program per row, streaming the vocab in BLOCK_V chunks (common.py holds the math).

Whether these are compiled kernels or run through Triton's CPU interpreter is decided when this
module is imported (TRITON_INTERPRET=1).
"""

import triton
import triton.language as tl

from .common import block_softmax_stats, finish_stats, grad_term, logit_slope, map_logits, merge_softmax_stats, row_rule


@triton.jit
def _load_mapped(row_ptr, idx, vocab, inv_temperature, softcap, kept, HAS_SOFTCAP: tl.constexpr):
    # Columns past the vocab stay -inf (no mass) after the map, which would make them -softcap;
    # so do the logits below the row's kept-set minimum (kept: -inf when every token is kept).
    x = tl.load(row_ptr + idx, mask=idx < vocab, other=0.0).to(tl.float32)
    z = map_logits(x, inv_temperature, softcap, HAS_SOFTCAP)
    # "not below", not ">=": a NaN logit stays NaN (its row has no softmax, as documented).
    return tl.where((idx < vocab) & ((x < kept) == 0), z, -float("inf"))


@triton.jit
def online_softmax_stats(row_ptr, vocab, inv_temperature, softcap, kept, HAS_SOFTCAP: tl.constexpr,
                         BLOCK_V: tl.constexpr):
    """The online-softmax loop: (m, s, a) of one row, reading it once."""
    cols = tl.arange(0, BLOCK_V)
    m, s, a = block_softmax_stats(_load_mapped(row_ptr, cols, vocab, inv_temperature, softcap, kept, HAS_SOFTCAP), 0)
    for start in range(BLOCK_V, vocab, BLOCK_V):
        z = _load_mapped(row_ptr, start + cols, vocab, inv_temperature, softcap, kept, HAS_SOFTCAP)
        bm, bs, ba = block_softmax_stats(z, 0)
        m, s, a = merge_softmax_stats(m, s, a, bm, bs, ba)
    return m, s, a


@triton.jit
def _row_offset(row, rows_per_batch, stride_b, stride_t):
    # int64: N * V passes 2**31 at N = 14k, V = 152k.
    return (row // rows_per_batch) * stride_b + (row % rows_per_batch) * stride_t


@triton.jit
def token_stats_kernel(
    logits_ptr, targets_ptr, logp_ptr, entropy_ptr, lse_ptr, kept_min_ptr,
    rows_per_batch, stride_b, stride_t, vocab, inv_temperature, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_KEPT: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + _row_offset(row, rows_per_batch, stride_b, stride_t)
    kept = -float("inf")
    if HAS_KEPT:
        kept = tl.load(kept_min_ptr + row)
    m, s, a = online_softmax_stats(row_ptr, vocab, inv_temperature, softcap, kept, HAS_SOFTCAP, BLOCK_V)
    target = tl.load(targets_ptr + row).to(tl.int64)
    valid = (target >= 0) & (target < vocab)
    # Guarded load: an out-of-range target never reads outside the row; its logp is NaN.
    z_target = tl.load(row_ptr + tl.where(valid, target, 0), mask=valid, other=0.0)
    x_target = z_target.to(tl.float32)
    # A target outside the kept set: z = -inf, a -inf log-prob (its probability is 0).
    z_target = tl.where(x_target < kept, -float("inf"), map_logits(x_target, inv_temperature, softcap, HAS_SOFTCAP))
    logp, entropy, lse = finish_stats(m, s, a, z_target, valid)
    tl.store(logp_ptr + row, logp)
    tl.store(entropy_ptr + row, entropy)
    tl.store(lse_ptr + row, lse)


@triton.jit
def logits_grad_kernel(
    logits_ptr, grad_ptr, targets_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr, row_mask_ptr,
    kept_min_ptr,
    rows_per_batch, stride_b, stride_t, grad_stride_b, grad_stride_t, vocab, inv_temperature, softcap,
    HAS_ENTROPY_GRAD: tl.constexpr, HAS_ROW_MASK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_KEPT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """dLoss/dx of one row in grad's dtype (common.grad_term, under common.row_rule)."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + _row_offset(row, rows_per_batch, stride_b, stride_t)
    out_ptr = grad_ptr + _row_offset(row, rows_per_batch, grad_stride_b, grad_stride_t)
    g = tl.load(grad_logp_ptr + row)
    h = g
    entropy = g
    if HAS_ENTROPY_GRAD:
        h = tl.load(grad_entropy_ptr + row)
        entropy = tl.load(entropy_ptr + row)
    lse = tl.load(lse_ptr + row)
    target = tl.load(targets_ptr + row)
    in_loss = True
    if HAS_ROW_MASK:
        in_loss = tl.load(row_mask_ptr + row) != 0
    kept = -float("inf")
    if HAS_KEPT:
        kept = tl.load(kept_min_ptr + row)
    make_nan, compute = row_rule(lse, (target < 0) | (target >= vocab), g, h, in_loss, HAS_ENTROPY_GRAD)
    read_limit = tl.where(compute, vocab, 0)
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, vocab, BLOCK_V):
        idx = start + cols
        x = tl.load(row_ptr + idx, mask=idx < read_limit, other=0.0).to(tl.float32)
        z = map_logits(x, inv_temperature, softcap, HAS_SOFTCAP)
        slope = logit_slope(z, inv_temperature, softcap, HAS_SOFTCAP)
        inside = (x < kept) == 0  # the sampler's kept set: outside, probability 0 and no one-hot term
        grad, _ = grad_term(tl.where(inside, z, -float("inf")) - lse, g, h, entropy, (idx == target) & inside,
                            compute, make_nan, slope, HAS_ENTROPY_GRAD)
        tl.store(out_ptr + idx, grad.to(grad_ptr.dtype.element_ty), mask=idx < vocab)
