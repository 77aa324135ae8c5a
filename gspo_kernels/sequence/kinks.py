"""The gradient at a kink, one rule for stage 2 and the float64 reference (docs/semantics.md, "Ties
and bounds"):

- a clamp passes the gradient strictly inside its bounds, and 0 on a bound and beyond;
- where the two branches of a min or max are equal, each gets half of the gradient.

This is what autograd gives for `clamp` with number bounds and for `torch.minimum`/`maximum` in
torch 2.14.1, so TRL's and verl's losses (plain autograd) agree with ours at a tie, e.g. an
on-policy ratio of exactly 1 with eps_low = 0. The rule is written out here and in the reference
rather than left to autograd, whose rule at a bound is not the same in every torch release.
"""

from __future__ import annotations

import numpy as np
import torch

_NUMPY_DTYPES = {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16}


def _step_inside(bound: float | None, towards: float, dtype: torch.dtype) -> float | None:
    """The value of `dtype` next to `bound` (as `dtype` rounds it) on the side of `towards`."""
    if bound is None:
        return None
    kind = _NUMPY_DTYPES[dtype]
    return float(np.nextafter(kind(bound), kind(towards)))


def clamp_with_slope(x: torch.Tensor, low: float | None, high: float | None):
    """(clamp(x, low, high), where that clamp passes a gradient: low < x < high, False for NaN).
    None leaves a side open; both None gives (x, True)."""
    if low is None and high is None:
        return x, True
    value = x.clamp(min=low, max=high)
    if low is not None and high is not None and not low < high:
        return value, torch.zeros_like(x, dtype=torch.bool)
    # x strictly inside the bounds is x inside the bounds one step in: one clamp and one compare
    # (three ops for two compares and an and), on the values of x's own dtype.
    inner = x.clamp(min=_step_inside(low, np.inf, x.dtype), max=_step_inside(high, -np.inf, x.dtype))
    return value, inner == x


def at_either(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """x exactly on one of two bounds (a bool tensor)."""
    on_low = x == low
    return on_low if low == high else on_low | (x == high)
