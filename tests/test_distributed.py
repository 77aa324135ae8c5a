"""Distributed GSPO against the single-process loss on the whole problem: tensor parallel
(vocab slices), context parallel (token parts), both on a 2 x 2 mesh, and data parallel
with the global normalizer, on gloo with spawned processes (world sizes 2 and 3, so that
vocab and token splits are uneven; 4 for the mesh). The cases live in distributed_cases.py;
one spawn per world size runs them all, and each case is reported here on its own."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import distributed_cases as dc

WORLDS = (2, 3, 4)
_results: dict[int, dict[str, list[str]]] = {}

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def _world_results(world: int, tmp_path_factory) -> dict[str, list[str]]:
    if world not in _results:
        _results[world] = dc.run_world(world, str(tmp_path_factory.mktemp(f"world{world}")))
    return _results[world]


@pytest.mark.parametrize("world,case_id", [(w, c.id) for w in WORLDS for c in dc.cases(w)]
                         + [(w, dc.SETUP_CASE) for w in WORLDS])
def test_matches_single_process(world, case_id, tmp_path_factory):
    results = _world_results(world, tmp_path_factory)
    assert case_id in results, f"the workers did not run {case_id}"
    failures = results[case_id]
    assert not failures, "\n".join(failures)
