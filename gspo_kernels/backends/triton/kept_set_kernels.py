"""The sampler's kept set in Triton: per row, the threshold t on the raw logits such that the
tokens vLLM's sampler keeps (min-p, then top-k, then top-p) are exactly {x >= t}, with no sort
and no float32 copy of the row (token_stats/kept_set.py states the rules; its PyTorch pre-pass
is the reference, csrc/cpu/kept_set.cpp the CPU's own selection).

Each filter keeps an upper set of the raw logits, so the kept set is {key(x) >= lower} for an
integer `key` that orders as the floats do, and each filter only raises `lower`. Top-k and
top-p are searches for the smallest key whose count (top-k) or mass (top-p) strictly above it
falls below a target: the search keeps an interval (lo, hi] holding the answer and cuts it at
PIVOTS evenly spaced keys per pass over the row (a [PIVOTS, BLOCK_V] compare), so a row is read
about log(key range) / log(PIVOTS + 1) times: 4 passes for bf16 logits (16-bit keys), 5 for
fp16, 8 for float32, with 16 pivots. A pass's counts are exact integers and its masses are
float32 block sums added in float64, as the CPU's selection sums them.
"""

import triton
import triton.language as tl

from .common import map_logits


@triton.jit
def _ordered_key(x, KEY_SHIFT: tl.constexpr):
    """An int32 that orders as the float32 x does (-0.0 as +0.0, never NaN here), without the
    KEY_SHIFT low bits that a 16-bit dtype leaves zero."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)) >> KEY_SHIFT


@triton.jit
def _load_row_block(row_ptr, idx, vocab):
    return tl.load(row_ptr + idx, mask=idx < vocab, other=0.0).to(tl.float32)


@triton.jit
def _cut(lo, hi, pivots, reaches):
    """The interval (lo, hi] narrowed by pivot keys, given which of them still reach the target
    (a count or mass strictly above at least the target: the answer lies above those)."""
    new_lo = tl.max(tl.where(reaches, pivots, lo), 0)
    new_hi = tl.min(tl.where(reaches, hi, pivots), 0)
    return new_lo, new_hi


@triton.jit
def _pivots(lo, hi, PIVOTS: tl.constexpr):
    """PIVOTS keys evenly spaced inside (lo, hi) (int64: the span can pass 2**31); at least one
    lies strictly inside whenever hi - lo >= 2, so each pass shrinks the interval."""
    j = tl.arange(0, PIVOTS).to(tl.int64)
    return lo + ((hi - lo) * (j + 1)) // (PIVOTS + 1)


@triton.jit
def kept_threshold_kernel(
    logits_ptr, out_ptr, rows_per_batch, stride_b, stride_t, vocab, inv_temperature, softcap,
    top_k, top_p_bits, log_min_p,
    HAS_SOFTCAP: tl.constexpr, HAS_MIN_P: tl.constexpr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr,
    KEY_SHIFT: tl.constexpr, PIVOTS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    # int64: N * V passes 2**31 at N = 14k, V = 152k.
    row_ptr = logits_ptr + (row // rows_per_batch) * stride_b + (row % rows_per_batch) * stride_t
    cols = tl.arange(0, BLOCK_V)
    ninf = -float("inf")

    # The row's max and whether it holds a NaN.
    top = tl.full([BLOCK_V], ninf, tl.float32)
    nans = tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, vocab, BLOCK_V):
        idx = start + cols
        x = _load_row_block(row_ptr, idx, vocab)
        nans += (x != x).to(tl.int32)
        top = tl.maximum(top, tl.where((x != x) | (idx >= vocab), ninf, x))
    x_max = tl.max(top, 0)
    # A NaN, or +inf without a soft-cap: no finite softmax, every token kept (results stay NaN);
    # an all -inf row keeps every token too. Such a row searches nothing (an empty interval).
    no_softmax = (tl.sum(nans, 0) > 0) | (x_max == ninf)
    if not HAS_SOFTCAP:
        no_softmax = no_softmax | (x_max == float("inf"))
    # The masses' shift: 0 for a row without a softmax, whose search is empty anyway.
    z_max = tl.where(no_softmax, 0.0, map_logits(x_max, inv_temperature, softcap, HAS_SOFTCAP))
    key_max = _ordered_key(x_max, KEY_SHIFT).to(tl.int64)

    lower = _ordered_key(ninf, KEY_SHIFT).to(tl.int64)  # the kept set so far: {key >= lower}
    if HAS_MIN_P:  # z >= max z + log(min_p), in float32 as the reference computes it
        z_min = z_max + log_min_p
        small = tl.full([BLOCK_V], float("inf"), tl.float32)
        for start in range(0, vocab, BLOCK_V):
            idx = start + cols
            x = _load_row_block(row_ptr, idx, vocab)
            reach = (idx < vocab) & (map_logits(x, inv_temperature, softcap, HAS_SOFTCAP) >= z_min)
            small = tl.minimum(small, tl.where(reach, x, float("inf")))
        lower = tl.where(no_softmax, lower, _ordered_key(tl.min(small, 0), KEY_SHIFT).to(tl.int64))

    if HAS_TOP_K:  # the k-th largest kept logit, ties with it kept; all stay when fewer than k
        n_kept = tl.zeros([BLOCK_V], tl.int32)
        for start in range(0, vocab, BLOCK_V):
            idx = start + cols
            key = _ordered_key(_load_row_block(row_ptr, idx, vocab), KEY_SHIFT)
            n_kept += ((idx < vocab) & (key >= lower)).to(tl.int32)
        search = (tl.sum(n_kept, 0) >= top_k) & (no_softmax == 0)
        # (lo, hi]: at least top_k keys lie above lo, fewer above hi (none above the max).
        lo = lower - 1
        hi = tl.where(search, key_max, lo + 1)
        while hi - lo > 1:
            pivots = _pivots(lo, hi, PIVOTS)
            pivots32 = pivots.to(tl.int32)
            counts = tl.zeros([PIVOTS], tl.int32)
            for start in range(0, vocab, BLOCK_V):
                idx = start + cols
                key = _ordered_key(_load_row_block(row_ptr, idx, vocab), KEY_SHIFT)
                live = (idx < vocab) & (key >= lower)
                above = (key[None, :] > pivots32[:, None]) & live[None, :]
                counts += tl.sum(above.to(tl.int32), 1)
            lo, hi = _cut(lo, hi, pivots, counts >= top_k)
        lower = tl.where(search, hi, lower)

    if HAS_TOP_P:  # the softmax over the kept tokens, at the row's max (always kept)
        total = tl.zeros([BLOCK_V], tl.float32).to(tl.float64)
        for start in range(0, vocab, BLOCK_V):
            idx = start + cols
            x = _load_row_block(row_ptr, idx, vocab)
            live = (idx < vocab) & (_ordered_key(x, KEY_SHIFT) >= lower)
            e = tl.where(live, tl.exp(map_logits(x, inv_temperature, softcap, HAS_SOFTCAP) - z_max), 0.0)
            total += e.to(tl.float64)
        # top_p in float64 (its bits, an int64 argument), as the CPU's selection takes it.
        top_p = top_p_bits.to(tl.int64).to(tl.float64, bitcast=True)
        target = top_p * tl.sum(total, 0)
        # The smallest key whose mass strictly above it is below target: (lo, hi] holds it, all
        # the mass lies above lo and none above the max.
        lo = lower - 1
        hi = tl.where(no_softmax, lo + 1, key_max)
        while hi - lo > 1:
            pivots = _pivots(lo, hi, PIVOTS)
            pivots32 = pivots.to(tl.int32)
            masses = tl.zeros([PIVOTS], tl.float32).to(tl.float64)
            for start in range(0, vocab, BLOCK_V):
                idx = start + cols
                x = _load_row_block(row_ptr, idx, vocab)
                key = _ordered_key(x, KEY_SHIFT)
                live = (idx < vocab) & (key >= lower)
                e = tl.where(live, tl.exp(map_logits(x, inv_temperature, softcap, HAS_SOFTCAP) - z_max), 0.0)
                above = key[None, :] > pivots32[:, None]
                masses += tl.sum(tl.where(above, e[None, :], 0.0), 1).to(tl.float64)
            lo, hi = _cut(lo, hi, pivots, masses >= target)
        lower = tl.where(no_softmax, lower, hi)

    # Halfway between the smallest kept logit and the largest dropped one (in float64, then
    # float32, never at or below the dropped one): kept_set.py's margin for logits formed again.
    small = tl.full([BLOCK_V], float("inf"), tl.float32)
    big = tl.full([BLOCK_V], ninf, tl.float32)
    dropped = tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, vocab, BLOCK_V):
        idx = start + cols
        x = _load_row_block(row_ptr, idx, vocab)
        kept = _ordered_key(x, KEY_SHIFT) >= lower
        small = tl.minimum(small, tl.where((idx < vocab) & kept, x, float("inf")))
        big = tl.maximum(big, tl.where((idx < vocab) & (kept == 0), x, ninf))
        dropped += ((idx < vocab) & (kept == 0)).to(tl.int32)
    smallest = tl.min(small, 0)
    largest_out = tl.max(big, 0)
    middle = ((smallest.to(tl.float64) + largest_out.to(tl.float64)) / 2.0).to(tl.float32)
    threshold = tl.where(middle > largest_out, middle, smallest)
    # Every token kept (or no softmax): -inf, the kernels' plain path, bitwise.
    every = no_softmax | (tl.sum(dropped, 0) == 0)
    tl.store(out_ptr + row, tl.where(every, ninf, threshold))
