"""A trainer test on gloo processes started the way accelerate and verl's workers expect them
(RANK, WORLD_SIZE, MASTER_ADDR in the environment): shared by the DDP, FSDP2 and ZeRO-3 tests
of the TRL drop-in and the verl actor test. A worker is `worker(rank, port, out, *args)`; rank 0
writes its result to `out`. Spawned workers start with the parent's sys.path (multiprocessing's
spawn hands it over), so they import the test modules and this one by name as the tests do;
this folder is on sys.path through pyproject.toml's `pythonpath`."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from gspo_kernels.bench.ports import free_port


def join(rank: int, world: int, port: int) -> None:
    """This process's part of the world, as accelerate reads it (it creates the group itself)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)


def leave(rank: int, out: str, result) -> None:
    """Rank 0 writes `result`; every rank tears the group down and exits at once. os._exit: with
    TRL's and accelerate's state alive, a clean interpreter exit aborted a rank once ("terminate
    called without an active exception") after its checks had passed."""
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def run(worker, world: int, tmp_path, *args):
    """Spawns `world` workers and returns rank 0's result."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "result.json")
    mp.spawn(worker, args=(free_port(), out, *args), nprocs=world, join=True)
    with open(out) as f:
        return json.load(f)
