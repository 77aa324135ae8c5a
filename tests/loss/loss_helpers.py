"""What the loss tests share: a problem on a backend's device, a case checked against the float64
reference, a backend's loss and gradient, and the same beside the reference's."""

import torch

import gspo_kernels as gk
from gspo_kernels.testing import reference
from gspo_kernels.testing.problems import ProblemSpec, make_problem
from gspo_kernels.testing.verify import run_case

from conftest import device_for

DTYPES = [torch.float32, torch.bfloat16]


def problem_for(backend, seed, **spec):
    return make_problem(ProblemSpec(device=device_for(backend), seed=seed, **spec))


def check_case(problem, backend, **options):
    result = run_case(problem, backend, **options)
    assert result.passed, result.failures()


def loss_and_grad(problem, backend, logits=None, **options):
    leaf = (problem.logits if logits is None else logits).detach().clone().requires_grad_()
    args, kwargs = problem.loss_args(leaf)
    loss, metrics = gk.gspo_loss(*args, **kwargs, backend=backend, **options)
    loss.backward()
    return loss, metrics, leaf.grad


def run_with_reference(backend, logits, *args, **kwargs):
    """(loss, metrics, grad) of the backend, and the same of the float64 reference."""
    leaf = logits.detach().clone().requires_grad_()
    loss, metrics = gk.gspo_loss(leaf, *args, backend=backend, **kwargs)
    loss.backward()
    ref_leaf = logits.detach().double().cpu().requires_grad_()
    cpu_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    cpu_kwargs = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    ref_loss, ref_metrics = reference.gspo_loss(ref_leaf, *cpu_args, **cpu_kwargs)
    ref_loss.backward()
    return (loss, metrics, leaf.grad.cpu()), (ref_loss, ref_metrics, ref_leaf.grad)
