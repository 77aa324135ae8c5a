"""The importance ratio of each level, and how a gradient with respect to it reaches the log-probs.

    token           r_t = exp(clamp(lr_t))                          dr_t / dlogp_t = r_t
    sequence        s_i = exp(clamp(sum_t lr_t / |y_i|)), r_t = s_i  ds_i / dlogp_t = s_i / |y_i|
    sequence_token  value s_i, gradient of exp(logp_t - sg[logp_t])  dr_t / dlogp_t = r_t

with lr the response-masked log-ratio logp - old, and clamp the configured log_ratio_clamp
(whose gradient is 0 on and outside its bounds, kinks.py: a clamped ratio no longer follows
logp). The
sequence level may be built on another per-token log-ratio with its own derivative (GMPO's
pessimistically clipped one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kinks import clamp_with_slope
from .objectives import PolicyInputs


def _clamped_value(x: torch.Tensor, bounds) -> torch.Tensor:
    low, high = bounds
    return x if low is None and high is None else x.clamp(min=low, max=high)


def _where_passes(slope: torch.Tensor, passes) -> torch.Tensor:
    return slope if passes is True else slope * passes


@dataclass(frozen=True)
class ImportanceRatio:
    value: torch.Tensor  # per token (broadcastable to the token shape)
    seq_ratio: torch.Tensor  # s_i per sequence (seq_sum's shape), reported as a metric at every level
    slope: torch.Tensor  # token levels: dr_t / dlogp_t; sequence: ds_i / d(sum_t lr_t), per sequence
    token_slope: torch.Tensor | bool = True  # sequence level: d lr_t / d logp_t (GMPO's clip)
    per_sequence: bool = False

    def pull(self, x: PolicyInputs, d_ratio: torch.Tensor) -> torch.Tensor:
        """dLoss/dlogp from dLoss/dratio (per token, zero outside the response)."""
        if not self.per_sequence:
            return d_ratio * self.slope
        seg = x.segments
        pulled = seg.per_row(seg.seq_sum(d_ratio) * self.slope)
        return pulled if self.token_slope is True else pulled * self.token_slope


def importance_ratio(level: str, x: PolicyInputs, seq_log_ratio: torch.Tensor,
                     sequence_base: tuple[torch.Tensor, torch.Tensor] | None = None) -> ImportanceRatio:
    """The level's ratio. seq_log_ratio: `[S]` mean log-ratio of each sequence. sequence_base:
    (per-token log-ratio, its derivative by logp) to build the sequence ratio on instead of
    the plain log-ratio."""
    bounds = x.log_ratio_bounds
    # Where the clamp passes a gradient costs two ops: only the levels that differentiate s_i ask.
    differentiates_seq = level == "sequence_token" or (level == "sequence" and sequence_base is None)
    clamped_seq, seq_passes = clamp_with_slope(seq_log_ratio, *bounds) if differentiates_seq else \
        (_clamped_value(seq_log_ratio, bounds), None)
    seq_ratio = torch.exp(clamped_seq)
    if level == "token":
        clamped, passes = clamp_with_slope(x.log_ratio, *bounds)
        ratio = torch.exp(clamped)
        return ImportanceRatio(ratio, seq_ratio, _where_passes(ratio, passes))
    if level == "sequence_token":
        # A -inf log-prob would make logp - sg[logp] NaN: its ratio is s_i, its gradient 0.
        seg = x.segments
        ratio = seg.per_row(seq_ratio)
        return ImportanceRatio(ratio, seq_ratio, seg.per_row(_where_passes(seq_ratio, seq_passes)) *
                               torch.isfinite(x.logp))
    if sequence_base is None:
        ratio, token_slope = seq_ratio, True
    else:
        base, token_slope = sequence_base
        clamped_seq, seq_passes = clamp_with_slope(x.segments.seq_sum(base) / x.length, *bounds)
        ratio = torch.exp(clamped_seq)
    return ImportanceRatio(x.segments.per_row(ratio), seq_ratio, _where_passes(ratio, seq_passes) / x.length,
                           token_slope, per_sequence=True)
