"""Interleaved A/B timing of the chunked fused-linear path's backward designs on a CPU, against
the materialized path, forward + backward, the bench's default problem (N = 2048, H = 512,
V = 32768, bf16; `bench/linear.py`'s problem and contenders). Each round runs every variant
twice in turn (the second timed, with the allocator warm), so that this machine's drifting
matmul speed hits them alike; medians over rounds.

    variant          backward sweep   gradient products written once
    materialized     -                (lm_head matmul in fp32, then gspo_loss)
    rows_fp32        rows             float32 (the design before 2026-12-01)
    vocab_fp32       vocab            float32
    shipped          choose_sweep     bf16 where the CPU multiplies it natively
    invariant        vocab            as shipped, with batch_invariant=True (fixed product shapes)

Run: python benchmarks/cpu/fused_linear_ab.py [rounds] [variant,...] (about 4 minutes at 7 rounds on
2 cores; default: all; the first variant given is the ratios' base, materialized when it is in).
"""
import statistics
import sys
import time

import torch

from gspo_kernels.linear import chunked, products
from gspo_kernels.bench.linear import LINEAR_PROVIDERS, LinearShape, make_linear_problem
from gspo_kernels.linear.sweeps import choose_sweep

SHAPE = LinearShape.parse("2048x512x32768")


def variant(sweep, native):
    """Sets the backward's sweep (None: choose_sweep) and whether bf16 counts as native."""
    def apply():
        chunked.choose_sweep = choose_sweep if sweep is None else (lambda *args: sweep)
        products.cpu_has_native_bf16 = lambda: native
    return apply


def main(rounds: int, chosen: list[str]) -> None:
    problem = make_linear_problem(SHAPE, torch.bfloat16, "cpu")
    native = products.cpu_has_native_bf16()
    variants = {
        "materialized": ("materialized", variant(None, native)),
        "rows_fp32": ("fused", variant("rows", False)),
        "vocab_fp32": ("fused", variant("vocab", False)),
        "shipped": ("fused", variant(None, native)),
        "invariant": ("fused_invariant", variant(None, native)),
    }
    if chosen:
        variants = {name: variants[name] for name in chosen}
    times = {name: [] for name in variants}
    for _ in range(rounds + 1):  # the first round warms up
        for name, (provider, apply) in variants.items():
            apply()
            step = LINEAR_PROVIDERS[provider].build(problem)
            step.loss().backward()  # untimed: the timed run finds the allocator warm, as in a training loop
            step.clear_grads()
            start = time.perf_counter()
            step.loss().backward()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["materialized" if "materialized" in times else next(iter(times))][1:])
    print(f"N={SHAPE.tokens} H={SHAPE.hidden} V={SHAPE.vocab} bf16, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}, native bf16: {native}, {rounds} rounds")
    print(f"| variant | median ms | vs {'materialized' if 'materialized' in times else next(iter(times))} |\n|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values[1:])
        print(f"| {name} | {median * 1e3:.0f} | {median / base:.2f}x |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7, sys.argv[2].split(",") if len(sys.argv) > 2 else [])
