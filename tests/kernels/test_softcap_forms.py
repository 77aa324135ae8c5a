"""The soft-cap's two forms of tanh in the CPU kernels: a polynomial where |x| < cap, one exp
beyond (csrc/cpu/logit_map_vec.h). A SIMD vector whose lanes all lie within the cap skips the
exp; the form is chosen per logit, so a logit maps alike whether its neighbours are within the
cap or not, and the results hold float64's on both sides of the seam.
"""

import math

import pytest
import torch

import gspo_kernels as gk

from conftest import BACKENDS, device_for

CAP = 30.0


def _float64_logp_entropy(logits, targets, cap):
    z = cap * torch.tanh(logits.double() / cap)
    logp_all = torch.log_softmax(z, dim=-1)
    p = logp_all.exp()
    entropy = -(p * torch.where(p > 0, logp_all, torch.zeros_like(logp_all))).sum(-1)
    return logp_all.gather(-1, targets[:, None])[:, 0], entropy


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_around_the_seam_match_float64(backend):
    """Rows whose logits lie within 10% of the cap on either side, rows all within it, and rows
    with every 16th logit past it (a lane of each AVX-512 vector, of every other AVX2 one);
    targets on both sides of the seam."""
    device = device_for(backend)
    gen = torch.Generator().manual_seed(3)
    vocab = 4099  # a scalar tail past the SIMD vectors
    near = CAP * (0.9 + 0.2 * torch.rand(16, vocab, generator=gen)) * torch.sign(torch.randn(16, vocab, generator=gen))
    within = CAP * 0.99 * (2 * torch.rand(16, vocab, generator=gen) - 1)
    mixed = within.clone()
    mixed[:, ::16] = 1.5 * CAP
    logits = torch.cat([near, within, mixed]).float()
    targets = torch.randint(0, vocab, (logits.shape[0],), generator=gen)
    logp, entropy = gk.selective_log_softmax(logits.to(device), targets.to(device), backend=backend,
                                             logit_softcap=CAP, return_entropy=True)
    ref_logp, ref_entropy = _float64_logp_entropy(logits, targets, CAP)
    logp_err = (logp.cpu().double() - ref_logp).abs().max().item()
    entropy_err = (entropy.cpu().double() - ref_entropy).abs().max().item()
    # z near 30 carries float32's 1.9e-6 spacing: torch's own float32 map is 6e-6 off here.
    assert logp_err <= 1e-5 and entropy_err <= 2e-6, (logp_err, entropy_err)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_finite_logit_on_either_side_of_the_seam_has_log_prob_zero(backend):
    """Every other logit -inf, which the soft-cap maps to -cap (a lane past the cap in every
    vector), at least 20 below the one left: their mass rounds away against its, so the row's
    log-sum-exp is that logit's z from its SIMD lane, and its log-prob, the target's z from the
    target's own map less that, is 0 only if both maps give the same float."""
    device = device_for(backend)
    vocab = 37
    values = torch.tensor([0.01, 0.5, 0.99, 0.999999, 1.0, 1.000001, 1.5, 9.0, -0.3]) * CAP
    rows = torch.full((len(values) * vocab, vocab), -math.inf)
    where = torch.arange(rows.shape[0]) % vocab
    rows[torch.arange(rows.shape[0]), where] = values.repeat_interleave(vocab)
    logp, entropy = gk.selective_log_softmax(rows.to(device), where.to(device), backend=backend, logit_softcap=CAP,
                                             return_entropy=True)
    assert (logp == 0).all().item()
    assert (entropy.abs() <= 1e-6).all().item()
