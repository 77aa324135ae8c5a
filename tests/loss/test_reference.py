"""The oracle itself, against numbers worked out by hand from the GSPO paper's formulas."""

import math

import pytest
import torch

from gspo_kernels.testing import reference


def _two_token_sequence():
    # Row 0: uniform over 3 entries, target 1 -> logp = -ln 3.
    # Row 1: logits [ln 2, 0, 0], target 0 -> p = 2/4 -> logp = -ln 2.
    logits = torch.tensor([[[0.0, 0.0, 0.0], [math.log(2.0), 0.0, 0.0]]], dtype=torch.float64)
    targets = torch.tensor([[1, 0]])
    logp = torch.tensor([[-math.log(3.0), -math.log(2.0)]], dtype=torch.float64)
    return logits, targets, logp


@pytest.mark.parametrize("mean_log_ratio, advantage, clipped", [
    (1e-3, 1.0, True), (1e-3, -1.0, False), (-1e-3, -1.0, True), (-1e-3, 1.0, False), (1e-4, 1.0, False),
])
def test_sequence_level_value_and_gradient(mean_log_ratio, advantage, clipped):
    logits, targets, logp = _two_token_sequence()
    # Token log-ratios 0.5e-3 + d and -0.5e-3 + d: mean d, as GSPO's length normalisation reads.
    old = logp - torch.tensor([[mean_log_ratio + 5e-4, mean_log_ratio - 5e-4]], dtype=torch.float64)
    x = logits.clone().requires_grad_()
    loss, metrics = reference.gspo_loss(x, targets, old.float().double(), torch.tensor([advantage]),
                                        eps_low=3e-4, eps_high=4e-4)
    loss.backward()
    s = math.exp(mean_log_ratio)
    s_clipped = min(max(s, 1 - 3e-4), 1 + 4e-4)
    assert loss.item() == pytest.approx(-min(s * advantage, s_clipped * advantage), rel=1e-6)
    assert metrics["seq_ratio"].item() == pytest.approx(s, rel=1e-6)
    assert metrics["clip_frac"].item() == (1.0 if clipped else 0.0)
    # Unclipped: dL/dlogp_t = -A s / |y| for each token, and dlogp/dz = onehot - softmax.
    probs = torch.softmax(logits, -1)[0]
    onehot = torch.nn.functional.one_hot(targets[0], 3).double()
    expected = 0.0 if clipped else -advantage * s / 2
    assert torch.allclose(x.grad[0], expected * (onehot - probs), atol=1e-9)


def test_aggregations_over_two_sequences():
    logits = torch.randn(2, 3, 5, dtype=torch.float64)
    targets = torch.randint(0, 5, (2, 3))
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    adv = torch.tensor([0.5, -2.0])
    # On-policy (ratio 1, never clipped): every token's term is -A of its sequence.
    cases = {
        "seq-mean-token-mean": (-0.5 + 2.0) / 2,
        "token-mean": (3 * -0.5 + 2.0) / 4,
        "seq-mean-token-sum": (3 * -0.5 + 2.0) / 2,
        "seq-mean-token-sum-norm": (3 * -0.5 + 2.0) / 2 / 3,
    }
    for agg, expected in cases.items():
        loss, _ = reference.gspo_loss(logits, targets, logp, adv, mask=mask, loss_agg=agg)
        assert loss.item() == pytest.approx(expected, rel=1e-9), agg
    loss, _ = reference.gspo_loss(logits, targets, logp, adv, mask=mask, loss_agg="token-mean", normalizer=8)
    assert loss.item() == pytest.approx((3 * -0.5 + 2.0) / 8, rel=1e-9)


def test_kl_estimators_and_entropy():
    logits = torch.randn(1, 2, 4, dtype=torch.float64)
    targets = torch.tensor([[0, 3]])
    log_probs = torch.log_softmax(logits, -1)
    logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref = logp - torch.tensor([[0.2, -0.1]], dtype=torch.float64)
    r = (ref - logp)[0]
    expected = {"k1": (-r).mean(), "k2": (0.5 * r**2).mean(), "k3": (r.exp() - 1 - r).mean()}
    for estimator, value in expected.items():
        _, metrics = reference.gspo_loss(logits, targets, logp, torch.tensor([1.0]), ref_logprobs=ref,
                                         kl_estimator=estimator)
        assert metrics["kl"].item() == pytest.approx(value.item(), rel=1e-9), estimator
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    assert torch.allclose(metrics["entropy"], entropy)


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_kl_metric_follows_the_bias_corrected_estimate(beta):
    """With use_bias_correction_kl the loss weights each token's k3 by its ratio, and so do TRL's
    and Liger's kl metrics: ours reads the same corrected mean (from the reference and from the
    kernels alike), not the raw k3 that a user would then compare against TRL's logs."""
    import gspo_kernels as gk

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 8, dtype=torch.float64, generator=gen)
    targets = torch.randint(0, 8, (2, 3), generator=gen)
    logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    old = logp + torch.tensor([[0.3, -0.2, 0.1], [-0.4, 0.2, 0.5]], dtype=torch.float64)
    ref = logp - torch.tensor([[1.5, -2.0, 0.7], [2.5, 0.1, -1.2]], dtype=torch.float64)
    gap = ref - logp
    k3 = gap.exp() - 1 - gap
    ratio = (logp - old).exp()  # token level
    want = (k3 * ratio).mean()
    assert abs(want - k3.mean()) > 0.1  # the two readings differ on this batch
    options = dict(level="token", ref_logprobs=ref, use_bias_correction_kl=True, beta=beta, eps_low=0.2, eps_high=0.2)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    _, metrics = reference.gspo_loss(logits, targets, old, adv, **options)
    assert metrics["kl"].item() == pytest.approx(want.item(), rel=1e-9)
    _, metrics = gk.gspo_loss(logits.clone(), targets, old, adv, backend="torch", **options)
    assert metrics["kl"].item() == pytest.approx(want.item(), rel=1e-6)
