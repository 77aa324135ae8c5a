"""What the kernels do with unusual values: out-of-range ids, -inf and NaN logits, padding."""

import math

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.testing import reference
from gspo_kernels.testing.problems import ProblemSpec, make_problem
from gspo_kernels.testing.verify import relative_error

from conftest import BACKENDS, device_for


def _problem(backend, seed, **kw):
    return make_problem(ProblemSpec(device=device_for(backend), seed=seed, **kw))


def _loss_and_grad(problem, backend, logits=None, **options):
    leaf = (problem.logits if logits is None else logits).detach().clone().requires_grad_()
    args, kwargs = problem.loss_args(leaf)
    loss, metrics = gk.gspo_loss(*args, **kwargs, backend=backend, **options)
    loss.backward()
    return loss, metrics, leaf.grad


@pytest.mark.parametrize("bad_id", [-100, -1, 300, 10**9])
@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_target_outside_response_is_ignored(backend, bad_id, seed):
    problem = _problem(backend, seed)
    outside = ~problem.mask
    assert outside.any()
    problem.target_ids = torch.where(outside, torch.full_like(problem.target_ids, bad_id), problem.target_ids)
    loss, metrics, grad = _loss_and_grad(problem, backend, entropy_coef=0.01)
    ref_loss, _ = reference.gspo_loss(*problem.loss_args()[0], **problem.loss_args()[1], entropy_coef=0.01)
    assert math.isfinite(loss.item())
    assert relative_error(loss, ref_loss, floor=0.1) <= 1e-5  # the floor: see verify.run_case
    assert torch.isnan(metrics["token_logprobs"][outside]).all()  # said, not hidden
    assert torch.count_nonzero(grad[outside]) == 0
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_target_inside_response_makes_the_loss_nan(backend, seed):
    problem = _problem(backend, seed)
    first = problem.mask.reshape(-1).nonzero()[0, 0]
    problem.target_ids.view(-1)[first] = problem.spec.vocab  # one past the end
    loss, metrics, _ = _loss_and_grad(problem, backend)
    assert math.isnan(loss.item())
    assert math.isnan(metrics["token_logprobs"].view(-1)[first].item())


