"""What the two trainer steps of parity.py share: the peak device memory of a step,
relative errors, log-ratios that stay clear of the clip boundaries, and the report a step's
process hands back to the driver (one JSON line after RESULT)."""

from __future__ import annotations

import json
import math

import torch

RESULT = "RESULT "
MiB = 2**20


class PeakMemory:
    """torch.cuda.max_memory_allocated over a block and how far it rose above what was allocated
    when the block began (the step's own working memory). On a CPU both stay None: the CPU run
    checks the numbers, not the memory. `mark()` takes the peak so far, for a block whose end
    allocates memory that is not the step's (a copy of the gradients, say)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.peak = self.step = None

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._before = torch.cuda.memory_allocated()
        return self

    def mark(self) -> None:
        if self.cuda and self.peak is None:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
            self.step = self.peak - self._before

    def __exit__(self, *exc) -> None:
        self.mark()

    def row(self, path: str) -> dict:
        def mib(n):
            return None if n is None else round(n / MiB, 1)

        return {"path": path, "peak_mib": mib(self.peak), "step_mib": mib(self.step)}


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error in norm, in float64."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).norm() / want.norm().clamp(min=1e-12))


def worst_grad(got: dict, want: dict) -> tuple[str, float]:
    """The parameter whose gradient differs most (relative, in norm) and that error; both sides
    must have gradients for the same parameters."""
    if got.keys() != want.keys() or not want:
        missing = sorted(set(want) ^ set(got))[:3]
        return f"parameters differ: {missing}", math.inf
    errors = {name: rel(got[name], want[name]) for name in want}
    name = max(errors, key=errors.get)
    return name, errors[name]


def shifted_old(current: torch.Tensor, mask: torch.Tensor, shifts: torch.Tensor, generator) -> torch.Tensor:
    """Old log-probs whose per-sequence mean log-ratio to `current` is exactly -shift per row
    (token noise of mean zero on top): with shifts of +-0.05 every sequence ratio is far outside
    GSPO's clip band (3e-4, 4e-4), so the drop-in's and the trainer's own log-probs, which differ
    by bf16 rounding, can never put a sequence on different sides of a clip boundary."""
    maskf = mask.float()
    noise = 0.05 * torch.randn(current.shape, generator=generator).to(current.device) * maskf
    noise = noise - (noise.sum(1, keepdim=True) / maskf.sum(1, keepdim=True).clamp(min=1)) * maskf
    return (current.float() + noise + shifts.to(current.device)[:, None]) * maskf


def report(result: dict) -> None:
    print(RESULT + json.dumps(result), flush=True)


def skipped(trainer: str, error: ImportError) -> dict:
    return {"trainer": trainer, "status": "skipped",
            "reason": f"cannot import {getattr(error, 'name', None) or error} ({error}); carry .whl "
                      "(benchmarks/gpu/wheels.sh)"}
