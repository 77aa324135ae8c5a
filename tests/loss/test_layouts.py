"""The input forms of gspo_loss on every backend against the reference: packed sequences (an
empty one included), packed == padded, strided rows, T = 1, vocab sizes at the kernel block
edges, and every token masked."""

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.testing.verify import relative_error

from conftest import BACKENDS
from loss_helpers import DTYPES, check_case, problem_for


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("level", ["sequence", "token"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_layout(backend, level, dtype, seed, small_blocks):
    problem = problem_for(backend, seed, dtype=dtype, empty_sequence=True).to_packed()
    check_case(problem, backend, level=level)


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_equals_padded(backend, loss_agg, seed, small_blocks):
    padded = problem_for(backend, seed, empty_sequence=True)
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
    problem = problem_for(backend, seed, dtype=dtype, strided=True)
    if packed:
        problem = problem.to_packed()
    assert not problem.logits.is_contiguous()
    check_case(problem, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_token_sequences(backend, seed):
    problem = problem_for(backend, seed, seq_len=1, batch=4)
    check_case(problem, backend)


@pytest.mark.parametrize("vocab", [1, 63, 64, 65, 4099])
@pytest.mark.parametrize("backend", BACKENDS)
def test_vocab_sizes(backend, vocab, seed):
    """Block edges, a single-entry vocab, and a vocab larger than one default block."""
    problem = problem_for(backend, seed, vocab=vocab, batch=3, seq_len=4)
    check_case(problem, backend, entropy_coef=0.01)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_tokens_masked_gives_zero_loss_and_gradient(backend, seed):
    problem = problem_for(backend, seed)
    problem.mask = torch.zeros_like(problem.mask)
    logits = problem.logits.detach().clone().requires_grad_()
    args, kwargs = problem.loss_args(logits)
    loss, metrics = gk.gspo_loss(*args, **kwargs, backend=backend)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(logits.grad) == 0
    assert metrics["clip_frac"].item() == 0.0
