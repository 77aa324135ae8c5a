"""Distributed GSPO against the single-process loss on the whole problem: tensor parallel
(vocab slices), context parallel (token parts), both on a 2 x 2 mesh, and data parallel
with the global normalizer, on gloo with spawned processes (world sizes 2 and 3, so that
vocab and token splits are uneven; 4 for the mesh). The cases live beside this file: the grid
in dist_grid.py, the whole problem in dist_problems.py, one rank's part in dist_split.py, the
comparison in dist_checks.py and the spawned workers in dist_harness.py. One spawn per world
size runs them all, and each case is reported here on its own."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from dist_grid import SETUP_CASE, cases
from dist_harness import run_world

WORLDS = (2, 3, 4)
_results: dict[int, dict[str, list[str]]] = {}

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def _world_results(world: int, tmp_path_factory) -> dict[str, list[str]]:
    if world not in _results:
        _results[world] = run_world(world, str(tmp_path_factory.mktemp(f"world{world}")))
    return _results[world]


@pytest.mark.parametrize("world,case_id", [(w, c.id) for w in WORLDS for c in cases(w)]
                         + [(w, SETUP_CASE) for w in WORLDS])
def test_matches_single_process(world, case_id, tmp_path_factory):
    results = _world_results(world, tmp_path_factory)
    assert case_id in results, f"the workers did not run {case_id}"
    failures = results[case_id]
    assert not failures, "\n".join(failures)
