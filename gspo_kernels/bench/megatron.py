"""Peak memory and time per rank of GSPO on Megatron's vocab-parallel logits, tensor parallel 2
on gloo processes: megatron-core's own log-probs (`-vocab_parallel_cross_entropy`, which works
in place on a float32 shard and copies a bf16 one to float32, then gk.policy_loss's sequence
math) against gspo_kernels.integrations.megatron.gspo_loss on the same shard, float32 and bf16,
with and without inplace=True.

    python -m gspo_kernels bench --megatron [NxV]     # default 4096x151936; needs megatron-core

Each contender runs in a fresh pair of processes, so each rank's peak RSS (getrusage) is its
own. The shard is made by an output layer's product (`[N, 64] @ [V/tp, 64].T`) before the step;
the figure is the peak during the loss's forward + backward (the product's backward included)
beyond what the rank held with its inputs and that shard, and the time is the median step. The
table has one row per contender, rank 0's figures (rank 1's agree within a few MB).
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..loss import gspo_loss
from ..policy_loss import policy_loss
from .ports import free_port

HIDDEN = 64  # the output layer's input width: small, so that its product's backward costs little
CONTENDERS = ("megatron_fp32", "ours_fp32", "ours_fp32_inplace", "megatron_bf16", "ours_bf16", "ours_bf16_inplace")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _step(contender, shard, labels, old, adv, mask):
    """One forward + backward of the loss on the shard; returns the loss, detached."""
    from megatron.core import parallel_state

    if contender.startswith("megatron"):
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        # In place on a float32 shard; a bf16 one it first copies to float32 (and keeps that).
        logp = -vocab_parallel_cross_entropy(shard, labels)
        loss, _ = policy_loss(logp, old, adv, mask=mask)
    else:
        # integrations.megatron.gspo_loss(..., sequence_first=False) is this call on a batch-first
        # shard (no view, no copy); made here so that the bench imports no integration.
        loss, _ = gspo_loss(shard, labels, old, adv, mask=mask, inplace=contender.endswith("inplace"),
                               tp_group=parallel_state.get_tensor_model_parallel_group())
    loss.backward()
    return loss.detach()


def _worker(rank, port, queue, contender, rows, vocab, reps):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    gen = torch.Generator().manual_seed(rank)
    batch, seq = rows // 512, 512
    dtype = torch.bfloat16 if "bf16" in contender else torch.float32
    # The shard comes out of an output layer, as in training: its gradient flows on into the
    # product's backward (a leaf's would be copied by autograd's AccumulateGrad, in place or not).
    hidden = torch.randn(batch, seq, HIDDEN, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(vocab // 2, HIDDEN, generator=gen) / HIDDEN ** 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    old = -torch.rand(batch, seq, generator=torch.Generator().manual_seed(1)) - 11.0
    adv = torch.randn(batch, generator=torch.Generator().manual_seed(2))
    mask = torch.ones(batch, seq, dtype=torch.bool)
    times, peak = [], None
    for _ in range(reps):
        # A fresh shard each step, as the output layer makes one (megatron-core's cross entropy and
        # inplace=True overwrite theirs), made before the step: not counted in its peak.
        hidden.grad = weight.grad = None
        fresh = hidden @ weight.T
        before = _rss_bytes()
        dist.barrier()
        start = time.perf_counter()
        _step(contender, fresh, labels, old, adv, mask)
        times.append(time.perf_counter() - start)
        peak = (_peak_bytes() - before) if peak is None else peak  # the first step's; ru_maxrss only grows
        del fresh
    result = {"peak_beyond_inputs_mib": peak / 2**20, "step_s": statistics.median(times),
              "shard_mib": batch * seq * (vocab // 2) * torch.finfo(dtype).bits / 8 / 2**20}
    if rank == 0:
        queue.put(result)  # a pipe write, done before the exit below
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def measure(contender: str, rows: int, vocab: int, reps: int) -> dict:
    port = free_port()
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(port, queue, contender, rows, vocab, reps), nprocs=2, join=True)
    return queue.get()


@dataclass(frozen=True)
class MegatronBench:
    rows: int = 4096  # N, a multiple of 512 (sequences of 512)
    vocab: int = 151936  # V, the whole vocabulary, even (split over 2 ranks)
    reps: int = 2
    contenders: tuple[str, ...] = CONTENDERS

    def __post_init__(self) -> None:
        if self.rows <= 0 or self.rows % 512 or self.vocab <= 0 or self.vocab % 2:
            raise ValueError(f"the Megatron problem needs N a multiple of 512 and V even; got N = {self.rows}, "
                             f"V = {self.vocab}")
        unknown = [c for c in self.contenders if c not in CONTENDERS]
        if unknown:
            raise ValueError(f"unknown Megatron contenders {unknown}; they are {', '.join(CONTENDERS)}")


def run(cfg: MegatronBench, progress=None) -> list[dict]:
    """One row per contender, each measured in a fresh pair of processes."""
    rows = []
    for contender in cfg.contenders:
        rows.append(dict(measure(contender, cfg.rows, cfg.vocab, cfg.reps), contender=contender))
        if progress is not None:
            progress.step(contender)
    return rows


def format_rows(cfg: MegatronBench, rows: list[dict]) -> str:
    lines = [f"GSPO on Megatron's vocab-parallel logits: N = {cfg.rows}, V = {cfg.vocab} over 2 gloo ranks "
             f"(V/tp = {cfg.vocab // 2}), rank 0, {cfg.reps} step(s) each, median; torch {torch.__version__}, "
             f"{os.cpu_count()} cores. megatron_*: megatron-core's -vocab_parallel_cross_entropy, then "
             "gk.policy_loss; ours_*: gk.gspo_loss on the shard with megatron-core's TP group (what "
             "integrations.megatron.gspo_loss runs on a batch-first shard).", "",
             "| contender | shard of logits (MiB) | peak beyond inputs (MiB) | step (s) |", "|---|---|---|---|"]
    lines += [f"| {r['contender']} | {r['shard_mib']:.0f} | {r['peak_beyond_inputs_mib']:.0f} | {r['step_s']:.2f} |"
              for r in rows]
    return "\n".join(lines)
