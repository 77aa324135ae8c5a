"""`bench --distributed`: what each split communicates, and what two gloo processes take
against one process on the same whole problem.

Communication is counted, not computed: the workers wrap torch.distributed's all_reduce (the
one collective the loss calls on 2 processes; on 3 or more the vocab merge's sums, and
batch_invariant's `d hidden` sum, are an all_gather added in rank order instead) and add up each call's payload (the bytes of the tensor handed to the
collective; a ring all_reduce sends about 2 (W-1)/W times that per rank). The payload does
not depend on V, so it is counted at N = 16384 with a small vocab, next to the bytes of the
baseline that gathers the bf16 logits, N x V x 2, at V = 151936.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..distributed.normalizer import global_normalizer
from ..loss import gspo_loss
from ..testing.problem_split import even_parts

SPLITS = ("tp", "cp", "dp")
SEQ_LEN = 512


@dataclass(frozen=True)
class DistributedBench:
    rows: int = 2048  # N of the timed problem
    vocab: int = 32768
    dtype: str = "bfloat16"
    world: int = 2
    reps: int = 5
    count_rows: int = 16384  # N at which the communication is counted
    count_vocab: int = 151936  # V of the logits-gather baseline

    def seq_len(self, rows: int) -> int:
        return min(SEQ_LEN, rows)


def _problem(split: str | None, rank: int, world: int, rows: int, vocab: int, seq_len: int, dtype) -> tuple:
    """This rank's part of a padded (N / seq_len, seq_len, V) problem (split None: whole)."""
    batch, t_start, t_stop, v_start, v_stop = rows // seq_len, 0, seq_len, 0, vocab
    kwargs = {"backend": "auto"}
    if split == "tp":
        v_start, v_stop = even_parts(vocab, world)[rank]
        kwargs.update(tp_group=dist.group.WORLD, vocab_start=v_start)
    elif split == "cp":
        t_start, t_stop = even_parts(seq_len, world)[rank]
        kwargs.update(cp_group=dist.group.WORLD)
    elif split == "dp":
        b_start, b_stop = even_parts(batch, world)[rank]
        batch = b_stop - b_start
    gen = torch.Generator().manual_seed(rank)
    shape = (batch, t_stop - t_start)
    logits = (torch.randn(*shape, v_stop - v_start, generator=gen) * 2).to(dtype).requires_grad_()
    mask = torch.ones(shape, dtype=torch.bool)
    mask[:, : max(0, 16 - t_start)] = False  # a short prompt
    targets = torch.randint(0, vocab, shape, generator=gen)
    old = torch.randn(shape, generator=gen) * 0.1 - 3.0
    adv = torch.randn(shape[0], generator=gen)
    return logits, (targets, old, adv), dict(kwargs, mask=mask), split == "dp"


def _loss(problem):
    logits, args, kwargs, data_parallel = problem
    if data_parallel:  # part of every step: the global count of this step's sequences
        kwargs = dict(kwargs, normalizer=global_normalizer(kwargs["mask"], "seq-mean-token-mean", dist.group.WORLD))
    return gspo_loss(logits, *args, **kwargs)[0]


def _step(problem) -> None:
    problem[0].grad = None
    _loss(problem).backward()


class _Counter:
    """Wraps dist.all_reduce, the one collective the loss calls; `phase` names where the next
    calls are counted."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self.phase = "forward"
        self._original = dist.all_reduce

    def __enter__(self):
        def counted(tensor, *args, **kwargs):
            self.calls[self.phase] = self.calls.get(self.phase, 0) + 1
            self.bytes[self.phase] = self.bytes.get(self.phase, 0) + tensor.numel() * tensor.element_size()
            return self._original(tensor, *args, **kwargs)
        dist.all_reduce = counted
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._original


def _count(split: str, rank: int, cfg: DistributedBench, dtype) -> dict:
    problem = _problem(split, rank, cfg.world, cfg.count_rows, 64 * cfg.world, cfg.seq_len(cfg.count_rows), dtype)
    with _Counter() as counter:
        loss = _loss(problem)
        counter.phase = "backward"
        loss.backward()
    return {"calls": counter.calls, "bytes": counter.bytes}


def _time(problem, reps: int) -> float:
    _step(problem)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        _step(problem)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _worker(rank: int, cfg: DistributedBench, init_file: str, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=cfg.world,
                            timeout=timedelta(seconds=600))
    dtype = getattr(torch, cfg.dtype)
    results = {}
    for split in SPLITS:
        counted = _count(split, rank, cfg, dtype)
        problem = _problem(split, rank, cfg.world, cfg.rows, cfg.vocab, cfg.seq_len(cfg.rows), dtype)
        dist.barrier()
        results[split] = dict(counted, ms=_time(problem, cfg.reps))
        del problem
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    # os._exit: gloo's threads can abort a normal interpreter exit after the group is gone
    # ("terminate called without an active exception", 1 run in 4 here); rank 0's results are on disk.
    os._exit(0)


def run(cfg: DistributedBench) -> dict:
    """Spawns cfg.world processes for the splits, then times one process (cfg.world threads)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_worker, args=(cfg, os.path.join(tmp, "init"), out), nprocs=cfg.world, join=True)
        with open(out) as f:
            results = json.load(f)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.world)
    try:
        whole = _problem(None, 0, 1, cfg.rows, cfg.vocab, cfg.seq_len(cfg.rows), getattr(torch, cfg.dtype))
        single_ms = _time(whole, cfg.reps)
    finally:
        torch.set_num_threads(threads)
    return {"config": asdict(cfg), "splits": results, "single_process_ms": single_ms}


def format_result(result: dict) -> str:
    cfg = result["config"]
    gather = cfg["count_rows"] * cfg["count_vocab"] * 2
    lines = [
        f"Distributed GSPO, {cfg['world']} gloo processes (1 thread each) against 1 process ({cfg['world']} threads), "
        f"{cfg['dtype']} logits, fwd+bwd, backend auto.",
        f"Communication: payload per rank per step at N = {cfg['count_rows']} (all [N]- or [S]-sized: V never enters); the "
        f"baseline gathers the bf16 logits at V = {cfg['count_vocab']}: N x V x 2 = {gather / 2**20:,.0f} MiB.",
        "",
        f"| split | collectives fwd / bwd | payload per rank | vs logits gather | "
        f"{cfg['world']} procs ms (N={cfg['rows']}, V={cfg['vocab']}) | 1 proc ms | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    single = result["single_process_ms"]
    for split, r in result["splits"].items():
        calls, nbytes = r["calls"], sum(r["bytes"].values())
        lines.append(
            f"| {split} | {calls.get('forward', 0)} / {calls.get('backward', 0)} | {nbytes:,} B | "
            f"{nbytes / gather:.2e} | {r['ms']:.1f} | {single:.1f} | {r['ms'] / single:.2f}x |")
    return "\n".join(lines)
