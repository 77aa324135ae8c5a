"""What trl_timing.py and areal_timing.py share: a trainer step's median time and its peak memory
beyond the inputs, taken in the process that runs it, and the table they print.

Memory is the peak RSS (VmHWM, reset after a warm-up step) minus the RSS before the measured
step. The drivers start each child with MMAP_ENV: every block of 64 KiB or more is mapped on
allocation, so that freed memory leaves RSS (as gspo_kernels.bench.memory does)."""

from __future__ import annotations

import re
import statistics
import time

MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def measure_step(step, reps: int, settle=None) -> dict:
    """{"ms": the median of `reps` timed calls of step(), "peak_bytes"}, after a warm-up call;
    settle(), if given, runs before the memory baseline (freeing what the warm-up left)."""
    step()
    if settle is not None:
        settle()
    before = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    step()
    peak = (_rss_kib("VmHWM") - before) * 1024
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return {"ms": statistics.median(times), "peak_bytes": peak}


def print_table(heading: str, column: str, results: list[dict]) -> None:
    """heading, then a row per result: its `column`, median ms, peak MiB."""
    print(heading)
    print(f"| {column} | ms (median) | peak MiB beyond the inputs |\n|---|---|---|")
    for r in results:
        print(f"| {r[column]} | {r['ms']:.0f} | {r['peak_bytes'] / 2**20:.0f} |")
