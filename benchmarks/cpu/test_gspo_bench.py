"""pytest-benchmark suite over the same providers as `python -m gspo_kernels bench`:

    pytest benchmarks/cpu --benchmark-only [--bench-shape 8x512x32768] [--bench-dtype bf16]

Each benchmark is one forward + backward of the GSPO loss; providers that cannot run here
are skipped with the reason.
"""

import pytest
import torch

from gspo_kernels.bench.providers import PROVIDERS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("name", [n for n in PROVIDERS if n != "reference"])
def test_forward_backward(benchmark, bench_problem, name):
    provider = PROVIDERS[name]
    reason = provider.unavailable(DEVICE)
    if reason:
        pytest.skip(reason)
    step = provider.build(bench_problem)

    def run():
        step.leaf.grad = None
        step.loss().backward()
        _sync()

    run()  # warm-up (compilation, autotuning)
    benchmark.extra_info.update(shape=str(bench_problem.shape), dtype=str(bench_problem.dtype), device=DEVICE)
    benchmark.pedantic(run, rounds=5, iterations=1)
    assert step.leaf.grad is not None and torch.isfinite(step.leaf.grad).all()
