"""Regression tests for values that used to come out silently wrong (issue 11): non-finite
logits in a response row, packed sequences poisoning each other, in-place gradients over
partly overlapping rows, and the reference disagreeing with the kernels."""

import math

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.testing import reference
from gspo_kernels.backends.layout import elements_disjoint
from gspo_kernels.testing.problems import ProblemSpec, make_problem
from gspo_kernels.testing.verify import relative_error

from conftest import BACKENDS, device_for


def _grads(backend, logits, *args, reference_too=True, **kwargs):
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


@pytest.mark.parametrize("bad", ["nan", "plus_inf", "all_minus_inf"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_response_row_gives_a_nan_gradient_row(backend, packed, bad):
    """Default options: the upstream gradients of the bad row are 0, yet its gradient is NaN."""
    device = device_for(backend)
    x = torch.randn(2, 4, 50, device=device)
    if bad == "nan":
        x[0, 1, 3] = float("nan")
    elif bad == "plus_inf":
        x[0, 1, 3] = float("inf")
    else:
        x[0, 1] = float("-inf")
    ids = torch.randint(0, 50, (2, 4), device=device)
    old = torch.randn(2, 4, device=device) - 4
    adv = torch.tensor([1.0, -1.0], device=device)
    kwargs = {}
    if packed:
        x, ids, old = x.reshape(8, 50), ids.reshape(8), old.reshape(8)
        kwargs["cu_seqlens"] = torch.tensor([0, 4, 8], device=device)
    (loss, _, grad), (ref_loss, _, ref_grad) = _grads(backend, x, ids, old, adv, **kwargs)
    bad_row = grad.reshape(8, 50)[1]
    assert math.isnan(loss.item()) and math.isnan(ref_loss.item())
    assert torch.isnan(bad_row).all()
    assert torch.isnan(ref_grad.reshape(8, 50)[1]).all()  # the oracle says the same
    # The other sequence is untouched by the bad row, and matches the reference.
    other = grad.reshape(8, 50)[4:]
    assert torch.isfinite(other).all()
    assert relative_error(other, ref_grad.reshape(8, 50)[4:]) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_selective_log_softmax_row_mask_decides_padding(backend):
    """With a mask, rows outside it get zeros whatever they hold; without one, every row is in
    use and a bad row is NaN even where the upstream gradient is 0."""
    device = device_for(backend)
    x = torch.randn(3, 4, 30, device=device)
    ids = torch.randint(0, 30, (3, 4), device=device)
    mask = torch.ones(3, 4, dtype=torch.bool, device=device)
    mask[1, 2:] = False
    x[1, 2] = float("nan")
    ids[1, 3] = -100
    for use_mask in (True, False):
        leaf = x.clone().requires_grad_()
        logp = gk.selective_log_softmax(leaf, ids, backend=backend, mask=mask if use_mask else None)
        (torch.where(mask, logp, 0.0).sum()).backward()  # rows outside the mask: upstream 0
        if use_mask:
            assert torch.count_nonzero(leaf.grad[1, 2:]) == 0
            assert torch.isfinite(leaf.grad).all()
        else:
            assert torch.isnan(leaf.grad[1, 2:]).all()
            assert torch.isfinite(leaf.grad[0]).all() and torch.isfinite(leaf.grad[2]).all()


def _isolation_problem(device):
    x = torch.randn(7, 16)
    ids = torch.randint(0, 16, (7,))
    old = (torch.log_softmax(x.double(), -1).gather(-1, ids[:, None]).squeeze(-1) - 1e-3).float()
    return x.to(device), ids.to(device), old.to(device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_sequences_are_isolated_from_a_minus_inf_logprob(backend):
    """The issue's case: a -inf log-prob in sequence 0 must not reach sequence 1."""
    device = device_for(backend)
    x, ids, old = _isolation_problem(device)
    x[1, ids[1]] = float("-inf")
    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device=device)
    adv = torch.tensor([1.0, -1.0], device=device)
    (loss, metrics, grad), (ref_loss, ref_metrics, ref_grad) = _grads(backend, x, ids, old, adv, cu_seqlens=cu)
    assert math.isfinite(loss.item())
    assert relative_error(loss, ref_loss, floor=0.1) <= 1e-5
    assert relative_error(metrics["seq_ratio"], ref_metrics["seq_ratio"]) <= 1e-5
    assert torch.isfinite(grad).all()
    assert relative_error(grad[3:], ref_grad[3:]) <= 1e-5
    assert torch.count_nonzero(grad[3:]) > 0


@pytest.mark.parametrize("poison", ["inf", "nan", "huge"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_sequence_values_never_cross_boundaries(backend, poison):
    """A non-finite or huge per-token value in sequence 0 leaves every later sequence (an
    empty one included, ratio 1) exactly as it is without it."""
    device = device_for(backend)
    x, ids, old = _isolation_problem(device)
    cu = torch.tensor([0, 3, 3, 7], device=device)  # sequence 1 is empty
    adv = torch.tensor([1.0, 0.5, -1.0], device=device)
    clean_old = old.clone()
    old[1] = {"inf": float("inf"), "nan": float("nan"), "huge": -3e38}[poison]
    runs = []
    for old_logprobs in (old, clean_old):
        leaf = x.clone().requires_grad_()
        loss, metrics = gk.gspo_loss(leaf, ids, old_logprobs, adv, cu_seqlens=cu, backend=backend, level="token")
        loss.backward()
        runs.append((metrics, leaf.grad))
    (metrics, grad), (clean_metrics, clean_grad) = runs
    assert metrics["seq_ratio"][1].item() == 1.0
    assert torch.equal(metrics["seq_ratio"][1:], clean_metrics["seq_ratio"][1:])
    assert torch.isfinite(grad[3:]).all()
    assert torch.allclose(grad[3:], clean_grad[3:], rtol=1e-6, atol=0)


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


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_target_in_the_response_agrees_with_the_reference(backend, seed):
    """Loss NaN, and the row's gradient NaN, in the kernels and the oracle alike."""
    problem = make_problem(ProblemSpec(device=device_for(backend), seed=seed))
    first = tuple(problem.mask.nonzero()[0].tolist())
    problem.target_ids[first] = problem.spec.vocab
    args, kwargs = problem.loss_args()
    (loss, _, grad), (ref_loss, _, ref_grad) = _grads(backend, *args, **kwargs)
    assert math.isnan(loss.item()) and math.isnan(ref_loss.item())
    assert torch.isnan(grad[first]).all() and torch.isnan(ref_grad[first]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_infinite_kl_with_beta_zero_is_a_metric_only(backend, seed):
    problem = make_problem(ProblemSpec(device=device_for(backend), seed=seed, with_ref=True))
    first = tuple(problem.mask.nonzero()[0].tolist())
    problem.ref_logprobs[first] = float("-inf")  # k1 = logp - ref = +inf at one token
    args, kwargs = problem.loss_args()
    (loss, metrics, grad), (ref_loss, ref_metrics, ref_grad) = _grads(
        backend, *args, **kwargs, beta=0.0, kl_estimator="k1")
    assert math.isfinite(ref_loss.item()) and math.isfinite(loss.item())
    assert relative_error(loss, ref_loss, floor=0.1) <= 1e-5
    assert relative_error(grad, ref_grad) <= 1e-5
    assert metrics["kl"].item() == math.inf and ref_metrics["kl"].item() == math.inf
