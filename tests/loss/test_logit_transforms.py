"""The model's own logit transforms inside the kernels: logit_scale (Cohere's logit_scale,
Granite's 1 / logits_scaling) and logit_softcap (Gemma 2's final_logit_softcapping: y -> c *
tanh(y / c)), the softmax taken of softcap(logits * logit_scale) / temperature, on every
backend, the fused-linear path (chunked and the tile kernels) and selective_log_softmax,
against the float64 reference that applies them in that order."""

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.testing.problems import ProblemSpec, make_problem
from gspo_kernels.testing.verify import linear_operands, run_case, run_linear_case

from conftest import BACKENDS, device_for

# Problems' logits have a spread of 2: a cap of 1.5 saturates many of them, 30 (Gemma 2's) few.
TRANSFORMS = [dict(logit_scale=0.3), dict(logit_scale=4.0), dict(logit_softcap=1.5), dict(logit_softcap=30.0),
              dict(logit_scale=2.0, logit_softcap=3.0)]


def _id(transform):
    return ",".join(f"{k.removeprefix('logit_')}={v}" for k, v in transform.items())


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("transform", TRANSFORMS, ids=_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_matches_reference(backend, transform, dtype, packed, seed):
    spec = ProblemSpec(dtype=dtype, empty_sequence=True, vocab=300, device=device_for(backend), seed=seed,
                       temperature=0.7, **transform)
    problem = make_problem(spec)
    problem = problem.to_packed() if packed else problem
    result = run_case(problem, backend, entropy_coef=0.01)
    assert result.passed, result.failures()


# The fused-linear products are float32 against a float64 reference: their rounding enters the
# softmax times logit_scale / temperature, so the largest multiplier here is 2 (at 5.7 the
# gradients' error reached 1.3e-5 on some seeds, over the 1e-5 limit, on this CPU).
@pytest.mark.parametrize("fused", [False, True], ids=["chunked", "tiles"])
@pytest.mark.parametrize("transform", [dict(logit_scale=0.3), dict(logit_scale=2.0), dict(logit_softcap=1.5),
                                       dict(logit_scale=2.0, logit_softcap=3.0)], ids=_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_matches_reference(backend, transform, fused, seed):
    if fused and (backend != "triton" or not gk.backends.tiles_available(torch.device(device_for(backend)))):
        pytest.skip("the tile kernels are Triton's")
    spec = ProblemSpec(batch=4, seq_len=7, vocab=37, with_ref=True, empty_sequence=True,
                       device=device_for(backend), seed=seed)
    problem = make_problem(spec)
    result = run_linear_case(problem, backend, linear_operands(problem, 24, seed), fused=fused, temperature=1.0,
                             entropy_coef=0.01, max_len=spec.seq_len, **transform)
    assert result.passed, result.failures()


@pytest.mark.parametrize("transform", TRANSFORMS, ids=_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_selective_log_softmax_applies_scale_then_cap_then_temperature(backend, transform):
    logits = 3 * torch.randn(3, 5, 40, device=device_for(backend))
    logits[0, 0, 3], logits[1, 1, 4] = float("inf"), float("-inf")  # a soft-cap makes both finite
    targets = torch.randint(0, 40, (3, 5), device=logits.device)
    leaf = logits.clone().requires_grad_()
    logp, entropy = gk.selective_log_softmax(leaf, targets, 0.7, True, backend=backend, **transform)
    (logp.sum() + 0.3 * entropy.sum()).backward()
    ref = logits.double().requires_grad_()
    z = ref * transform.get("logit_scale", 1.0)
    if "logit_softcap" in transform:
        z = transform["logit_softcap"] * torch.tanh(z / transform["logit_softcap"])
    want = torch.log_softmax(z / 0.7, -1)
    want_logp = want.gather(-1, targets[..., None])[..., 0]
    want_entropy = -(want.exp() * torch.where(want.exp() > 0, want, torch.zeros_like(want))).sum(-1)
    (want_logp.sum() + 0.3 * want_entropy.sum()).backward()
    finite = torch.isfinite(want_logp)
    assert torch.equal(finite, torch.isfinite(logp))
    assert torch.allclose(logp.double()[finite], want_logp[finite], atol=2e-5)
    assert torch.allclose(entropy.double()[finite], want_entropy[finite], atol=2e-5)
    rows = finite[..., None].expand_as(ref)
    assert torch.allclose(leaf.grad.double()[rows], ref.grad[rows], atol=2e-5)
    weight = torch.randn(40, 8, device=logits.device)
    hidden = torch.randn(3, 5, 8, device=logits.device)
    fused = gk.fused_linear_selective_log_softmax(hidden, weight, targets, temperature=0.7, backend=backend,
                                                  **transform)
    plain = gk.selective_log_softmax(hidden @ weight.T, targets, 0.7, backend=backend, **transform)
    assert torch.allclose(fused, plain, atol=1e-5)


@pytest.mark.parametrize("transform", TRANSFORMS, ids=_id)
def test_gradcheck_float64(transform):
    logits = 2 * torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (2, 3))
    assert torch.autograd.gradcheck(
        lambda z: gk.selective_log_softmax(z, targets, 0.9, True, backend="torch", **transform), (logits,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_neither_transform_is_the_plain_result_bitwise(backend):
    problem = make_problem(ProblemSpec(vocab=300, device=device_for(backend), seed=3))
    results = []
    for options in ({}, {"logit_scale": 1.0, "logit_softcap": None}):
        leaf = problem.logits.detach().clone().requires_grad_()
        args, kwargs = problem.loss_args(leaf)
        loss, _ = gk.gspo_loss(*args, **kwargs, backend=backend, **options)
        loss.backward()
        results.append((loss.detach(), leaf.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("name", ["logit_scale", "logit_softcap"])
@pytest.mark.parametrize("bad, error", [(0.0, ValueError), (-2.0, ValueError), (float("inf"), ValueError),
                                        (float("nan"), ValueError), ("2", TypeError), (True, TypeError)])
def test_bad_values_are_refused_by_name(name, bad, error):
    with pytest.raises(error, match=name):
        gk.GSPOConfig(**{name: bad})
    with pytest.raises(error, match=name):
        gk.selective_log_softmax(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), **{name: bad})


@pytest.mark.parametrize("options, message", [(dict(temperature=1e-300, logit_scale=1e300), "temperature / logit_scale"),
                                              (dict(logit_scale=1e300, logit_softcap=1e-300), "logit_scale / logit_softcap"),
                                              (dict(temperature=1e-300, logit_softcap=1e300), "logit_softcap / temperature")])
def test_a_map_out_of_float_range_is_refused(options, message):
    temperature = options.pop("temperature", 1.0)
    with pytest.raises(ValueError, match=message):
        gk.selective_log_softmax(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), temperature, **options)
