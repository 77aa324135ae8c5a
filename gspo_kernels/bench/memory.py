"""Peak memory of one forward + backward beyond its inputs (the gradient counts: it is new).

GPU: torch.cuda.max_memory_allocated around the step, minus what was allocated before.
CPU: a fresh subprocess per measurement (probe.py; so one provider's freed memory cannot
hide another's), reading the kernel's peak-RSS counter (VmHWM), reset after a warm-up step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
