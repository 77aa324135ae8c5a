"""The spawn harness of test_distributed.py: `world` gloo workers, each running every case of
its world's grid and recording the failures it saw per case; the parent merges them over the
ranks, and turns them into one pytest case each. The workers import dist_grid, dist_checks
and the rest by name: test_distributed.py's folder is on sys.path in the children too."""

from __future__ import annotations

import json
import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from dist_checks import check_case, check_setup_helpers
from dist_grid import SETUP_CASE, cases


def _groups(rank: int, world: int) -> dict:
    """The process groups of the splits; every rank creates every group, in the same order."""
    groups = {"dp": dist.group.WORLD}
    if world == 4:  # 2 x 2 mesh: tp pairs {0, 1}, {2, 3}; cp pairs {0, 2}, {1, 3}
        tp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        cp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        groups["tp"], groups["cp"] = tp[rank // 2], cp[rank % 2]
    else:
        groups["tp"] = groups["cp"] = dist.group.WORLD
    return groups


def worker(rank: int, world: int, init_file: str, out_dir: str, only=None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    groups = _groups(rank, world)
    results = {}
    for index, case in enumerate(cases(world)):
        if only is not None and not any(key in case.id for key in only):
            continue
        try:
            failures = check_case(case, rank, world, groups, seed=1000 + index)
        except Exception:  # recorded, so one broken case does not hide the others
            failures = [traceback.format_exc(limit=6)]
        results[case.id] = failures
    if only is None or any(key in SETUP_CASE for key in only):
        try:
            results[SETUP_CASE] = check_setup_helpers(rank, world, groups)
        except Exception:
            results[SETUP_CASE] = [traceback.format_exc(limit=6)]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    # os._exit: gloo's threads can abort a normal interpreter exit after the group is gone
    # ("terminate called without an active exception", 1 run in 4 here); the results are on disk.
    os._exit(0)


def run_world(world: int, tmp_dir: str, only=None) -> dict[str, list[str]]:
    """Spawns `world` workers; returns each case's failures, over all ranks ([] = passed).
    only: substrings of case ids, to run a few while debugging."""
    import torch.multiprocessing as mp

    init_file = os.path.join(tmp_dir, "init")
    mp.spawn(worker, args=(world, init_file, tmp_dir, only), nprocs=world, join=True)
    merged: dict[str, list[str]] = {}
    for rank in range(world):
        with open(os.path.join(tmp_dir, f"rank{rank}.json")) as f:
            for case_id, failures in json.load(f).items():
                merged.setdefault(case_id, []).extend(f"rank {rank}: {m}" for m in failures)
    return merged
