"""The policy term of each objective, per token, with its derivatives: one small function each,
one table.

Every function takes the same PolicyInputs (per-token tensors, zero outside the response, all
detached) and the level's importance ratio, and returns a PolicyTerm: the per-token loss term
(to be minimised, before any weighting or aggregation), its partial derivatives with respect to
the ratio and to the token's own log-prob (None where one is identically zero), and the
per-token flags that the clip metrics count. gspo_objective.py chains the two back to the
log-probs: the ratio's through the level's pull (ratio.py), the log-prob's as it is. Formulas and sources are in docs/semantics.md, "Objectives and corrections".

Derivatives follow the rule of kinks.py at the kinks, which is autograd's for the same
formula: a clamp passes the gradient strictly inside its bounds, and a tie in a minimum or
maximum sends half to each branch. The clip's common tie, r strictly inside
[1 - eps_low, 1 + eps_high], adds up to the unclipped branch's slope of 1; r exactly on a bound
(an on-policy r = 1 with eps_low = 0) gets 1/2, the unclipped branch's half.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import GSPOConfig
from .kinks import at_either
from ..inputs.segments import Segments


@dataclass(frozen=True)
class PolicyInputs:
    logp: torch.Tensor  # current log-probs (zero outside the response)
    log_ratio: torch.Tensor  # logp - old (zero outside the response), unclamped
    adv: torch.Tensor  # advantage per token (zero outside the response)
    mask: torch.Tensor  # bool response mask, token shape
    segments: Segments
    length: torch.Tensor  # per sequence (Segments.seq_sum's shape), its response tokens clamped to >= 1
    n_tokens: torch.Tensor  # 0-d, the response tokens of the whole batch, >= 1
    log_ratio_bounds: tuple  # (low, high) of config.log_ratio_clamp, None for an open side


@dataclass(frozen=True)
class PolicyTerm:
    value: torch.Tensor
    d_ratio: torch.Tensor | None  # d value / d ratio (the level's ratio of the same token)
    d_logp: torch.Tensor | None  # d value / d logp of the same token, the ratio held fixed
    clipped_low: torch.Tensor  # bool, counted by clip_frac_low
    clipped_high: torch.Tensor  # bool, counted by clip_frac_high
    clipped: torch.Tensor | None = None  # clipped_low | clipped_high, where the objective has it at hand


def _clip(cfg: GSPOConfig, x: PolicyInputs, ratio: torch.Tensor) -> PolicyTerm:
    """PPO/GSPO clip: -min(r A, clip(r, 1-eps_low, 1+eps_high) A), with TRL's two-sided cap
    (`delta` bounds the unclipped r) and verl's dual clip (`clip_ratio_c`: at most -c A for A < 0)."""
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    clamped = ratio.clamp(lo, hi)
    unclipped = ratio if cfg.delta is None else ratio.clamp(max=cfg.delta)
    neg_adv = -x.adv
    # -min(u A, c A) = max(u (-A), c (-A)).
    by_unclipped, by_clipped = unclipped * neg_adv, clamped * neg_adv
    term = torch.maximum(by_unclipped, by_clipped)
    # The clipped branch wins strictly only with r outside the clip range, where the clamp's slope
    # is 0: r below it with A < 0, or above it with A > 0 (A is 0 outside the response, and a NaN
    # ratio compares False, so neither is counted). Elsewhere the unclipped branch wins or ties,
    # with the slope of u: 1, or past delta 0 (delta > 1 + eps_high, so never at a tie).
    clipped = by_clipped > by_unclipped
    negative = x.adv < 0
    if cfg.delta is None:
        low = clipped & negative
        flags = dict(clipped_low=low, clipped_high=clipped ^ low, clipped=clipped)
        unclipped_slope = neg_adv
    else:
        flags = dict(clipped_low=(ratio < lo) & negative, clipped_high=(ratio > hi) & (x.adv > 0))
        unclipped_slope = neg_adv * (ratio < cfg.delta)
    d_ratio = unclipped_slope.masked_fill(clipped, 0.0)
    # A tie exactly on a bound (never clipped there) gets half: the unclipped branch's slope of 1,
    # the clamp's 0 on its bound.
    d_ratio = torch.addcmul(d_ratio, d_ratio, at_either(ratio, lo, hi), value=-0.5)
    if cfg.clip_ratio_c is not None:
        floor = cfg.clip_ratio_c * neg_adv
        capped = negative & (term > floor)
        d_ratio = torch.where(negative & (term == floor), 0.5 * d_ratio, d_ratio.masked_fill(capped, 0.0))
        term = torch.where(capped, floor, term)
    return PolicyTerm(term, d_ratio, None, **flags)


def _cispo(cfg: GSPOConfig, x: PolicyInputs, ratio: torch.Tensor) -> PolicyTerm:
    """CISPO (MiniMax-M1): -sg[clip(r, 1-eps_low, 1+eps_high)] A logp, so every token keeps a
    gradient; verl's form. TRL's (clip(r, max=epsilon_high)) is eps_low = 1 - 1e-9 and
    1 + eps_high = TRL's epsilon_high. Flags: the weight was clipped, whatever the sign of A."""
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    weight = -ratio.clamp(lo, hi) * x.adv
    return PolicyTerm(weight * x.logp, None, weight, x.mask & (ratio < lo), x.mask & (ratio > hi))


