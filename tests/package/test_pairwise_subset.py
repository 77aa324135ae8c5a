"""tests/pairwise.py, which decides what the interpreted Triton backend runs of two grids: the
subset it picks covers every pair of the grid, and a subset that misses one is told apart."""

import itertools

from pairwise import covering_subset, covers_every_pair


def _grid(**axes):
    names = list(axes)
    return [dict(zip(names, values)) for values in itertools.product(*axes.values())]


def test_the_subset_covers_every_pair_and_is_smaller():
    cases = _grid(objective=list("abcde"), agg=list("01234"), dtype=["f32", "bf16", "f16"], packed=[0, 1])
    subset = covering_subset(cases)
    assert covers_every_pair(cases, subset)
    assert 25 <= len(subset) < len(cases) // 4  # objective x agg alone needs 25
    for name in cases[0]:  # every value of every axis runs
        assert {cases[i][name] for i in subset} == {c[name] for c in cases}


def test_a_grid_that_is_not_a_product_covers_only_its_own_pairs():
    cases = [c for c in _grid(objective=["clip", "vespo"], level=["seq", "tok", "both"], dtype=["f32", "bf16"])
             if not (c["objective"] == "vespo" and c["level"] == "both")]
    subset = covering_subset(cases)
    assert covers_every_pair(cases, subset)
    assert not any(cases[i]["objective"] == "vespo" and cases[i]["level"] == "both" for i in subset)


def test_dropping_any_chosen_case_loses_a_pair():
    cases = _grid(level=["seq", "tok", "both"], agg=list("01234"), dtype=["f32", "bf16", "f16"])
    subset = covering_subset(cases)
    assert len(subset) == 15  # level x agg and agg x dtype each need 15; greedy reaches it here
    for drop in subset:
        assert not covers_every_pair(cases, [i for i in subset if i != drop])


def test_one_axis_keeps_every_case():
    cases = [{"packed": 0}, {"packed": 1}]
    assert covering_subset(cases) == [0, 1]
