"""Interim CPU benchmark of the fused-linear loss (until `python -m gspo_kernels bench` has
fused-linear problems): forward + backward time and peak memory beyond the inputs and the
gradients returned, each contender in a fresh process.

    python benchmarks/fused_linear_cpu.py [--tokens 2048,8192] [--hidden 512] [--vocab 32768]

Contenders, all from bf16 hidden states and lm_head weight:
    chunked       gk.fused_linear_gspo_loss (default chunk rule), the logits never whole
    materialized  logits = hidden.float() @ weight.float().T (fp32, as a CPU must: its bf16
                  matmuls run 10-80x slower), then gk.gspo_loss on them (our kernel)
    eager         the same fp32 logits, then log_softmax + gather + the GSPO formula
    liger         Liger-Kernel's LigerFusedLinearGRPOLoss (sequence level, one sequence per
                  chunk, uncompiled), given float32 copies of hidden and weight as its inputs:
                  it multiplies in its inputs' dtype (when liger-kernel is installed)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time

import torch

import gspo_kernels as gk
from gspo_kernels.bench.providers import gspo_from_logprobs

EPS = dict(eps_low=3e-4, eps_high=4e-4)


def _inputs(tokens, hidden, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    batch = tokens // 512
    h = (torch.randn(batch, 512, hidden, generator=gen) * 0.5).bfloat16()
    w = (torch.randn(vocab, hidden, generator=gen) * 0.05).bfloat16()
    targets = torch.randint(0, vocab, (batch, 512), generator=gen)
    with torch.no_grad():
        logp = torch.cat([torch.log_softmax(h[i].float() @ w.float().t(), -1).gather(-1, targets[i, :, None])
                          for i in range(batch)]).reshape(batch, 512)
    old = logp + 1e-3 * torch.randn(batch, 512, generator=gen)
    adv = torch.randn(batch, generator=gen)
    return h, w, targets, old, adv


def _liger(h, w, targets, old, adv):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, compiled=False, use_ref_model=False, loss_type="grpo",
                                       importance_sampling_level="sequence", epsilon_low=EPS["eps_low"],
                                       epsilon_high=EPS["eps_high"])
    return loss_fn(h, w, targets, torch.ones_like(old), adv, old_per_token_logps=old)[0]


def _loss(name, h, w, targets, old, adv):
    if name == "liger":
        return _liger(h, w, targets, old, adv)
    if name == "chunked":
        return gk.fused_linear_gspo_loss(h, w, targets, old, adv, **EPS)[0]
    logits = h.float() @ w.float().t()
    if name == "materialized":
        return gk.gspo_loss(logits, targets, old, adv, **EPS)[0]
    logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return gspo_from_logprobs(logp, old, adv, torch.ones_like(targets, dtype=torch.bool))


def _kib(field):
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def _child(what, name, tokens, hidden, vocab, reps):
    h, w, targets, old, adv = _inputs(tokens, hidden, vocab)
    if name == "liger":
        h, w = h.float(), w.float()
    h.requires_grad_()
    w.requires_grad_()

    def step():
        h.grad = w.grad = None
        _loss(name, h, w, targets, old, adv).backward()

    step()
    if what == "time":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        print(json.dumps({"ms": 1000 * statistics.median(times)}))
        return
    h.grad = w.grad = None
    before = _kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    step()
    returned = h.grad.nbytes + w.grad.nbytes
    print(json.dumps({"peak_mib": ((_kib("VmHWM") - before) * 1024 - returned) / 2**20}))


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:8]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    # Memory: a fixed mmap threshold, so RSS follows live memory (see bench/memory.py). Time:
    # the default allocator, which reuses freed chunk buffers as a trainer's process would.
    envs = {"time": dict(os.environ), "memory": {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}}
    print("| contender | N | fwd+bwd ms | GFLOP/s (6NVH) | peak MiB beyond inputs and returned grads |")
    print("|---|---|---|---|---|")
    for tokens in map(int, args.tokens.split(",")):
        for name in ("chunked", "materialized", "eager", "liger"):
            if tokens > 2048 and name != "chunked":
                continue
            if name == "liger" and importlib.util.find_spec("liger_kernel") is None:
                print("| liger | - | skipped: liger-kernel not installed | | |")
                continue
            result = {}
            for what, env in envs.items():
                out = subprocess.run([sys.executable, __file__, "--child", what, name, str(tokens), str(args.hidden),
                                      str(args.vocab), str(args.reps)], capture_output=True, text=True, env=env)
                if out.returncode:
                    raise SystemExit(f"{name} {tokens}: {out.stderr.strip().splitlines()[-1:]}")
                result.update(json.loads(out.stdout.strip().splitlines()[-1]))
            gflops = 6 * tokens * args.vocab * args.hidden / (result["ms"] / 1000) / 1e9
            print(f"| {name} | {tokens} | {result['ms']:.0f} | {gflops:.0f} | {result['peak_mib']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
