"""What a NaN does to the top-entropy selection: torch.quantile's rule (and so TRL's), a NaN
threshold when a response entropy is NaN, so that no token keeps its policy term; a NaN outside
the response changes nothing."""

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.sequence.corrections import quantile_of_masked


@pytest.mark.parametrize("q", [0.0, 0.2, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("nan_at", [None, 0, 5, 9])
def test_quantile_of_masked_is_torch_quantile(q, nan_at):
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(10, generator=gen, dtype=torch.float64)
    mask = torch.rand(10, generator=gen) > 0.3
    mask[0] = mask[5] = True
    mask[9] = False
    if nan_at is not None:
        values[nan_at] = float("nan")
    got = quantile_of_masked(values, mask, q)
    want = torch.quantile(values[mask], q)
    assert torch.isnan(got) == torch.isnan(want)
    if not torch.isnan(want):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)


def _policy_problem():
    gen = torch.Generator().manual_seed(4)
    logp = -torch.rand(2, 5, generator=gen, dtype=torch.float64) - 0.1
    old = logp + 0.01 * torch.randn(2, 5, generator=gen, dtype=torch.float64)
    entropy = torch.rand(2, 5, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False, False], [True, True, True, True, True]])
    return logp, old, entropy, mask


def test_a_nan_response_entropy_keeps_no_token():
    logp, old, entropy, mask = _policy_problem()
    entropy[1, 2] = float("nan")
    loss, metrics = gk.policy_loss(logp.requires_grad_(), old, torch.tensor([1.0, -1.0], dtype=torch.float64),
                                   mask=mask, entropy=entropy, top_entropy_quantile=0.5)
    assert metrics["entropy_kept_frac"].item() == 0.0
    loss.backward()
    assert torch.all(logp.grad == 0)


def test_a_nan_entropy_outside_the_response_changes_nothing():
    logp, old, entropy, mask = _policy_problem()
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    clean = gk.policy_loss(logp, old, adv, mask=mask, entropy=entropy, top_entropy_quantile=0.5)
    entropy[0, 4] = float("nan")
    dirty = gk.policy_loss(logp, old, adv, mask=mask, entropy=entropy, top_entropy_quantile=0.5)
    assert 0.0 < clean[1]["entropy_kept_frac"].item() < 1.0
    assert torch.equal(clean[0], dirty[0])
    assert torch.equal(clean[1]["entropy_kept_frac"], dirty[1]["entropy_kept_frac"])
