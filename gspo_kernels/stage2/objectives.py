"""The policy term of each objective, per token: one small function each, one table.

Every function takes the same PolicyInputs (per-row `[N]` tensors, zero outside the response)
and returns a PolicyTerm: the per-token loss term (to be minimised, before any weighting or
aggregation) and the per-token flags that the clip metrics count. Formulas and sources are in
docs/semantics.md, "Objectives and corrections".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import GSPOConfig
from .segments import Segments


@dataclass(frozen=True)
class PolicyInputs:
    logp: torch.Tensor  # current log-probs, autograd-connected
    log_ratio: torch.Tensor  # logp - old, per token (unclamped)
    ratio: torch.Tensor  # the level's importance ratio per token (s_i, s_i,t or r_t)
    adv: torch.Tensor  # advantage per token
    mask: torch.Tensor  # bool response mask
    segments: Segments
    tokens_per_seq: torch.Tensor  # [S], float
    clamp_log_ratio: object  # callable: the configured log-ratio clamp
    length: torch.Tensor  # [S], tokens_per_seq clamped to >= 1 (the divisor of per-sequence means)
    n_tokens: torch.Tensor  # 0-d, the response tokens of the whole batch, >= 1


@dataclass(frozen=True)
class PolicyTerm:
    per_token: torch.Tensor
    clipped_low: torch.Tensor  # bool, counted by clip_frac_low
    clipped_high: torch.Tensor  # bool, counted by clip_frac_high


def _clip(cfg: GSPOConfig, x: PolicyInputs) -> PolicyTerm:
    """PPO/GSPO clip: -min(r A, clip(r, 1-eps_low, 1+eps_high) A), with TRL's two-sided cap
    (`delta` bounds the unclipped r) and verl's dual clip (`clip_ratio_c`: at most -c A for A < 0)."""
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    unclipped = x.ratio if cfg.delta is None else x.ratio.clamp(max=cfg.delta)
    term = -torch.minimum(unclipped * x.adv, x.ratio.clamp(lo, hi) * x.adv)
    if cfg.clip_ratio_c is not None:
        term = torch.where(x.adv < 0, torch.minimum(term, -cfg.clip_ratio_c * x.adv), term)
    ratio = x.ratio.detach()
    return PolicyTerm(term, (ratio < lo) & (x.adv < 0), (ratio > hi) & (x.adv > 0))


def _cispo(cfg: GSPOConfig, x: PolicyInputs) -> PolicyTerm:
    """CISPO (MiniMax-M1): -sg[clip(r, 1-eps_low, 1+eps_high)] A logp, so every token keeps a
    gradient; verl's form. TRL's (clip(r, max=epsilon_high)) is eps_low = 1 - 1e-9 and
    1 + eps_high = TRL's epsilon_high. Flags: the weight was clipped, whatever the sign of A."""
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    ratio = x.ratio.detach()
    return PolicyTerm(-ratio.clamp(lo, hi) * x.adv * x.logp, ratio < lo, ratio > hi)


def _sapo(cfg: GSPOConfig, x: PolicyInputs) -> PolicyTerm:
    """SAPO (Qwen): a soft gate for the hard clip, -sigmoid(tau (r - 1)) (4 / tau) A, with
    tau = sapo_tau_pos for A > 0 and sapo_tau_neg otherwise (TRL and verl alike). Never clips."""
    tau = torch.where(x.adv > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg).to(x.ratio.dtype)
    term = -torch.sigmoid(tau * (x.ratio - 1.0)) * (4.0 / tau) * x.adv
    never = torch.zeros_like(x.mask)
    return PolicyTerm(term, never, never)


def _gmpo(cfg: GSPOConfig, x: PolicyInputs) -> PolicyTerm:
    """GMPO (verl's geo_mean): each token's log-ratio clipped to [-eps_low, eps_high] on the
    pessimistic side of sign(A), then the sequence's geometric-mean ratio
    R_i = exp(mean_t clipped log-ratio) and the term -mean_t(A) R_i on each of its tokens.
    eps_low and eps_high are log-space bounds here (the paper: 0.4)."""
    seg = x.segments
    sign = torch.sign(x.adv)
    clamped = x.log_ratio.clamp(-cfg.eps_low, cfg.eps_high)
    pessimistic = sign * torch.minimum(sign * x.log_ratio, sign * clamped)
    length = x.length
    seq_ratio = torch.exp(x.clamp_log_ratio(seg.seq_sum(pessimistic) / length))
    seq_adv = seg.seq_sum(x.adv) / length
    term = torch.where(x.mask, seg.per_row(-seq_adv * seq_ratio), torch.zeros_like(x.adv))
    clipped = x.log_ratio.detach() != clamped.detach()
    return PolicyTerm(term, clipped & (x.adv < 0), clipped & (x.adv > 0))


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


def _vespo(cfg: GSPOConfig, x: PolicyInputs) -> PolicyTerm:
    """VESPO (TRL's vespo): -sg[phi(w)] A logp, w = exp(sum_t log-ratio) the sequence's product
    ratio (each token's log-ratio clamped to [-20, 20]) and phi the gamma weight of vespo_phi: a
    soft, asymmetric trust region in place of the clip. Never clips."""
    seg = x.segments
    log_w = seg.per_row(seg.seq_sum(x.log_ratio.detach().clamp(-20.0, 20.0)))
    phi = vespo_phi(log_w, x.adv, cfg.vespo_k_pos, cfg.vespo_lambda_pos, cfg.vespo_k_neg, cfg.vespo_lambda_neg)
    never = torch.zeros_like(x.mask)
    return PolicyTerm(-phi * x.adv * x.logp, never, never)


OBJECTIVES = {"clip": _clip, "cispo": _cispo, "sapo": _sapo, "gmpo": _gmpo, "vespo": _vespo}


def policy_term(cfg: GSPOConfig, x: PolicyInputs) -> PolicyTerm:
    return OBJECTIVES[cfg.objective](cfg, x)
