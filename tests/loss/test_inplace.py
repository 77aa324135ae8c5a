"""inplace=True: the gradient is written into the logits' own storage and flows on from there, a
second backward is refused, and where rows share memory (expand()ed or partly overlapping
as_strided rows) the result falls back to the out-of-place one."""

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.backends.layout import elements_disjoint

from conftest import BACKENDS, device_for
from loss_helpers import DTYPES, check_case, problem_for


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_gradient(backend, dtype, seed, small_blocks):
    problem = problem_for(backend, seed, dtype=dtype)
    check_case(problem, backend, inplace=True, entropy_coef=0.01)
    leaf = problem.logits.detach().clone().requires_grad_()
    logits = leaf * 1  # as in training, the logits are an intermediate (the lm_head's output)
    args, kwargs = problem.loss_args(logits)
    loss, _ = gk.gspo_loss(*args, **kwargs, backend=backend, inplace=True)
    loss.backward()
    # The gradient was written into the logits' own storage, and flowed on from there.
    assert torch.equal(logits.detach(), leaf.grad)
    assert not torch.equal(leaf.detach(), leaf.grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_second_backward_is_refused(backend, seed):
    problem = problem_for(backend, seed)
    logits = problem.logits.detach().clone().requires_grad_()
    args, kwargs = problem.loss_args(logits)
    loss, _ = gk.gspo_loss(*args, **kwargs, backend=backend, inplace=True)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace=True wrote the logits' gradient.*use inplace=False"):
        loss.backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_on_rows_that_share_memory_falls_back(backend, seed):
    """expand()ed logits: an in-place gradient would have rows overwrite each other."""
    device = device_for(backend)
    base = torch.randn(1, 5, 40, device=device)
    targets = torch.randint(0, 40, (3, 5), device=device)
    grads = []
    for inplace in (False, True):
        leaf = base.clone().requires_grad_()
        logits = (leaf * 1).expand(3, 5, 40)
        logp = gk.selective_log_softmax(logits, targets, backend=backend, inplace=inplace)
        (logp * torch.arange(15.0, device=device).reshape(3, 5)).sum().backward()
        grads.append(leaf.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_on_partly_overlapping_rows_falls_back(backend):
    """as_strided rows that share 15 of their 40 elements: an in-place gradient would have
    each row overwrite part of the next; the result must equal the out-of-place one."""
    device = device_for(backend)
    base = torch.randn(3 * 25 + 15, device=device)
    targets = torch.randint(0, 40, (3,), device=device)
    grads = []
    for inplace in (False, True):
        leaf = base.clone().requires_grad_()
        logits = (leaf * 1).as_strided((3, 40), (25, 1))
        logp, entropy = gk.selective_log_softmax(logits, targets, backend=backend, inplace=inplace,
                                                 return_entropy=True)
        (logp * torch.tensor([1.0, -2.0, 3.0], device=device) + 0.5 * entropy).sum().backward()
        grads.append(leaf.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_elements_disjoint_accepts_slices_and_refuses_overlap():
    full = torch.randn(4, 9, 32)
    assert elements_disjoint(full) and elements_disjoint(full[:, :-1]) and elements_disjoint(full[1:, 2:5])
    assert elements_disjoint(full[:, :, :16])
    assert elements_disjoint(torch.randn(0, 5))
    assert not elements_disjoint(full[:1].expand(3, 9, 32))
    assert not elements_disjoint(full.reshape(-1).as_strided((3, 32), (20, 1)))
    assert not elements_disjoint(full.reshape(-1).as_strided((2, 3, 32), (64, 32, 1)))  # batch overlaps rows
