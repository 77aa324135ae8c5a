"""Precision of the token statistics against float64, and NaN/inf wherever they sit in a row.

The rows span several kernel blocks and their max may sit in any block: a kernel that takes a
block's exps below that block's max must not lose the entropy to cancellation.
"""

import math

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.testing.verify import STATS_LIMIT, token_stats_errors

from conftest import BACKENDS, device_for


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_logprob_and_entropy_within_float32_level(backend, dtype, seed):
    logp_err, entropy_err = token_stats_errors(backend, dtype, device_for(backend), seed=seed % 1000)
    assert logp_err <= STATS_LIMIT
    assert entropy_err <= STATS_LIMIT


# Vector lanes, the scalar tail, the first block, a later block below the running max, and a
# later block that raises it (the CPU kernel's correction pass): a NaN or +inf in any of them
# must turn the row's results NaN.
_POSITIONS = {"first": 0, "lane5": 5, "block1": 4096 + 17, "raising_block": 2 * 4096 + 33, "tail": 3 * 4096 + 2}


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("where", list(_POSITIONS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_logit_anywhere_makes_the_row_nan(backend, where, value, seed):
    device = device_for(backend)
    vocab = 3 * 4096 + 3
    logits = torch.randn(3, vocab, device=device)
    logits[:, 2 * 4096 + 40] = 9.0  # the third block raises the row's max
    logits[1, _POSITIONS[where]] = value
    targets = torch.tensor([1, 2, 3], device=device)
    leaf = logits.clone().requires_grad_()
    logp, entropy = gk.selective_log_softmax(leaf, targets, backend=backend, return_entropy=True)
    (logp.sum() + entropy.sum()).backward()
    assert math.isnan(logp[1].item()) and math.isnan(entropy[1].item())
    assert torch.isnan(leaf.grad[1]).all()
    assert torch.isfinite(logp[[0, 2]]).all() and torch.isfinite(entropy[[0, 2]]).all()
    assert torch.isfinite(leaf.grad[[0, 2]]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_with_one_finite_logit_has_entropy_zero_not_below(backend):
    """Every other logit -inf: the entropy is 0. The CPU kernels' polynomial exp gives e^0 a few
    ulp under 1; before the clamp in finish_stats such rows had entropies of about -1e-7 (the
    long fuzz found one in a loss's entropy mean)."""
    device = device_for(backend)
    vocab = 37
    rows = torch.full((64, vocab), -math.inf)
    where = torch.arange(64) % vocab
    rows[torch.arange(64), where] = torch.linspace(-30.0, 30.0, 64)
    for scale in (1.0, 0.3, 1 / 0.7):
        logp, entropy = gk.selective_log_softmax(rows.to(device), where.to(device), temperature=1 / scale,
                                                 backend=backend, return_entropy=True)
        assert (entropy >= 0).all(), entropy.min()
        assert entropy.abs().max() <= 1e-6 and logp.abs().max() <= 1e-6


def _float64_stats(x, targets, temperature=1.0):
    log_probs = torch.log_softmax(x.double().cpu() / temperature, -1)
    probs = log_probs.exp()
    entropy = -(probs * torch.where(probs > 0, log_probs, torch.zeros_like(log_probs))).sum(-1)
    return log_probs.gather(-1, targets.cpu()[:, None]).squeeze(-1), entropy


@pytest.mark.parametrize(
    "case", ["leading_minus_inf_block_far_below_zero", "near_constant_row", "single_logit_large_at_T3"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_adversarial_rows(backend, case):
    """Rows a review found wrong on the cpu kernel: an all -inf first block before logits near
    -200 (the row max became 0 and later blocks underflowed), a row of equal logits with one
    bump (long per-lane sums), and one huge logit at T = 3 (log-prob a rounding above 0)."""
    device = device_for(backend)
    temperature = 1.0
    if case == "leading_minus_inf_block_far_below_zero":
        x = torch.randn(2, 8192) - 200
        x[:, :4096] = float("-inf")
    elif case == "near_constant_row":
        x = torch.zeros(2, 4096)
        x[:, 7] = 5.0
    else:
        x, temperature = torch.tensor([[3000.1], [-2999.7]]), 3.0
    targets = torch.tensor([x.shape[1] - 1, max(x.shape[1] - 4089, 0)])  # the bump (7) where there is one
    logp, entropy = gk.selective_log_softmax(x.to(device), targets.to(device), temperature=temperature,
                                             return_entropy=True, backend=backend)
    ref_logp, ref_entropy = _float64_stats(x, targets, temperature)
    assert (logp.cpu() <= 0).all()
    assert (logp.double().cpu() - ref_logp).abs().max() <= STATS_LIMIT
    assert (entropy.double().cpu() - ref_entropy).abs().max() <= STATS_LIMIT


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_upstream_gradient_is_not_hidden_at_banned_tokens(backend, with_entropy):
    """A NaN upstream gradient (a NaN loss) makes the whole row NaN, -inf logits included."""
    device = device_for(backend)
    x = torch.randn(1, 8, device=device)
    x[0, :4] = float("-inf")
    leaf = x.clone().requires_grad_()
    logp, entropy = gk.selective_log_softmax(leaf, torch.tensor([5], device=device), return_entropy=True,
                                             backend=backend)
    upstream = logp * float("nan") + (entropy * float("nan") if with_entropy else 0)
    upstream.sum().backward()
    assert torch.isnan(leaf.grad).all()
