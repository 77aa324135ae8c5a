"""Finite extremes: logits far from 0 (entropy and log-probs keep their precision), log-ratios
past the clamp before exp, and rows of several kernel blocks where the running max, whole -inf
blocks and a non-finite value fall in different blocks."""

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.testing import reference

from conftest import BACKENDS, device_for
from loss_helpers import loss_and_grad, problem_for


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_logits_keep_entropy_accurate(backend, seed):
    """Logits far from zero: a naive lse - sum(p z) entropy would cancel catastrophically."""
    problem = problem_for(backend, seed, logit_std=1.0)
    logits = problem.logits.detach() + 3000.0
    _, metrics, _ = loss_and_grad(problem, backend, logits=logits)
    ref_entropy = reference.gspo_loss(*problem.loss_args(logits.double())[0], **problem.loss_args()[1])[1]["entropy"]
    err = (metrics["entropy"].double() - ref_entropy).abs().max().item()
    assert err < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_of_huge_logits_keep_their_precision(backend, seed):
    """logp = (z_y - max) - log(sum): the rounding of lse (ulp 1e-3 at 1e4) never enters."""
    device = device_for(backend)
    logits = torch.randn(4, 6, 50, device=device) * 3 + 1e4
    targets = torch.randint(0, 50, (4, 6), device=device)
    logp = gk.selective_log_softmax(logits, targets, backend=backend)
    ref = torch.log_softmax(logits.double(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert (logp.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_log_ratio_with_zero_advantage_stays_finite(backend, seed):
    """Log-ratios are clamped at 20 before exp: exp(200) * (A = 0) would otherwise be NaN."""
    problem = problem_for(backend, seed)
    problem.old_logprobs = torch.full_like(problem.old_logprobs, -200.0)
    problem.advantages = torch.zeros_like(problem.advantages)
    for level in ("sequence", "sequence_token", "token"):
        loss, _, grad = loss_and_grad(problem, backend, level=level)
        assert loss.item() == 0.0
        assert torch.isfinite(grad).all()


@pytest.mark.parametrize("case", ["random", "late_max_far_above", "first_block_minus_inf", "nan_late", "inf_late"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_long_rows_across_blocks(backend, case, seed):
    """Rows of several kernel blocks (CPU: 4096 logits; Triton: 4096 fp32) where the running
    max, -inf blocks and non-finite values fall in different blocks."""
    device = device_for(backend)
    vocab = 3 * 4096 + 5
    logits = torch.randn(3, vocab, device=device) * 2
    if case == "late_max_far_above":
        logits[:, -3] = 150.0  # leads every earlier block's max by far more than exp() can shift
    elif case == "first_block_minus_inf":
        logits[:, :4096] = float("-inf")
    elif case == "nan_late":
        logits[1, 9000] = float("nan")
    elif case == "inf_late":
        logits[1, 9000] = float("inf")
    targets = torch.tensor([5000, 9001, vocab - 3], device=device)
    leaf = logits.clone().requires_grad_()
    logp, entropy = gk.selective_log_softmax(leaf, targets, backend=backend, return_entropy=True)
    (logp.sum() + 0.5 * entropy.sum()).backward()
    ref_leaf = logits.double().requires_grad_()
    log_probs = torch.log_softmax(ref_leaf, -1)
    ref_logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    probs = log_probs.exp()
    ref_entropy = -(probs * torch.where(probs > 0, log_probs, torch.zeros_like(log_probs))).sum(-1)
    (ref_logp.sum() + 0.5 * ref_entropy.sum()).backward()
    bad = case in ("nan_late", "inf_late")
    good_rows = [0, 2] if bad else [0, 1, 2]
    if bad:
        assert torch.isnan(logp[1]) and torch.isnan(leaf.grad[1]).all()
    assert torch.allclose(logp[good_rows].double(), ref_logp[good_rows], rtol=1e-5, atol=1e-5)
    assert torch.allclose(entropy[good_rows].double(), ref_entropy[good_rows], rtol=1e-5, atol=1e-5)
    assert torch.allclose(leaf.grad[good_rows].double(), ref_leaf.grad[good_rows], rtol=1e-4, atol=1e-7)
