"""Every objective's hand-written derivatives (sequence/objectives.py's table) against
torch.func.jacrev of its own value in float64: d value / d ratio with the log-probs held, and
d value / d logp with the ratio held. CISPO's and VESPO's weights are stop-gradient by definition
(their d_ratio is None): for them only d_logp is a derivative of the value. Values are drawn
away from the kinks (kinks.py's rule there is tested with the ties in test_semantic_regressions)."""

import dataclasses

import pytest
import torch

from gspo_kernels.config import GSPOConfig
from gspo_kernels.inputs.segments import Segments
from gspo_kernels.sequence.objectives import OBJECTIVES, OWN_LOG_RATIO, PolicyInputs, policy_term

# Each objective at options that reach all of its branches on the drawn ratios.
CONFIGS = {
    "clip": [GSPOConfig(objective="clip", eps_low=0.2, eps_high=0.28),
             GSPOConfig(objective="clip", eps_low=0.2, eps_high=0.28, delta=1.5, level="token"),
             GSPOConfig(objective="clip", eps_low=0.2, eps_high=0.28, clip_ratio_c=1.4, level="token")],
    "cispo": [GSPOConfig(objective="cispo", eps_low=0.2, eps_high=0.28, level="token")],
    "sapo": [GSPOConfig(objective="sapo", level="token")],
    "gmpo": [GSPOConfig(objective="gmpo", eps_low=0.4, eps_high=0.4)],
    "vespo": [GSPOConfig(objective="vespo", level="token")],
}
STOP_GRADIENT_WEIGHT = {"cispo", "vespo"}


def test_every_objective_is_covered():
    assert set(CONFIGS) == set(OBJECTIVES)


def _inputs(seed: int) -> tuple[PolicyInputs, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    batch, seq = 3, 7
    mask = torch.rand(batch, seq, generator=gen) < 0.8
    mask[:, 0] = True
    logp = torch.where(mask, -torch.rand(batch, seq, generator=gen, dtype=torch.float64) * 3, 0.0)
    # Log-ratios spread over [-0.9, 0.9]: inside and outside every clip range, never on a bound.
    log_ratio = torch.where(mask, (torch.rand(batch, seq, generator=gen, dtype=torch.float64) - 0.5) * 1.8, 0.0)
    adv = torch.where(mask, torch.randn(batch, seq, generator=gen, dtype=torch.float64), 0.0)
    segments = Segments.padded(batch, seq)
    length = segments.seq_sum(mask.to(torch.float64)).clamp(min=1)
    x = PolicyInputs(logp, log_ratio, adv, mask, segments, length, mask.sum().clamp(min=1), (-20.0, 20.0))
    return x, torch.exp(log_ratio)


def _diagonal(jacobian: torch.Tensor, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """(diagonal, the largest off-diagonal magnitude) of a `shape x shape` Jacobian."""
    flat = jacobian.reshape(shape.numel(), shape.numel())
    diag = flat.diagonal()
    return diag.reshape(shape), (flat - torch.diag(diag)).abs().max()


@pytest.mark.parametrize("objective", sorted(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_derivatives_match_jacrev(objective, seed):
    for cfg in CONFIGS[objective]:
        x, ratio = _inputs(seed)
        term = policy_term(cfg, x, ratio)
        where = f"{objective} {cfg.level} delta={cfg.delta} clip_ratio_c={cfg.clip_ratio_c}"
        by_logp = torch.func.jacrev(lambda lp: policy_term(cfg, dataclasses.replace(x, logp=lp), ratio).value)(x.logp)
        d_logp, off = _diagonal(by_logp, x.logp.shape)
        assert off == 0, where
        want = torch.zeros_like(d_logp) if term.d_logp is None else term.d_logp
        assert torch.allclose(d_logp, want, rtol=1e-12, atol=1e-14), where
        if objective in STOP_GRADIENT_WEIGHT:
            assert term.d_ratio is None, where
            continue
        by_ratio = torch.func.jacrev(lambda r: policy_term(cfg, x, r).value)(ratio)
        d_ratio, off = _diagonal(by_ratio, ratio.shape)
        assert off == 0, where
        want = torch.zeros_like(d_ratio) if term.d_ratio is None else torch.broadcast_to(term.d_ratio, ratio.shape)
        assert torch.allclose(d_ratio, want, rtol=1e-12, atol=1e-14), where


@pytest.mark.parametrize("objective", sorted(OWN_LOG_RATIO))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_an_objectives_own_log_ratio_and_its_slope_match_jacrev(objective, seed):
    """The log-ratio an objective builds its ratio on (GMPO's clipped one) and the derivative it
    states by the plain log-ratio."""
    cfg = CONFIGS[objective][0]
    x, _ = _inputs(seed)
    own = OWN_LOG_RATIO[objective]
    _, slope = own(cfg, x)
    jacobian = torch.func.jacrev(lambda lr: own(cfg, dataclasses.replace(x, log_ratio=lr))[0])(x.log_ratio)
    d_log_ratio, off = _diagonal(jacobian, x.log_ratio.shape)
    assert off == 0
    assert torch.equal(d_log_ratio, slope), (d_log_ratio, slope)
