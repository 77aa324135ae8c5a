"""What every Triton kernel shares, written once (csrc/gspo_math.h is the same for C++).

Softmax statistics of a set of logits z (already divided by the temperature) are kept as
    m = max z,   s = sum exp(z - m),   a = sum exp(z - m) * (z - m)
so that lse = m + log s and the entropy H = log s - a / s; shifting by m before summing
z * exp(z) keeps H accurate when the logits sit far from zero. Two such triples over
disjoint sets merge exactly (`merge_softmax_stats`), which is all an online loop does, over a
row's vocab blocks (row_kernels.py) or a tile's (tile_kernels.py).

z is the logit map of x (contract.GradInputs): inv_temperature * x, or with a soft-cap
softcap * tanh(inv_temperature * x) (`map_logits`). Stage 3, per element, with p = softmax(z):
    dLoss/dx = (g * (1[v == y] - p) - h * p * (log p + H)) * dz/dx
and the row rule of csrc/gspo_math.h (row_action): rows outside the loss get zeros; a row in
the loss with no finite softmax (a NaN or +inf logit, or all -inf) or a bad target gets NaN;
a row with g = h = 0 gets zeros. None of these is read.
"""

import numpy
import triton
import triton.language as tl

from ...compat import triton_interpreter_problem
from ..contract import LOG_FLOOR as _LOG_FLOOR

# log p clamped where p is 0 anyway: a -inf logit gives 0 * finite, while a non-finite g or h
# still makes the row non-finite, as on the other backends.
LOG_FLOOR = tl.constexpr(_LOG_FLOOR)


@triton.jit
def _finite_or_zero(m):
    # A set with no finite logit has m = -inf; shifting by 0 instead keeps exp() NaN-free.
    return tl.where(m == -float("inf"), 0.0, m)


@triton.jit
def _tanh(y):
    """tanh from tl.exp alone (libdevice's does not run in the interpreter): (1 - e) / (1 + e),
    e = exp(-2|y|), for |y| >= 0.4, +-1 at +-inf, NaN for NaN; below 0.4, where 1 - e would lose
    digits, tanh's series to y^13 (the next term is under 4e-9 of tanh there)."""
    a = tl.abs(y)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    y2 = y * y
    p = -1382.0 / 155925.0 + y2 * (21844.0 / 6081075.0)
    p = 62.0 / 2835.0 + y2 * p
    p = -17.0 / 315.0 + y2 * p
    p = 2.0 / 15.0 + y2 * p
    p = -1.0 / 3.0 + y2 * p
    return tl.where(a < 0.4, y + y * y2 * p, tl.where(y < 0, -big, big))


@triton.jit
def map_logits(x, inv_temperature, softcap, HAS_SOFTCAP: tl.constexpr):
    """z of float32 logits x: inv_temperature * x, or softcap * tanh(inv_temperature * x)."""
    y = x * inv_temperature
    if HAS_SOFTCAP:
        y = softcap * _tanh(y)
    return y


@triton.jit
def logit_slope(z, inv_temperature, softcap, HAS_SOFTCAP: tl.constexpr):
    """dz/dx from z: inv_temperature * softcap * (1 - t^2), t = z / softcap: exactly 0 where z
    saturates (t = +-1), as in float64."""
    slope = inv_temperature
    if HAS_SOFTCAP:  # one return: compiled Triton refuses returns of different types
        t = z / softcap
        slope = (inv_temperature * softcap) * (1.0 - t * t)
    return slope


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
    """(m, s, a) of a block of logits along AXIS: 0 for a row's block, 1 for a (rows, vocab)
    tile of the fused-linear kernels."""
    # One max per block and one exp per element: the exp unit, not memory, is the
    # tighter limit for 16-bit logits on Hopper, so a per-element rescale would cost.
    m = tl.max(z, AXIS)
    shift = _finite_or_zero(m)
    moved = z - tl.expand_dims(shift, AXIS)
    e = tl.exp(moved)
    return m, tl.sum(e, AXIS), tl.sum(tl.where(e == 0, 0.0, e * moved), AXIS)


@triton.jit
def finish_stats(m, s, a, z_target, valid):
    """(logp, entropy, lse) of a row from its (m, s, a) and its target's scaled logit; logp
    is NaN where the target is not `valid`."""
    log_s = tl.log(s)
    # (z_y - m) - log s, not z_y - lse: no rounding of lse when the logits are large.
    logp = tl.where(valid, (z_target - m) - log_s, float("nan"))
    logp = tl.where(logp > 0, 0.0, logp)  # a rounding above 0 is impossible for a log-prob; NaN stays
    return logp, log_s - a / s, m + log_s


@triton.jit
def row_rule(lse, bad_target, g, h, in_loss, HAS_ENTROPY_GRAD: tl.constexpr):
    """(make_nan, compute) of a row (or a vector of rows): NaN for a row in the loss without
    a finite softmax or with a bad target; computed for a row in the loss with g or h != 0."""
    has_upstream = g != 0.0
    if HAS_ENTROPY_GRAD:
        has_upstream = has_upstream | (h != 0.0)
    no_softmax = (lse != lse) | (lse == float("inf")) | (lse == -float("inf"))
    make_nan = (no_softmax | bad_target) & in_loss
    return make_nan, has_upstream & in_loss & (make_nan == 0)


@triton.jit
def grad_term(log_p, g, h, entropy, is_target, compute, make_nan, slope,
              HAS_ENTROPY_GRAD: tl.constexpr):
    """(dLoss/dx, p) of a block from log p = z - lse and dz/dx (`slope`, a scalar or like
    log_p); the row rule applied (zeros where not `compute`, NaN where `make_nan`). g, h,
    entropy broadcast against log_p."""
    p = tl.exp(log_p)
    if HAS_ENTROPY_GRAD:
        coef = g + h * (tl.maximum(log_p, LOG_FLOOR) + entropy)
    else:
        coef = g
    grad = -p * coef + tl.where(is_target, g, 0.0)
    grad = tl.where(compute, grad * slope, 0.0)
    return tl.where(make_nan, float("nan"), grad), p


# The kernels became interpreted functions if TRITON_INTERPRET=1 was set when they were defined.
INTERPRETED = not isinstance(merge_softmax_stats, triton.runtime.JITFunction)
# Why the interpreter cannot run them with the installed versions, or None (compat.py).
INTERPRETER_PROBLEM = (triton_interpreter_problem(triton.__version__, numpy.__version__) if INTERPRETED else None)
