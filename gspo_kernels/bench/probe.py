"""The child process of a CPU memory measurement (memory.cpu_peak_bytes): one provider's
forward + backward on one problem, its peak RSS beyond what it held before, as JSON.

    python -m gspo_kernels.bench.probe PROVIDER SHAPE DTYPE logits|linear
"""

from __future__ import annotations

import json
import re
import sys

import torch

from .linear import LINEAR_PROVIDERS, LinearShape, make_linear_problem
from .problem import DTYPES, Shape, make_bench_problem
from .providers import PROVIDERS


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def _probe(provider: str, shape: str, dtype: str, kind: str = "logits") -> None:
    """Child process: prints {"peak_bytes": ...} for one provider on one problem."""
    torch.manual_seed(0)
    if kind == "linear":
        problem = make_linear_problem(LinearShape.parse(shape), DTYPES[dtype], "cpu")
        step = LINEAR_PROVIDERS[provider].build(problem)
    else:
        problem = make_bench_problem(Shape.parse(shape), DTYPES[dtype], "cpu")
        step = PROVIDERS[provider].build(problem)
    step.run()
    step.clear_grads()
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    step.run()
    peak = _status_kib("VmHWM")
    print(json.dumps({"peak_bytes": (peak - before) * 1024}))


if __name__ == "__main__":
    _probe(*sys.argv[1:5])