def _sapo(cfg: GSPOConfig, x: PolicyInputs, ratio: torch.Tensor) -> PolicyTerm:
    """SAPO (Qwen): a soft gate for the hard clip, -sigmoid(tau (r - 1)) (4 / tau) A, with
    tau = sapo_tau_pos for A > 0 and sapo_tau_neg otherwise (TRL and verl alike). Never clips."""
    tau = torch.where(x.adv > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0))
    scaled_adv = (-4.0 * x.adv) / tau
    never = torch.zeros_like(x.mask)
    # d sigmoid(u) / du = s (1 - s), times du / dr = tau.
    return PolicyTerm(gate * scaled_adv, gate * (1.0 - gate) * tau * scaled_adv, None, never, never)


def gmpo_log_ratio(cfg: GSPOConfig, x: PolicyInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GMPO's per-token log-ratio, clipped to [-eps_low, eps_high] on the pessimistic side of
    sign(A), and its derivative by the unclipped one: 1 where it is the log-ratio itself, 1/2
    exactly on a bound (a tie of the minimum, the clamp passing nothing there), 0 where clipped
    or A = 0."""
    sign = torch.sign(x.adv)
    clamped = x.log_ratio.clamp(-cfg.eps_low, cfg.eps_high)
    pessimistic = sign * torch.minimum(sign * x.log_ratio, sign * clamped)
    slope = ((pessimistic == x.log_ratio) & (sign != 0)).to(x.log_ratio.dtype)
    return pessimistic, torch.where(at_either(x.log_ratio, -cfg.eps_low, cfg.eps_high), 0.5 * slope, slope)


def _gmpo(cfg: GSPOConfig, x: PolicyInputs, ratio: torch.Tensor) -> PolicyTerm:
    """GMPO (verl's geo_mean): the sequence's geometric-mean ratio R_i of gmpo_log_ratio (the
    level's ratio, built on it) and the term -mean_t(A) R_i on each of its tokens. eps_low and
    eps_high are log-space bounds here (the paper: 0.4)."""
    seg = x.segments
    # Zero outside the response, like every other objective's derivatives (stage 2 relies on it).
    seq_adv = torch.where(x.mask, -seg.per_row(seg.seq_sum(x.adv) / x.length), x.mask)
    # The log-ratio is 0 outside the response, inside [-eps_low, eps_high]: never changed there.
    # Two compares, not `!= clamp`: a NaN log-ratio fails both and is never counted as clipped.
    changed = (x.log_ratio < -cfg.eps_low) | (x.log_ratio > cfg.eps_high)
    return PolicyTerm(seq_adv * ratio, seq_adv, None, changed & (x.adv < 0), changed & (x.adv > 0))


# VESPO's bounds on log w (TRL's: log 1e-8 below, 20 above).
VESPO_LOG_W_MIN, VESPO_LOG_W_MAX = math.log(1e-8), 20.0


def vespo_phi(log_w, adv, k_pos: float, lambda_pos: float, k_neg: float, lambda_neg: float):
    """VESPO's gamma weight phi(w) = exp(lambda + k log w - lambda w) (so phi(1) = 1), with
    (k, lambda) = (k_pos, lambda_pos) where A >= 0, else the _neg pair; log w clamped to
    [log 1e-8, 20]; 0 where it is not finite. Shared with the TRL drop-in's metric."""
    log_w = log_w.clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)
    nonneg = adv >= 0
    k = torch.where(nonneg, k_pos, k_neg).to(log_w.dtype)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).to(log_w.dtype)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _vespo(cfg: GSPOConfig, x: PolicyInputs, ratio: torch.Tensor) -> PolicyTerm:
    """VESPO (TRL's vespo): -sg[phi(w)] A logp, w = exp(sum_t log-ratio) the sequence's product
    ratio (each token's log-ratio clamped to [-20, 20]) and phi the gamma weight of vespo_phi: a
    soft, asymmetric trust region in place of the clip. Never clips."""
    seg = x.segments
    log_w = seg.per_row(seg.seq_sum(x.log_ratio.clamp(-20.0, 20.0)))
    phi = vespo_phi(log_w, x.adv, cfg.vespo_k_pos, cfg.vespo_lambda_pos, cfg.vespo_k_neg, cfg.vespo_lambda_neg)
    weight = -phi * x.adv
    never = torch.zeros_like(x.mask)
    return PolicyTerm(weight * x.logp, None, weight, never, never)


OBJECTIVES = {"clip": _clip, "cispo": _cispo, "sapo": _sapo, "gmpo": _gmpo, "vespo": _vespo}
# The objectives whose ratio is built on a per-token log-ratio of their own (and its derivative by
# the plain one) instead of the level's: GMPO's clipped one. The others take the level's ratio.
OWN_LOG_RATIO = {"gmpo": gmpo_log_ratio}


def policy_term(cfg: GSPOConfig, x: PolicyInputs, ratio: torch.Tensor) -> PolicyTerm:
    return OBJECTIVES[cfg.objective](cfg, x, ratio)
