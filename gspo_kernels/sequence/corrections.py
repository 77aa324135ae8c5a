"""What scales or selects the policy term before aggregation, all detached and sync-free:
importance weights from the sampler's log-probs (rollout correction), top-entropy token
selection, and off-policy sequence masking."""

from __future__ import annotations

import torch

from ..config import GSPOConfig
from .objectives import PolicyInputs
from ..inputs.segments import Segments


def apply(cfg: GSPOConfig, x: PolicyInputs, old, rollout, entropy, entropy_threshold):
    """The detached per-token weight of the policy term that the configured corrections give
    (None when none is configured), and their metrics: the rollout weights, times 0 where
    token selection drops a token (response-only inputs of the token shape)."""
    metrics = {}
    if cfg.rollout_correction is None and cfg.top_entropy_quantile >= 1.0 and cfg.off_policy_mask_threshold is None:
        return None, metrics
    weight = None

    def response_mean(values):
        return (x.segments.total(values.to(x.log_ratio.dtype)) / x.n_tokens).float()

    def times(keep):
        return keep if weight is None else torch.where(keep, weight, 0.0)

    if cfg.rollout_correction is not None:
        weights, rejected = rollout_weights(cfg, x.segments, x.mask, x.length, old, rollout)
        weight = torch.where(x.mask, weights, 0.0)
        metrics["rollout_is_mean"] = response_mean(weight)
        metrics["rollout_is_max"] = x.segments.max(weight).float()
        metrics["rollout_masked_frac"] = response_mean(rejected)
    if cfg.top_entropy_quantile < 1.0:
        kept = high_entropy_tokens(cfg, entropy, x.mask, entropy_threshold)
        weight = times(kept)
        metrics["entropy_kept_frac"] = response_mean(kept)
    if cfg.off_policy_mask_threshold is not None:
        behaviour = old if rollout is None else rollout
        kept = on_policy_sequences(cfg, x.segments, x.mask, x.length, x.logp, behaviour, x.adv)
        weight = times(kept)
        metrics["off_policy_masked_frac"] = response_mean(x.mask & ~kept)
    return weight, metrics


def rollout_weights(cfg: GSPOConfig, seg: Segments, mask, length, old, rollout):
    """Per-token weights w = pi_old / pi_rollout (detached), truncated into [min, max] or set
    to 0 outside it (mask modes). Sequence modes put one weight on every token of a sequence:
    the geometric mean exp(mean_t (old_t - rollout_t)), or with rollout_sequence_weight=
    "product" the whole sequence's ratio exp(sum_t ...), as TRL and verl do. A NaN rollout
    log-prob (a token the sampler could not score) counts as no correction, as TRL does."""
    diff = torch.where(mask, torch.nan_to_num(old - rollout, nan=0.0), 0.0)
    if cfg.rollout_correction.startswith("sequence"):
        total = seg.seq_sum(diff)
        if cfg.rollout_sequence_weight == "geometric-mean":
            total = total / length
        diff = seg.per_row(total)
    weights = torch.exp(diff)
    low = 0.0 if cfg.rollout_is_min is None else cfg.rollout_is_min
    high = float("inf") if cfg.rollout_is_max is None else cfg.rollout_is_max
    if cfg.rollout_correction.endswith("truncate"):
        return weights.clamp(low, high), torch.zeros_like(mask)
    outside = mask & ((weights < low) | (weights > high))
    return torch.where(outside, torch.zeros_like(weights), weights), outside


def quantile_of_masked(values: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor:
    """torch.quantile(values[mask], q) (linear interpolation), without the host sync that
    boolean indexing costs: masked-out entries sort to the end and the rank is a tensor. NaN
    when a masked-in value is NaN, as torch.quantile (and so TRL's top-entropy mask): sort puts
    NaN after +inf, so the last entry tells."""
    values, mask = values.reshape(-1), mask.reshape(-1)
    if values.numel() == 0:
        return values.new_full((), float("inf"))
    ordered = torch.sort(torch.where(mask, values, float("inf"))).values
    count = mask.sum().to(values.dtype)
    rank = (count - 1).clamp(min=0) * q
    below = rank.floor()
    # gather with index tensors: indexing by a 0-d tensor would read it on the host.
    lo = ordered.gather(0, below.long().reshape(1)).squeeze(0)
    hi = ordered.gather(0, rank.ceil().long().reshape(1)).squeeze(0)
    value = lo + (hi - lo) * (rank - below)
    return torch.where(torch.isnan(ordered[-1]), ordered[-1], value)


def high_entropy_tokens(cfg: GSPOConfig, entropy, mask, threshold=None):
    """Tokens whose entropy is at or above the (1 - top_entropy_quantile) quantile of the
    response tokens' entropies: this call's tokens, unless `threshold` (a 0-d tensor, e.g. the
    quantile over every rank's tokens) is given."""
    if threshold is None:
        threshold = quantile_of_masked(entropy, mask, 1.0 - cfg.top_entropy_quantile)
    return mask & (entropy >= threshold)


def on_policy_sequences(cfg: GSPOConfig, seg: Segments, mask, length, logp, behaviour, adv):
    """DeepSeek-V3.2's off-policy sequence mask (TRL's off_policy_mask_threshold): a token is
    kept unless its advantage is negative and its sequence's mean of behaviour - logp (a KL
    estimate of how far the sampler was from the current policy) exceeds the threshold."""
    gap = torch.where(mask, torch.nan_to_num(behaviour - logp, nan=0.0), 0.0)
    seq_gap = seg.per_row(seg.seq_sum(gap) / length)
    return (adv >= 0) | (seq_gap <= cfg.off_policy_mask_threshold)
