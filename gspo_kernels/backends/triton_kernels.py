"""Triton kernels for stage 1 (token stats) and stage 3 (logits gradient).

One program per row, streaming the vocab in BLOCK_V chunks. Whether these are compiled
kernels or run through Triton's CPU interpreter is decided when this module is imported
(TRITON_INTERPRET=1), which is why the backend imports it lazily.

Softmax statistics of a set of logits z (already divided by the temperature) are kept as
    m = max z,   s = sum exp(z - m),   a = sum exp(z - m) * (z - m)
so that lse = m + log s and the entropy H = log s - a / s; shifting by m before summing
z * exp(z) keeps H accurate when the logits sit far from zero. Two such triples over
disjoint sets merge exactly (`merge_softmax_stats`), which is all the online loop does.
"""

import triton
import triton.language as tl


@triton.jit
def _finite_or_zero(m):
    # A set with no finite logit has m = -inf; shifting by 0 instead keeps exp() NaN-free.
    return tl.where(m == -float("inf"), 0.0, m)


@triton.jit
def merge_softmax_stats(m1, s1, a1, m2, s2, a2):
    m = tl.maximum(m1, m2)
    shift = _finite_or_zero(m)
    w1 = tl.exp(m1 - shift)
    w2 = tl.exp(m2 - shift)
    # (m_i - m) * s_i is 0 * -inf for an empty set; its true contribution is 0.
    a1_moved = a1 + tl.where(s1 > 0, (m1 - shift) * s1, 0.0)
    a2_moved = a2 + tl.where(s2 > 0, (m2 - shift) * s2, 0.0)
    return m, w1 * s1 + w2 * s2, w1 * a1_moved + w2 * a2_moved


@triton.jit
def block_softmax_stats(z, AXIS: tl.constexpr):
    """(m, s, a) of a block of logits along AXIS: 0 for a row's block here, 1 for a
    (rows, vocab) tile in the fused-linear kernels."""
    # One max per block and one exp per element: the exp unit, not memory, is the
    # tighter limit for 16-bit logits on Hopper, so a per-element rescale would cost.
    m = tl.max(z, AXIS)
    shift = _finite_or_zero(m)
    moved = z - tl.expand_dims(shift, AXIS)
    e = tl.exp(moved)
    return m, tl.sum(e, AXIS), tl.sum(tl.where(e == 0, 0.0, e * moved), AXIS)


@triton.jit
def _load_scaled(row_ptr, idx, vocab, inv_temperature):
    z = tl.load(row_ptr + idx, mask=idx < vocab, other=-float("inf"))
    return z.to(tl.float32) * inv_temperature


@triton.jit
def online_softmax_stats(row_ptr, vocab, inv_temperature, BLOCK_V: tl.constexpr):
    """The online-softmax loop: (m, s, a) of one row, reading it once."""
    cols = tl.arange(0, BLOCK_V)
    m, s, a = block_softmax_stats(_load_scaled(row_ptr, cols, vocab, inv_temperature), 0)
    for start in range(BLOCK_V, vocab, BLOCK_V):
        bm, bs, ba = block_softmax_stats(_load_scaled(row_ptr, start + cols, vocab, inv_temperature), 0)
        m, s, a = merge_softmax_stats(m, s, a, bm, bs, ba)
    return m, s, a


@triton.jit
def _row_offset(row, rows_per_batch, stride_b, stride_t):
    # int64: N * V passes 2**31 at N = 14k, V = 152k.
    return (row // rows_per_batch) * stride_b + (row % rows_per_batch) * stride_t


@triton.jit
def token_stats_kernel(
    logits_ptr, targets_ptr, logp_ptr, entropy_ptr, lse_ptr,
    rows_per_batch, stride_b, stride_t, vocab, inv_temperature,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + _row_offset(row, rows_per_batch, stride_b, stride_t)
    m, s, a = online_softmax_stats(row_ptr, vocab, inv_temperature, BLOCK_V)
    log_s = tl.log(s)
    lse = m + log_s
    target = tl.load(targets_ptr + row).to(tl.int64)
    valid = (target >= 0) & (target < vocab)
    # Guarded load: an out-of-range target never reads outside the row; its logp is NaN.
    z_target = tl.load(row_ptr + tl.where(valid, target, 0), mask=valid, other=0.0)
    # (z_y - m) - log s, not z_y - lse: no rounding of lse when the logits are large.
    logp = tl.where(valid, (z_target.to(tl.float32) * inv_temperature - m) - log_s, float("nan"))
    logp = tl.where(logp > 0, 0.0, logp)  # a rounding above 0 is impossible for a log-prob; NaN stays
    tl.store(logp_ptr + row, logp)
    tl.store(entropy_ptr + row, log_s - a / s)
    tl.store(lse_ptr + row, lse)


@triton.jit
def logits_grad_kernel(
    logits_ptr, grad_ptr, targets_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr, row_mask_ptr,
    rows_per_batch, stride_b, stride_t, grad_stride_b, grad_stride_t, vocab, inv_temperature,
    HAS_ENTROPY_GRAD: tl.constexpr, HAS_ROW_MASK: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """dLoss/dx = (g * (1[v == y] - p) - h * p * (log p + H)) / temperature, in grad's dtype.

    The row rule of csrc/gspo_math.h (row_action): rows outside the loss (row_mask) get zeros;
    a row in the loss with no finite softmax (a NaN or +inf logit, or all -inf) or an
    out-of-range target gets NaN; a row with g = h = 0 gets zeros. None of these is read.
    """
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + _row_offset(row, rows_per_batch, stride_b, stride_t)
    out_ptr = grad_ptr + _row_offset(row, rows_per_batch, grad_stride_b, grad_stride_t)
    g = tl.load(grad_logp_ptr + row)
    has_upstream = g != 0.0
    if HAS_ENTROPY_GRAD:
        h = tl.load(grad_entropy_ptr + row)
        entropy = tl.load(entropy_ptr + row)
        has_upstream = has_upstream | (h != 0.0)
    lse = tl.load(lse_ptr + row)
    target = tl.load(targets_ptr + row)
    no_softmax = (lse != lse) | (lse == float("inf")) | (lse == -float("inf"))
    make_nan = no_softmax | (target < 0) | (target >= vocab)
    compute = has_upstream & (make_nan == 0)
    if HAS_ROW_MASK:
        in_loss = tl.load(row_mask_ptr + row) != 0
        make_nan = make_nan & in_loss
        compute = compute & in_loss
    read_limit = tl.where(compute, vocab, 0)
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, vocab, BLOCK_V):
        idx = start + cols
        z = tl.load(row_ptr + idx, mask=idx < read_limit, other=0.0).to(tl.float32) * inv_temperature
        log_p = z - lse
        p = tl.exp(log_p)
        if HAS_ENTROPY_GRAD:
            # log p clamped where p is 0 anyway (gspo_math.h, kLogFloor): a -inf logit gives
            # 0 * finite, while a non-finite g or h still makes the row non-finite, as on the
            # other backends.
            coef = g + h * (tl.maximum(log_p, -200.0) + entropy)
        else:
            coef = g
        grad = -p * coef + tl.where(idx == target, g, 0.0)
        grad = tl.where(compute, grad * inv_temperature, 0.0)
        grad = tl.where(make_nan, float("nan"), grad)
        tl.store(out_ptr + idx, grad.to(grad_ptr.dtype.element_ty), mask=idx < vocab)
