"""Each option and input form of gspo_loss, on every backend, against the reference."""

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.testing.problems import ProblemSpec, make_problem
from gspo_kernels.testing.verify import relative_error, run_case

from conftest import BACKENDS, device_for

DTYPES = [torch.float32, torch.bfloat16]


def _spec(backend, seed, **kw):
    return ProblemSpec(device=device_for(backend), seed=seed, **kw)


def _check(problem, backend, **options):
    result = run_case(problem, backend, **options)
    assert result.passed, result.failures()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("level", ["sequence", "token"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_layout(backend, level, dtype, seed, small_blocks):
    problem = make_problem(_spec(backend, seed, dtype=dtype, empty_sequence=True)).to_packed()
    _check(problem, backend, level=level)


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_equals_padded(backend, loss_agg, seed, small_blocks):
    padded = make_problem(_spec(backend, seed, empty_sequence=True))
    packed = padded.to_packed()
    assert packed.logits.shape[0] < padded.logits.shape[0] * padded.logits.shape[1]  # really repacked
    horizon = padded.spec.seq_len
    results = []
    for problem in (padded, packed):
        logits = problem.logits.detach().clone().requires_grad_()
        args, kwargs = problem.loss_args(logits)
        loss, metrics = gk.gspo_loss(*args, **kwargs, backend=backend, loss_agg=loss_agg, max_len=horizon)
        loss.backward()
        mask = problem.mask.reshape(-1)
        grad_rows = logits.grad.reshape(-1, logits.shape[-1])[mask]
        results.append((loss, metrics["seq_ratio"], grad_rows))
    (loss_a, ratio_a, grad_a), (loss_b, ratio_b, grad_b) = results
    assert relative_error(loss_b, loss_a) < 1e-6
    assert relative_error(ratio_b, ratio_a) < 1e-6
    assert relative_error(grad_b, grad_a) < 1e-6


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_rows(backend, dtype, packed, seed, small_blocks):
    problem = make_problem(_spec(backend, seed, dtype=dtype, strided=True))
    if packed:
        problem = problem.to_packed()
    assert not problem.logits.is_contiguous()
    _check(problem, backend)


@pytest.mark.parametrize("temperature", [0.7, 1.6])
@pytest.mark.parametrize("backend", BACKENDS)
def test_temperature(backend, temperature, seed, small_blocks):
    problem = make_problem(_spec(backend, seed, temperature=temperature, with_ref=True))
    _check(problem, backend, beta=0.1, entropy_coef=0.01)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_penalty(backend, estimator, seed, small_blocks):
    problem = make_problem(_spec(backend, seed, with_ref=True))
    _check(problem, backend, beta=0.2, kl_estimator=estimator)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_metric_without_penalty(backend, seed):
    problem = make_problem(_spec(backend, seed, with_ref=True))
    _check(problem, backend, beta=0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("level", ["sequence", "sequence_token"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_entropy_bonus(backend, level, dtype, seed, small_blocks):
    problem = make_problem(_spec(backend, seed, dtype=dtype))
    _check(problem, backend, level=level, entropy_coef=0.05)


@pytest.mark.parametrize("level", ["sequence", "sequence_token", "token"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_on_policy_without_old_logprobs(backend, level, seed, small_blocks):
    problem = make_problem(_spec(backend, seed, empty_sequence=True))
    problem.old_logprobs = None
    result = run_case(problem, backend, level=level)
    assert result.passed, result.failures()
    assert result.errors["clip_frac"] == 0.0


@pytest.mark.parametrize("level", ["sequence", "sequence_token", "token"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_token_advantages(backend, level, seed, small_blocks):
    problem = make_problem(_spec(backend, seed, token_advantages=True))
    _check(problem, backend, level=level)
    _check(problem.to_packed(), backend, level=level)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_gradient(backend, dtype, seed, small_blocks):
    problem = make_problem(_spec(backend, seed, dtype=dtype))
    _check(problem, backend, inplace=True, entropy_coef=0.01)
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
    problem = make_problem(_spec(backend, seed))
    logits = problem.logits.detach().clone().requires_grad_()
    args, kwargs = problem.loss_args(logits)
    loss, _ = gk.gspo_loss(*args, **kwargs, backend=backend, inplace=True)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_token_sequences(backend, seed):
    problem = make_problem(_spec(backend, seed, seq_len=1, batch=4))
    _check(problem, backend)


@pytest.mark.parametrize("vocab", [1, 63, 64, 65, 4099])
@pytest.mark.parametrize("backend", BACKENDS)
def test_vocab_sizes(backend, vocab, seed):
    """Block edges, a single-entry vocab, and a vocab larger than one default block."""
    problem = make_problem(_spec(backend, seed, vocab=vocab, batch=3, seq_len=4))
    _check(problem, backend, entropy_coef=0.01)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["float", "tensor"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_normalizer(backend, as_tensor, loss_agg, seed):
    problem = make_problem(_spec(backend, seed))
    normalizer = 37.0
    if as_tensor:
        normalizer = torch.tensor(normalizer, device=problem.logits.device)
    _check(problem, backend, loss_agg=loss_agg, normalizer=normalizer)


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_form_matches_function(backend, seed):
    problem = make_problem(_spec(backend, seed, with_ref=True))
    args, kwargs = problem.loss_args()
    options = dict(level="sequence_token", beta=0.1, entropy_coef=0.01, backend=backend)
    module = gk.GSPOLoss(**options)
    loss_fn, _ = gk.gspo_loss(*args, **kwargs, **options)
    kwargs.pop("temperature")
    loss_mod, _ = gk.GSPOLoss(temperature=problem.spec.temperature, **options)(*args, **kwargs)
    assert torch.equal(loss_fn, loss_mod)
    assert "sequence_token" in repr(module)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_tokens_masked_gives_zero_loss_and_gradient(backend, seed):
    problem = make_problem(_spec(backend, seed))
    problem.mask = torch.zeros_like(problem.mask)
    logits = problem.logits.detach().clone().requires_grad_()
    args, kwargs = problem.loss_args(logits)
    loss, metrics = gk.gspo_loss(*args, **kwargs, backend=backend)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(logits.grad) == 0
    assert metrics["clip_frac"].item() == 0.0
