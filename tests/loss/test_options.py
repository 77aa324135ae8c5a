"""Each option of gspo_loss on every backend against the reference: temperature, the KL penalty
(each estimator) and the KL metric alone, the entropy bonus, old_logprobs=None, token
advantages, the normalizer, and the module form."""

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.testing.verify import run_case

from conftest import BACKENDS
from loss_helpers import DTYPES, check_case, problem_for


@pytest.mark.parametrize("temperature", [0.7, 1.6])
@pytest.mark.parametrize("backend", BACKENDS)
def test_temperature(backend, temperature, seed, small_blocks):
    problem = problem_for(backend, seed, temperature=temperature, with_ref=True)
    check_case(problem, backend, beta=0.1, entropy_coef=0.01)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_penalty(backend, estimator, seed, small_blocks):
    problem = problem_for(backend, seed, with_ref=True)
    check_case(problem, backend, beta=0.2, kl_estimator=estimator)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_metric_without_penalty(backend, seed):
    problem = problem_for(backend, seed, with_ref=True)
    check_case(problem, backend, beta=0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("level", ["sequence", "sequence_token"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_entropy_bonus(backend, level, dtype, seed, small_blocks):
    problem = problem_for(backend, seed, dtype=dtype)
    check_case(problem, backend, level=level, entropy_coef=0.05)


@pytest.mark.parametrize("level", ["sequence", "sequence_token", "token"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_on_policy_without_old_logprobs(backend, level, seed, small_blocks):
    problem = problem_for(backend, seed, empty_sequence=True)
    problem.old_logprobs = None
    result = run_case(problem, backend, level=level)
    assert result.passed, result.failures()
    assert result.errors["clip_frac"] == 0.0


@pytest.mark.parametrize("level", ["sequence", "sequence_token", "token"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_token_advantages(backend, level, seed, small_blocks):
    problem = problem_for(backend, seed, token_advantages=True)
    check_case(problem, backend, level=level)
    check_case(problem.to_packed(), backend, level=level)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["float", "tensor"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_normalizer(backend, as_tensor, loss_agg, seed):
    problem = problem_for(backend, seed)
    normalizer = 37.0
    if as_tensor:
        normalizer = torch.tensor(normalizer, device=problem.logits.device)
    check_case(problem, backend, loss_agg=loss_agg, normalizer=normalizer)


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_form_matches_function(backend, seed):
    problem = problem_for(backend, seed, with_ref=True)
    args, kwargs = problem.loss_args()
    options = dict(level="sequence_token", beta=0.1, entropy_coef=0.01, backend=backend)
    module = gk.GSPOLoss(**options)
    loss_fn, _ = gk.gspo_loss(*args, **kwargs, **options)
    kwargs.pop("temperature")
    loss_mod, _ = gk.GSPOLoss(temperature=problem.spec.temperature, **options)(*args, **kwargs)
    assert torch.equal(loss_fn, loss_mod)
    assert "sequence_token" in repr(module)