@pytest.mark.parametrize("backend", BACKENDS)
def test_garbage_padding_rows_get_zero_gradient(backend, seed):
    """NaN or inf logits on rows outside the response must not reach the loss or gradient."""
    problem = _problem(backend, seed)
    logits = problem.logits.detach().clone()
    outside = ~problem.mask
    logits[outside] = float("nan")
    logits[tuple(outside.nonzero()[0].tolist())] = float("inf")  # one whole row
    loss, _, grad = _loss_and_grad(problem, backend, logits=logits, entropy_coef=0.01, level="sequence_token")
    assert math.isfinite(loss.item())
    assert torch.count_nonzero(grad[outside]) == 0
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_minus_inf_logits_mask_vocab_entries(backend, dtype, seed, small_blocks):
    """A -inf logit (a banned token) has probability 0: finite stats, zero gradient there."""
    problem = _problem(backend, seed, dtype=dtype)
    logits = problem.logits.detach().clone()
    banned = torch.rand(logits.shape, device=logits.device) < 0.3
    banned.scatter_(-1, problem.target_ids.unsqueeze(-1), False)  # keep the sampled token
    logits[banned] = float("-inf")
    problem.logits_base, problem.view = logits, (Ellipsis,)
    args, kwargs = problem.loss_args()
    # Re-derive old log-probs for the new logits so the ratios stay near 1.
    true_logp = torch.log_softmax(logits.double(), -1).gather(-1, problem.target_ids.unsqueeze(-1)).squeeze(-1)
    problem.old_logprobs = torch.where(problem.mask, true_logp - 1e-3, problem.old_logprobs.double()).float()
    loss, metrics, grad = _loss_and_grad(problem, backend, entropy_coef=0.05)
    ref_leaf = logits.double().requires_grad_()
    args, kwargs = problem.loss_args(ref_leaf)
    ref_loss, ref_metrics = reference.gspo_loss(*args, **kwargs, entropy_coef=0.05)
    ref_loss.backward()
    assert torch.isfinite(metrics["entropy"]).all()
    assert torch.allclose(metrics["entropy"].double(), ref_metrics["entropy"], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(grad).all()
    assert torch.count_nonzero(grad[banned]) == 0
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (grad.double() - ref_leaf.grad).norm() <= tol * ref_leaf.grad.norm()


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_logits_keep_entropy_accurate(backend, seed):
    """Logits far from zero: a naive lse - sum(p z) entropy would cancel catastrophically."""
    problem = _problem(backend, seed, logit_scale=1.0)
    logits = problem.logits.detach() + 3000.0
    _, metrics, _ = _loss_and_grad(problem, backend, logits=logits)
    ref_entropy = reference.gspo_loss(*problem.loss_args(logits.double())[0], **problem.loss_args()[1])[1]["entropy"]
    err = (metrics["entropy"].double() - ref_entropy).abs().max().item()
    assert err < 1e-4


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
def test_nan_logit_in_a_response_row_is_not_hidden(backend, seed):
    problem = _problem(backend, seed)
    logits = problem.logits.detach().clone()
    row = tuple(problem.mask.nonzero()[0].tolist())
    logits[row + (3,)] = float("nan")
    loss, metrics, grad = _loss_and_grad(problem, backend, logits=logits, entropy_coef=0.01)
    assert math.isnan(loss.item())
    assert torch.isnan(metrics["token_logprobs"][row])
    assert torch.isnan(grad[row]).all()  # the whole row, as in the reference: no finite-looking gradient


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_log_ratio_with_zero_advantage_stays_finite(backend, seed):
    """Log-ratios are clamped at 20 before exp: exp(200) * (A = 0) would otherwise be NaN."""
    problem = _problem(backend, seed)
    problem.old_logprobs = torch.full_like(problem.old_logprobs, -200.0)
    problem.advantages = torch.zeros_like(problem.advantages)
    for level in ("sequence", "sequence_token", "token"):
        loss, _, grad = _loss_and_grad(problem, backend, level=level)
        assert loss.item() == 0.0
        assert torch.isfinite(grad).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_minus_inf_target_logit_with_sequence_token_level(backend, seed):
    problem = _problem(backend, seed)
    logits = problem.logits.detach().clone()
    row = tuple(problem.mask.nonzero()[0].tolist())
    logits[row + (int(problem.target_ids[row]),)] = float("-inf")  # sampled token now has logp = -inf
    loss, metrics, grad = _loss_and_grad(problem, backend, logits=logits, level="sequence_token")
    assert metrics["token_logprobs"][row] == float("-inf")
    assert math.isfinite(loss.item())
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_of_huge_logits_keep_their_precision(backend, seed):
    """logp = (z_y - max) - log(sum): the rounding of lse (ulp 1e-3 at 1e4) never enters."""
    device = device_for(backend)
    logits = torch.randn(4, 6, 50, device=device) * 3 + 1e4
    targets = torch.randint(0, 50, (4, 6), device=device)
    logp = gk.selective_log_softmax(logits, targets, backend=backend)
    ref = torch.log_softmax(logits.double(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert (logp.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("fill", [float("-inf"), float("inf")], ids=["all-minus-inf", "plus-inf"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_without_a_finite_softmax_get_nan_gradients(backend, fill, seed):
    """All -inf (no distribution) or a +inf logit: NaN, as the reference gives, never a finite value."""
    device = device_for(backend)
    logits = torch.randn(2, 3, 70, device=device)
    if fill == float("inf"):
        logits[0, 1, 5] = fill
    else:
        logits[0, 1] = fill
    leaf = logits.clone().requires_grad_()
    logp, entropy = gk.selective_log_softmax(leaf, torch.randint(0, 70, (2, 3), device=device), backend=backend,
                                             return_entropy=True)
    (logp.sum() + entropy.sum()).backward()  # upstream gradient 1 everywhere, NaN values or not
    assert torch.isnan(logp[0, 1])
    assert torch.isnan(leaf.grad[0, 1]).all()
    assert torch.isfinite(leaf.grad[1]).all() and torch.isfinite(leaf.grad[0, 0]).all()


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
