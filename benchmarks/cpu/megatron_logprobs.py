"""Peak memory and time per rank of GSPO on Megatron's vocab-parallel logits, tensor parallel 2
on gloo processes: megatron-core's own log-probs (`-vocab_parallel_cross_entropy`, which works
in place on a float32 shard and copies a bf16 one to float32, then gk.policy_loss's sequence
math) against gspo_kernels.integrations.megatron.gspo_loss on the same shard, float32 and bf16,
with and without inplace=True.

    python benchmarks/cpu/megatron_logprobs.py [--rows 4096] [--vocab 151936] [--reps 2]

Each contender runs in a fresh pair of processes, so each rank's peak RSS (getrusage) is its
own. The shard is made by an output layer's product (`[N, 64] @ [V/tp, 64].T`) before the step;
the figure is the peak during the loss's forward + backward (the product's backward included)
beyond what the rank held with its inputs and that shard, and the time is the median step. Prints a
Markdown table, one row per contender, rank 0's figures (rank 1's agree within a few MB).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN = 64  # the output layer's input width: small, so that its product's backward costs little
CONTENDERS = ("megatron_fp32", "ours_fp32", "ours_fp32_inplace", "megatron_bf16", "ours_bf16", "ours_bf16_inplace")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _step(contender, shard, labels, old, adv, mask):
    import gspo_kernels as gk
    from gspo_kernels.integrations import megatron as gm

    if contender.startswith("megatron"):
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        # In place on a float32 shard; a bf16 one it first copies to float32 (and keeps that).
        logp = -vocab_parallel_cross_entropy(shard, labels)
        loss, _ = gk.policy_loss(logp, old, adv, mask=mask)
    else:
        loss, _ = gm.gspo_loss(shard, labels, old, adv, loss_mask=mask, sequence_first=False,
                               inplace=contender.endswith("inplace"))
    loss.backward()


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
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(port, queue, contender, rows, vocab, reps), nprocs=2, join=True)
    return queue.get()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096, help="N, tokens (a multiple of 512; default 4096)")
    parser.add_argument("--vocab", type=int, default=151936, help="V, the whole vocabulary (default 151936)")
    parser.add_argument("--reps", type=int, default=2, help="timed steps per contender (default 2)")
    args = parser.parse_args(argv)
    if args.rows % 512 or args.vocab % 2:
        parser.error("--rows must be a multiple of 512 and --vocab even")
    print(f"N = {args.rows}, V = {args.vocab} over 2 ranks (V/tp = {args.vocab // 2}), rank 0; torch "
          f"{torch.__version__}, {os.cpu_count()} cores\n")
    print("| contender | shard of logits (MiB) | peak beyond inputs (MiB) | step (s) |")
    print("|---|---|---|---|")
    for contender in CONTENDERS:
        r = measure(contender, args.rows, args.vocab, args.reps)
        print(f"| {contender} | {r['shard_mib']:.0f} | {r['peak_beyond_inputs_mib']:.0f} | {r['step_s']:.2f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
