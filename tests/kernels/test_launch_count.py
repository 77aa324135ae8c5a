"""The loss launches the same number of kernels and ops whatever B, T and V are."""

from collections import Counter

import pytest

import gspo_kernels as gk
from gspo_kernels.bench.host import OpCounter
from gspo_kernels.testing.problems import ProblemSpec, make_problem

from conftest import BACKENDS, device_for


def _ops_of_one_step(backend, spec, packed):
    problem = make_problem(spec)
    if packed:
        problem = problem.to_packed()
    x = problem.logits.detach().clone().requires_grad_()
    args, kwargs = problem.loss_args(x)
    with OpCounter() as counter:
        loss, _ = gk.gspo_loss(*args, **kwargs, backend=backend, level="sequence", entropy_coef=0.01)
        loss.backward()
    return counter.ops


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_op_count_does_not_grow_with_problem_size(backend, packed):
    dev = device_for(backend)
    small = _ops_of_one_step(backend, ProblemSpec(batch=2, seq_len=3, vocab=70, device=dev), packed)
    large = _ops_of_one_step(backend, ProblemSpec(batch=7, seq_len=11, vocab=300, device=dev), packed)
    assert small == large


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton not installed, or not runnable here")
def test_triton_launches_two_kernels(monkeypatch):
    tb = gk.backends.triton_backend
    launches = Counter()

    class Counting:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            launches[self.name] += 1
            return self.kernel[grid]

    for name in ("token_stats_kernel", "logits_grad_kernel"):
        monkeypatch.setattr(tb.kernels, name, Counting(getattr(tb.kernels, name), name))
    dev = device_for("triton")
    for spec in (ProblemSpec(batch=2, seq_len=3, vocab=70, device=dev), ProblemSpec(batch=9, seq_len=20, vocab=300, device=dev)):
        launches.clear()
        _ops_of_one_step("triton", spec, packed=False)
        assert launches == {"token_stats_kernel": 1, "logits_grad_kernel": 1}
