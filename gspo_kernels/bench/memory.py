"""Peak memory of one forward + backward beyond its inputs (the gradient counts: it is new).

GPU: torch.cuda.max_memory_allocated around the step, minus what was allocated before.
CPU: a fresh subprocess per measurement (probe.py; so one provider's freed memory cannot
hide another's), reading the kernel's peak-RSS counter (VmHWM), reset after a warm-up step. Each
is a CpuProbe that the suite runs after its timings, PROBES_AT_ONCE at a time: a child's VmHWM is
its own, and most of a probe's time is its start (torch's import, the problem), 4-6 s each on a
2-core Xeon against a few seconds of timings per contender.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from .providers import Step


def gpu_peak_bytes(step: Step) -> int:
    step.run()  # warm-up: compilation, autotuning, workspace allocations
    step.clear_grads()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step.run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def cpu_peak_bytes(provider: str, shape, dtype: str, timeout_s: float = 900, kind: str = "logits") -> int:
    # A fixed mmap threshold: every block of 64 KiB or more is mapped on allocation and unmapped
    # on free, so RSS follows live memory (glibc's sliding threshold would otherwise recycle the
    # warm-up step's freed blocks from its heap, invisibly to VmHWM).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(
        [sys.executable, "-m", "gspo_kernels.bench.probe", provider, str(shape), dtype, kind],
        capture_output=True, text=True, timeout=timeout_s, env=env,
    )
    if out.returncode != 0:
        raise RuntimeError(f"memory probe failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]


PROBES_AT_ONCE = 2


@dataclass(frozen=True)
class CpuProbe:
    """One CPU memory measurement, run later (run_probes): cpu_peak_bytes less `minus`, the bytes
    of what the contender returns (fused linear's d hidden and d weight are not its overhead)."""

    provider: str
    shape: object
    dtype: str
    kind: str = "logits"
    minus: int = 0

    def run(self) -> int:
        return cpu_peak_bytes(self.provider, self.shape, self.dtype, kind=self.kind) - self.minus


def run_probes(probes: list[CpuProbe], done: Callable[[CpuProbe], None]) -> list[int | Exception]:
    """Each probe's bytes (or the exception it raised), in order, PROBES_AT_ONCE at a time;
    done(probe) as each finishes, one call at a time."""
    lock = threading.Lock()

    def one(probe: CpuProbe) -> int | Exception:
        try:
            return probe.run()
        except Exception as exc:  # one failing probe must not lose the others' results
            return exc
        finally:
            with lock:
                done(probe)

    with ThreadPoolExecutor(PROBES_AT_ONCE) as pool:
        return list(pool.map(one, probes))
