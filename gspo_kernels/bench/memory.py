"""Peak memory of one forward + backward beyond its inputs (the gradient counts: it is new).

GPU: torch.cuda.max_memory_allocated around the step, minus what was allocated before.
CPU: a fresh subprocess per measurement (so one provider's freed memory cannot hide
another's), reading the kernel's peak-RSS counter (VmHWM), reset after a warm-up step.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import torch

from .problem import DTYPES, Shape, make_bench_problem
from .providers import PROVIDERS, Step


def _run_step(step: Step) -> None:
    step.clear_grads()
    step.loss().backward()


def gpu_peak_bytes(step: Step) -> int:
    _run_step(step)  # warm-up: compilation, autotuning, workspace allocations
    step.clear_grads()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    _run_step(step)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def _probe(provider: str, shape: str, dtype: str, kind: str = "logits") -> None:
    """Child process: prints {"peak_bytes": ...} for one provider on one problem."""
    torch.manual_seed(0)
    if kind == "linear":
        from .linear import LINEAR_PROVIDERS, LinearShape, make_linear_problem

        problem = make_linear_problem(LinearShape.parse(shape), DTYPES[dtype], "cpu")
        step = LINEAR_PROVIDERS[provider].build(problem)
    else:
        problem = make_bench_problem(Shape.parse(shape), DTYPES[dtype], "cpu")
        step = PROVIDERS[provider].build(problem)
    _run_step(step)
    step.clear_grads()
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    _run_step(step)
    peak = _status_kib("VmHWM")
    print(json.dumps({"peak_bytes": (peak - before) * 1024}))


def cpu_peak_bytes(provider: str, shape, dtype: str, timeout_s: float = 900, kind: str = "logits") -> int:
    # A fixed mmap threshold: every block of 64 KiB or more is mapped on allocation and unmapped
    # on free, so RSS follows live memory (glibc's sliding threshold would otherwise recycle the
    # warm-up step's freed blocks from its heap, invisibly to VmHWM).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(
        [sys.executable, "-m", "gspo_kernels.bench.memory", provider, str(shape), dtype, kind],
        capture_output=True, text=True, timeout=timeout_s, env=env,
    )
    if out.returncode != 0:
        raise RuntimeError(f"memory probe failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]


if __name__ == "__main__":
    _probe(*sys.argv[1:5])
