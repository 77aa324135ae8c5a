"""Megatron-Core's vocab-parallel path on NCCL in a group of one GPU: megatron-core's own
log-probs (-vocab_parallel_cross_entropy, then gk.policy_loss) against
gspo_kernels.integrations.megatron.gspo_loss on the same output-layer logits, N = 16384,
V = 151936, bf16 by default: loss and logits-gradient agreement, peak memory beyond the inputs
and the median forward + backward time of each. Needs megatron-core (carry .whl from
benchmarks/gpu/wheels.sh; without it the script prints SKIPPED and exits 0). Run by check.sh.

    python benchmarks/gpu/megatron_group_of_one.py [--tokens 16384] [--vocab 151936] [--reps 5] [--json F]
    python benchmarks/gpu/megatron_group_of_one.py --cpu     # rehearsal: gloo, N = 1024, V = 5000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import gspo_kernels as gk

HIDDEN = 256  # the output layer's input width; its product makes the logits, as in training
SEQ = 1024


def _timed_step(contender, hidden, weight, labels, old, adv, mask, device):
    """(loss, d hidden, seconds, peak bytes beyond the inputs and the logits) of one step."""
    from gspo_kernels.bench.megatron import _step

    hidden.grad = weight.grad = None
    logits = hidden @ weight.T
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    loss = _step(contender, logits, labels, old, adv, mask)
    if on_gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - before if on_gpu else float("nan")  # measured on a GPU only
    return loss, hidden.grad.clone(), seconds, peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--json")
    parser.add_argument("--cpu", action="store_true", help="rehearse on gloo with a small problem")
    args = parser.parse_args()
    try:
        from megatron.core import parallel_state
    except ImportError:
        print("SKIPPED: megatron-core is not installed (carry .whl from benchmarks/gpu/wheels.sh)")
        return 0
    if args.cpu:
        args.tokens, args.vocab, args.reps = 1024, 5000, 2
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)  # NCCL wants the index
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'init')}"
        if args.cpu:
            dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
        else:
            dist.init_process_group("nccl", init_method=init, rank=0, world_size=1, device_id=device)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        gen = torch.Generator().manual_seed(0)
        batch = args.tokens // SEQ
        hidden = torch.randn(batch, SEQ, HIDDEN, generator=gen).to(device, dtype).requires_grad_()
        weight = (torch.randn(args.vocab, HIDDEN, generator=gen) / HIDDEN ** 0.5).to(device, dtype).requires_grad_()
        labels = torch.randint(0, args.vocab, (batch, SEQ), generator=gen).to(device)
        with torch.no_grad():  # the old policy near the current one, so that most sequences have a gradient
            old = gk.selective_log_softmax(hidden @ weight.T, labels)
            old = old + 1e-4 * torch.randn(old.shape, generator=gen).to(device)
        adv = torch.randn(batch, generator=gen).to(device)
        mask = torch.ones(batch, SEQ, dtype=torch.bool, device=device)
        rows, results = [], {}
        name = "bf16" if dtype == torch.bfloat16 else "fp32"
        for contender in (f"megatron_{name}", f"ours_{name}", f"ours_{name}_inplace"):
            steps = [_timed_step(contender, hidden, weight, labels, old, adv, mask, device)
                     for _ in range(args.reps + 1)]  # the first warms up and is not counted
            loss, grad = steps[-1][0], steps[-1][1]
            results[contender] = (loss, grad)
            rows.append({"contender": contender, "step_ms": 1e3 * statistics.median(s[2] for s in steps[1:]),
                         "peak_beyond_inputs_mib": max(s[3] for s in steps[1:]) / 2**20})
        want_loss, want_grad = results[f"megatron_{name}"]
        for row in rows:
            loss, grad = results[row["contender"]]
            row["loss_rel_err"] = float((loss.double() - want_loss.double()).abs() / want_loss.double().abs())
            row["grad_rel_err"] = float((grad.double() - want_grad.double()).norm() / want_grad.double().norm())
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    logits_mib = args.tokens * args.vocab * torch.finfo(dtype).bits / 8 / 2**20
    print(f"Megatron path, {dist.Backend.NCCL if not args.cpu else 'gloo'} group of one, N = {args.tokens}, "
          f"V = {args.vocab}, {name}, logits {logits_mib:.0f} MiB; median of {args.reps} steps; "
          f"errors against megatron_{name}; torch {torch.__version__}")
    print("| contender | step (ms) | peak beyond inputs (MiB) | loss rel. err | d hidden rel. err |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['contender']} | {r['step_ms']:.1f} | {r['peak_beyond_inputs_mib']:.0f} | {r['loss_rel_err']:.1e} "
              f"| {r['grad_rel_err']:.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "vocab": args.vocab, "dtype": name, "rows": rows}, f, indent=1)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    failed = [r["contender"] for r in rows if r["loss_rel_err"] > tolerance or r["grad_rel_err"] > tolerance]
    if failed:
        print(f"FAIL: {failed} disagree with megatron-core's own beyond {tolerance}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
