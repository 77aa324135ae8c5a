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
