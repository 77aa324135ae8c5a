"""The per-token KL penalty against a reference policy, with its derivative by the log-prob."""

from __future__ import annotations

import torch

from .kinks import clamp_with_slope


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str, clamp: float | None = None):
    """(estimate, d estimate / d logp) of KL(pi || pi_ref) per token from samples of pi
    (Schulman's k1, k2, k3).

    With `clamp` (verl's k3 habit, applied to every estimator): the log-ratio is clamped to
    [-20, 20] before k3's exp, and the estimate to [-clamp, clamp]; the derivative is 0 where a
    clamp holds, its bounds included (kinks.py)."""
    log_ratio = ref_logp - logp
    if estimator == "k1":
        kl, slope = -log_ratio, 1.0
    elif estimator == "k2":
        kl, slope = 0.5 * log_ratio.square(), -log_ratio
    else:
        # k3 = exp(lr) - 1 - lr, so d k3 / d logp = 1 - exp(lr) = -expm1(lr).
        passes = True
        if clamp is not None:
            log_ratio, passes = clamp_with_slope(log_ratio, -20.0, 20.0)
        excess = torch.expm1(log_ratio)
        kl, slope = excess - log_ratio, -excess
        if clamp is not None:
            slope = slope * passes
    if clamp is None:
        return kl, slope
    clamped, passes = clamp_with_slope(kl, -clamp, clamp)
    return clamped, slope * passes


def kl_slope_plus_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str, clamp: float | None = None):
    """d estimate / d logp + estimate, as the bias-corrected KL's gradient at a token level needs
    it (d(kl * r) / d logp = r * (d kl / d logp + kl) where d r / d logp = r), without the
    cancellation of k3's two exp(ref - logp) terms: float32 summed 1 - e^x and e^x - x - 1 at
    e^x ~ 1e13 into noise where the sum is -x. Where a clamp holds, the slope is 0 and the sum
    is the estimate."""
    kl, slope = kl_penalty(logp, ref_logp, estimator, clamp)
    if estimator != "k3":
        return slope + kl
    log_ratio = ref_logp - logp
    exact = -log_ratio  # (1 - e^x) + (e^x - x - 1), x = log_ratio
    if clamp is None:
        return exact
    return torch.where(slope != 0, exact, kl)
