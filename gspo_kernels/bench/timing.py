"""Median wall time of one mode of a Step, warm-up first.

On a GPU: CUDA events around each repetition, with the L2 cache flushed in between so a
repetition never reads logits a previous one left in cache. On a CPU: perf_counter.
Repetitions stop at `reps`, or earlier once `budget_s` is spent (after at least 3).
"""

from __future__ import annotations

import statistics
import time

import torch

from .problem import MODES  # noqa: F401  (read as timing.MODES)
from .providers import Step
_L2_FLUSH_BYTES = 256 << 20  # well above an H100/H200's 50 MB L2


class _Clock:
    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"
        self.flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device=device) if self.cuda else None

    def time_ms(self, fn, before=None) -> float:
        """fn's time; before (untimed) runs first."""
        if before is not None:
            before()
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        self.flush.zero_()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end)


def time_mode(step: Step, mode: str, device: str, reps: int = 10, warmup: int = 1, budget_s: float = 20.0) -> float:
    clock = _Clock(device)

    def forward():
        step.loss()

    def fwd_bwd():
        step.clear_grads()
        step.loss().backward()

    before = None
    if mode == "backward":
        # Each backward after a forward of its own (untimed): a loss whose gradients are formed
        # in forward and handed over once (the one-pass fused linear, inplace=True) has no second
        # backward to time.
        losses = []

        def before():
            step.clear_grads()
            losses[:] = [step.loss()]

        def run():
            losses.pop().backward()
    else:
        run = forward if mode == "forward" else fwd_bwd

    for _ in range(warmup):
        clock.time_ms(run, before)
    times: list[float] = []
    spent = time.perf_counter()
    while len(times) < reps and (len(times) < 3 or time.perf_counter() - spent < budget_s):
        times.append(clock.time_ms(run, before))
    step.clear_grads()
    return statistics.median(times)


def copy_bandwidth_gbs(device: str, nbytes: int = 1 << 30) -> float:
    """Measured copy bandwidth, read + write counted: the ceiling for a memory-bound kernel."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    clock = _Clock(device)
    for _ in range(3):  # touch the pages and settle the clocks before timing
        dst.copy_(src)
    ms = statistics.median(clock.time_ms(lambda: dst.copy_(src)) for _ in range(9))
    return 2 * nbytes / (ms * 1e-3) / 1e9
