"""A pairwise covering subset of a parametrized grid: cases chosen so that every value of any two
parameters that meet somewhere in the grid meet in some chosen case.

The interpreted Triton backend runs grids whose other axes only change stage 2 (the objective, the
level, the aggregation: PyTorch code shared by every backend, tests/conftest.py says which) over
such a subset; the cpu and torch backends, and Triton on a GPU, run the whole grid.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence


def _pairs(case: Mapping[str, Hashable]) -> set[tuple]:
    items = sorted(case.items())
    return {(a, b) for a, b in itertools.combinations(items, 2)}


def covering_subset(cases: Sequence[Mapping[str, Hashable]]) -> list[int]:
    """Indices of `cases` (dicts of parameter name to value) whose pairs of (name, value) cover
    every such pair of the whole grid. Greedy, deterministic: each step takes the first case that
    covers the most pairs not yet covered. A grid of one parameter keeps every case (its values
    form no pairs, and each must run)."""
    if not cases:
        return []
    if len(cases[0]) < 2:
        return list(range(len(cases)))
    pairs = [_pairs(c) for c in cases]
    missing = set().union(*pairs)
    chosen: list[int] = []
    while missing:
        best = max(range(len(cases)), key=lambda i: (len(pairs[i] & missing), -i))
        chosen.append(best)
        missing -= pairs[best]
    return sorted(chosen)


def covers_every_pair(cases: Sequence[Mapping[str, Hashable]], subset: Sequence[int]) -> bool:
    """Whether the cases at `subset` hold every pair of values the whole grid holds."""
    want = set().union(*(_pairs(c) for c in cases)) if cases else set()
    have = set().union(*(_pairs(cases[i]) for i in subset)) if subset else set()
    return want <= have
