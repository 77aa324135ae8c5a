"""The sampler's kept-set selection alone, on a CPU: the cpu backend's kernel
(csrc/cpu/kept_set.cpp, top_p_cut.cpp) against the PyTorch pre-pass (token_stats/kept_set.py),
timed interleaved, beside the plain forward kernel the selection precedes.

    .venv/bin/python benchmarks/cpu/kept_set_selection.py [--rows 4096] [--vocab 32768] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gspo_kernels as gk
from gspo_kernels.config.logit_map import LogitMap
from gspo_kernels.token_stats.kept_set import SamplingFilter, kept_thresholds

FILTERS = {"top_k=50": SamplingFilter(50), "top_p=0.9": SamplingFilter(None, 0.9),
           "min_p=0.1": SamplingFilter(None, None, 0.1), "all three": SamplingFilter(50, 0.9, 0.05)}


def _ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, generator=gen) * 3).bfloat16()
    targets = torch.randint(0, args.vocab, (args.rows,), generator=gen)
    plain = _ms(lambda: gk.selective_log_softmax(logits, targets, backend="cpu"), args.reps)
    print(f"N = {args.rows}, V = {args.vocab}, bf16, {torch.get_num_threads()} threads; "
          f"plain forward kernel (cpu): {plain:.1f} ms")
    print("| filter | PyTorch pre-pass ms | cpu selection ms | speed-up | cpu / plain forward |")
    print("|---|---|---|---|---|")
    for name, sampling in FILTERS.items():
        times = {"torch": [], "cpu": []}
        for order in (("torch", "cpu"), ("cpu", "torch")):  # interleaved, each order once
            for backend in order:
                times[backend].append(_ms(lambda b=backend: kept_thresholds(logits, LogitMap(), sampling, b),
                                          args.reps))
        pre, ours = statistics.median(times["torch"]), statistics.median(times["cpu"])
        print(f"| {name} | {pre:.0f} | {ours:.1f} | {pre / ours:.1f}x | {ours / plain:.2f}x |")


if __name__ == "__main__":
    main()
