"""NaN and inf values, out-of-range target ids, and packed sequences isolated from each other:
what the kernels give for them, on every backend, and that the float64 reference gives the same
(issue 11: some of these once came out silently wrong). A non-finite value or a bad id in the
response makes the loss and that row's gradient NaN; outside the response it is ignored."""

import math

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.testing import reference
from gspo_kernels.testing.problems import ProblemSpec, make_problem
from gspo_kernels.testing.verify import relative_error

from conftest import BACKENDS, device_for
from loss_helpers import loss_and_grad, problem_for, run_with_reference


# --- non-finite logits in a response row ------------------------------------------------------------

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
    (loss, _, grad), (ref_loss, _, ref_grad) = run_with_reference(backend, x, ids, old, adv, **kwargs)
    bad_row = grad.reshape(8, 50)[1]
    assert math.isnan(loss.item()) and math.isnan(ref_loss.item())
    assert torch.isnan(bad_row).all()
    assert torch.isnan(ref_grad.reshape(8, 50)[1]).all()  # the oracle says the same
    # The other sequence is untouched by the bad row, and matches the reference.
    other = grad.reshape(8, 50)[4:]
    assert torch.isfinite(other).all()
    assert relative_error(other, ref_grad.reshape(8, 50)[4:]) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_logit_in_a_response_row_is_not_hidden(backend, seed):
    problem = problem_for(backend, seed)
    logits = problem.logits.detach().clone()
    row = tuple(problem.mask.nonzero()[0].tolist())
    logits[row + (3,)] = float("nan")
    loss, metrics, grad = loss_and_grad(problem, backend, logits=logits, entropy_coef=0.01)
    assert math.isnan(loss.item())
    assert torch.isnan(metrics["token_logprobs"][row])
    assert torch.isnan(grad[row]).all()  # the whole row, as in the reference: no finite-looking gradient


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


@pytest.mark.parametrize("backend", BACKENDS)
def test_minus_inf_target_logit_with_sequence_token_level(backend, seed):
    problem = problem_for(backend, seed)
    logits = problem.logits.detach().clone()
    row = tuple(problem.mask.nonzero()[0].tolist())
    logits[row + (int(problem.target_ids[row]),)] = float("-inf")  # sampled token now has logp = -inf
    loss, metrics, grad = loss_and_grad(problem, backend, logits=logits, level="sequence_token")
    assert metrics["token_logprobs"][row] == float("-inf")
    assert math.isfinite(loss.item())
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_minus_inf_logits_mask_vocab_entries(backend, dtype, seed, small_blocks):
    """A -inf logit (a banned token) has probability 0: finite stats, zero gradient there."""
    problem = problem_for(backend, seed, dtype=dtype)
    logits = problem.logits.detach().clone()
    banned = torch.rand(logits.shape, device=logits.device) < 0.3
    banned.scatter_(-1, problem.target_ids.unsqueeze(-1), False)  # keep the sampled token
    logits[banned] = float("-inf")
    problem.logits_base, problem.view = logits, (Ellipsis,)
    args, kwargs = problem.loss_args()
    # Re-derive old log-probs for the new logits so the ratios stay near 1.
    true_logp = torch.log_softmax(logits.double(), -1).gather(-1, problem.target_ids.unsqueeze(-1)).squeeze(-1)
    problem.old_logprobs = torch.where(problem.mask, true_logp - 1e-3, problem.old_logprobs.double()).float()
    loss, metrics, grad = loss_and_grad(problem, backend, entropy_coef=0.05)
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


# --- non-finite rows outside the response -----------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_garbage_padding_rows_get_zero_gradient(backend, seed):
    """NaN or inf logits on rows outside the response must not reach the loss or gradient."""
    problem = problem_for(backend, seed)
    logits = problem.logits.detach().clone()
    outside = ~problem.mask
    logits[outside] = float("nan")
    logits[tuple(outside.nonzero()[0].tolist())] = float("inf")  # one whole row
    loss, _, grad = loss_and_grad(problem, backend, logits=logits, entropy_coef=0.01, level="sequence_token")
    assert math.isfinite(loss.item())
    assert torch.count_nonzero(grad[outside]) == 0
    assert torch.isfinite(grad).all()


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


# --- out-of-range target ids ------------------------------------------------------------------------

@pytest.mark.parametrize("bad_id", [-100, -1, 300, 10**9])
@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_target_outside_response_is_ignored(backend, bad_id, seed):
    problem = problem_for(backend, seed)
    outside = ~problem.mask
    assert outside.any()
    problem.target_ids = torch.where(outside, torch.full_like(problem.target_ids, bad_id), problem.target_ids)
    loss, metrics, grad = loss_and_grad(problem, backend, entropy_coef=0.01)
    ref_loss, _ = reference.gspo_loss(*problem.loss_args()[0], **problem.loss_args()[1], entropy_coef=0.01)
    assert math.isfinite(loss.item())
    assert relative_error(loss, ref_loss, floor=0.1) <= 1e-5  # the floor: see verify.run_case
    assert torch.isnan(metrics["token_logprobs"][outside]).all()  # said, not hidden
    assert torch.count_nonzero(grad[outside]) == 0
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_target_inside_response_makes_the_loss_nan(backend, seed):
    problem = problem_for(backend, seed)
    first = problem.mask.reshape(-1).nonzero()[0, 0]
    problem.target_ids.view(-1)[first] = problem.spec.vocab  # one past the end
    loss, metrics, _ = loss_and_grad(problem, backend)
    assert math.isnan(loss.item())
    assert math.isnan(metrics["token_logprobs"].view(-1)[first].item())


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_target_in_the_response_agrees_with_the_reference(backend, seed):
    """Loss NaN, and the row's gradient NaN, in the kernels and the oracle alike."""
    problem = make_problem(ProblemSpec(device=device_for(backend), seed=seed))
    first = tuple(problem.mask.nonzero()[0].tolist())
    problem.target_ids[first] = problem.spec.vocab
    args, kwargs = problem.loss_args()
    (loss, _, grad), (ref_loss, _, ref_grad) = run_with_reference(backend, *args, **kwargs)
    assert math.isnan(loss.item()) and math.isnan(ref_loss.item())
    assert torch.isnan(grad[first]).all() and torch.isnan(ref_grad[first]).all()


# --- packed sequences isolated from a neighbour's values --------------------------------------------

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
    (loss, metrics, grad), (ref_loss, ref_metrics, ref_grad) = run_with_reference(backend, x, ids, old, adv, cu_seqlens=cu)
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


# --- an infinite KL term ----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_infinite_kl_with_beta_zero_is_a_metric_only(backend, seed):
    problem = make_problem(ProblemSpec(device=device_for(backend), seed=seed, with_ref=True))
    first = tuple(problem.mask.nonzero()[0].tolist())
    problem.ref_logprobs[first] = float("-inf")  # k1 = logp - ref = +inf at one token
    args, kwargs = problem.loss_args()
    (loss, metrics, grad), (ref_loss, ref_metrics, ref_grad) = run_with_reference(
        backend, *args, **kwargs, beta=0.0, kl_estimator="k1")
    assert math.isfinite(ref_loss.item()) and math.isfinite(loss.item())
    assert relative_error(loss, ref_loss, floor=0.1) <= 1e-5
    assert relative_error(grad, ref_grad) <= 1e-5
    assert metrics["kl"].item() == math.inf and ref_metrics["kl"].item() == math.inf
