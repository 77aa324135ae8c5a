"""The fuzz can fail, checked in every run of the suite: each defect that mutants.py plants in a
copy of the package is caught by its slice of the fuzz (the "mutants" profile: ci's draws, stopped
at the first failure), and the same slices pass on the unchanged copy. A change that blinds the
fuzz to one of these defects (a rule dropped from the oracle, a draw no longer made) fails here."""

import pytest

import mutants


@pytest.fixture(scope="module")
def control():
    return mutants.fast_run(None)


def test_the_slices_pass_without_a_mutant(control):
    failed, _, detail = control
    assert not failed, detail


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=lambda m: m.name)
def test_each_mutant_is_caught(mutant, control):
    assert not control[0], f"the unchanged copy fails its slices: {control[2]}"
    caught, seconds, detail = mutants.fast_run(mutant)
    assert caught, f"{mutant.name} survived {mutant.slice} in {seconds:.0f} s: {mutant.what}"
