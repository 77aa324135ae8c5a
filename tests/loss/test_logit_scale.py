"""logit_scale: the model's multiplier on its logits (Cohere's logit_scale, Granite's
1 / logits_scaling), taken inside the kernels as softmax(z * logit_scale / temperature), on
every backend, the fused-linear path (chunked and the tile kernels) and selective_log_softmax,
against the float64 reference that multiplies first and divides by the temperature after."""

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.testing.problems import ProblemSpec, make_problem
from gspo_kernels.testing.verify import linear_operands, run_case, run_linear_case

from conftest import BACKENDS, device_for

SCALES = [0.3, 4.0]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_matches_reference(backend, scale, dtype, packed, seed):
    spec = ProblemSpec(dtype=dtype, empty_sequence=True, vocab=300, device=device_for(backend), seed=seed,
                       temperature=0.7, logit_scale=scale)
    problem = make_problem(spec)
    problem = problem.to_packed() if packed else problem
    result = run_case(problem, backend, entropy_coef=0.01)
    assert result.passed, result.failures()


# The fused-linear products are float32 against a float64 reference: their rounding enters the
# softmax times logit_scale / temperature, so the largest multiplier here is 2 (at 5.7 the
# gradients' error reached 1.3e-5 on some seeds, over the 1e-5 limit, on this CPU).
@pytest.mark.parametrize("fused", [False, True], ids=["chunked", "tiles"])
@pytest.mark.parametrize("scale", [0.3, 2.0])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_matches_reference(backend, scale, fused, seed):
    if fused and (backend != "triton" or not gk.backends.tiles_available(torch.device(device_for(backend)))):
        pytest.skip("the tile kernels are Triton's")
    spec = ProblemSpec(batch=4, seq_len=7, vocab=37, with_ref=True, empty_sequence=True,
                       device=device_for(backend), seed=seed)
    problem = make_problem(spec)
    result = run_linear_case(problem, backend, linear_operands(problem, 24, seed), fused=fused, logit_scale=scale,
                             temperature=1.0, entropy_coef=0.01, max_len=spec.seq_len)
    assert result.passed, result.failures()


@pytest.mark.parametrize("backend", BACKENDS)
def test_selective_log_softmax_multiplies_before_the_temperature(backend):
    logits = torch.randn(3, 5, 40, device=device_for(backend))
    targets = torch.randint(0, 40, (3, 5), device=logits.device)
    logp, entropy = gk.selective_log_softmax(logits, targets, 0.7, True, backend=backend, logit_scale=0.25)
    want = torch.log_softmax(logits.double() * 0.25 / 0.7, -1)
    assert torch.allclose(logp.double(), want.gather(-1, targets[..., None])[..., 0], atol=1e-5)
    assert torch.allclose(entropy.double(), -(want.exp() * want).sum(-1), atol=1e-5)
    weight = torch.randn(40, 8, device=logits.device)
    hidden = torch.randn(3, 5, 8, device=logits.device)
    fused = gk.fused_linear_selective_log_softmax(hidden, weight, targets, temperature=0.7, logit_scale=0.25,
                                                  backend=backend)
    plain = gk.selective_log_softmax(hidden @ weight.T, targets, 0.7, backend=backend, logit_scale=0.25)
    assert torch.allclose(fused, plain, atol=1e-5)


def test_gradcheck_float64():
    logits = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (2, 3))
    assert torch.autograd.gradcheck(
        lambda z: gk.selective_log_softmax(z, targets, 0.9, True, backend="torch", logit_scale=2.5), (logits,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_scale_of_one_is_the_plain_result_bitwise(backend):
    problem = make_problem(ProblemSpec(vocab=300, device=device_for(backend), seed=3))
    results = []
    for options in ({}, {"logit_scale": 1.0}):
        leaf = problem.logits.detach().clone().requires_grad_()
        args, kwargs = problem.loss_args(leaf)
        loss, _ = gk.gspo_loss(*args, **kwargs, backend=backend, **options)
        loss.backward()
        results.append((loss.detach(), leaf.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("bad, error", [(0.0, ValueError), (-2.0, ValueError), (float("inf"), ValueError),
                                        (float("nan"), ValueError), ("2", TypeError), (True, TypeError)])
def test_bad_scales_are_refused_by_name(bad, error):
    with pytest.raises(error, match="logit_scale"):
        gk.GSPOConfig(logit_scale=bad)
    with pytest.raises(error, match="logit_scale"):
        gk.selective_log_softmax(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), logit_scale=bad)


def test_a_divisor_out_of_float_range_is_refused():
    with pytest.raises(ValueError, match="temperature / logit_scale"):
        gk.selective_log_softmax(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), 1e-300, logit_scale=1e300)
