"""Stage 2: the sequence math, on per-token and `[S]` tensors, the same for every backend.

One no-grad pass gives the loss, its gradient g = dLoss/dlogp and h = dLoss/dH per token, and
the metrics; gradient.py hands the loss to autograd with g and h attached, and the token-stats
Function passes them to the gradient kernel. The loss is linear in each token's term once the
detached weights are fixed:

    loss = sum_t W_t * (C_t * F_t + beta * K_t - entropy_coef * H_t)

W the aggregation weight (loss_agg, normalizer; 0 outside the response), C the corrections'
detached weight, F the objective's policy term (objectives.py: a function of the level's
importance ratio, ratio.py, and of logp), K the KL penalty (kl.py; times the ratio with
use_bias_correction_kl). So

    g_t = W_t (C_t dF_t/dlogp_t + beta dK_t/dlogp_t) + pull(W (C dF/dratio + beta dK/dratio))_t
    h_t = -entropy_coef * W_t

where pull is the level's chain from the ratio to the log-probs. No host syncs and no
data-dependent Python branches, so it traces under torch.compile(fullgraph=True). Everything
keeps the token shape (`[B, T]` padded, `[N]` packed): few ops, which is what a small
micro-batch's host time is made of (gspo_kernels.bench.host counts them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import corrections
from ..config import GSPOConfig
from .gradient import attach_gradient
from ..inputs.batch import LossBatch
from .kl import kl_penalty, kl_slope_plus_estimate
from .objectives import OWN_LOG_RATIO, PolicyInputs, policy_term
from .ratio import ImportanceRatio, importance_ratio


@dataclass(frozen=True)
class _Counts:
    # Per-sequence tensors have Segments.seq_sum's shape ([B, 1] padded, [S] packed).
    length: torch.Tensor  # the response tokens of each sequence (every rank's), clamped to >= 1
    n_tokens: torch.Tensor  # 0-d, >= 1
    n_seqs: torch.Tensor  # 0-d int64, the non-empty sequences, >= 1
    seq_share: torch.Tensor  # 1 / (length * n_seqs): a token's weight in a mean of sequence means


def _counts(tokens_per_seq: torch.Tensor) -> _Counts:
    # Every row lies in a sequence, so the token count is the sum of the (already global)
    # per-sequence counts: no second reduction across ranks.
    length = tokens_per_seq.clamp(min=1)
    n_seqs = torch.count_nonzero(tokens_per_seq).clamp(min=1)
    return _Counts(length, tokens_per_seq.sum().clamp(min=1), n_seqs, (length * n_seqs).reciprocal())


def _aggregation_weight(config: GSPOConfig, batch: LossBatch, counts: _Counts):
    """W of each token as a number, a 0-d or an `[S]` per-sequence tensor (0 outside the
    response is applied by the caller): the loss is sum_t W_t * term_t."""
    normalizer = batch.normalizer
    if isinstance(normalizer, torch.Tensor):
        # In the loss's dtype: a float32 normalizer's reciprocal would round float64 terms.
        normalizer = normalizer.to(counts.length.dtype)
    if config.loss_agg in ("token-mean", "token-sum"):
        if normalizer is not None:
            return 1.0 / normalizer
        return counts.n_tokens.reciprocal() if config.loss_agg == "token-mean" else 1.0
    if normalizer is None:
        if config.loss_agg == "seq-mean-token-mean":
            return counts.seq_share
        per_seq = counts.n_seqs.to(counts.length.dtype)
    else:
        per_seq = normalizer
        if config.loss_agg == "seq-mean-token-mean":
            return (counts.length * normalizer).reciprocal()
    if config.loss_agg == "seq-mean-token-sum-norm":
        per_seq = per_seq * batch.horizon
    return 1.0 / per_seq


@dataclass(frozen=True)
class _Term:
    value: torch.Tensor  # per token, added to the policy term
    d_logp: torch.Tensor | None
    d_ratio: torch.Tensor | None


def _kl_term(config: GSPOConfig, logp, ref_logp, ratio: ImportanceRatio, response_only):
    """(the kl metric per token, the beta * KL term of the loss or None when beta = 0). With
    use_bias_correction_kl (TRL's) the KL is weighted by the (differentiable) importance ratio,
    and the metric reads that corrected estimate too, as TRL's does."""
    kl, d_kl = kl_penalty(logp, ref_logp, config.kl_estimator, config.kl_clamp)
    ratio_value = ratio.value
    # An overflowed ratio (log_ratio_clamp open) times a padding row's KL of 0 would be NaN there.
    corrected = response_only(kl * ratio_value) if config.use_bias_correction_kl else kl
    if config.beta == 0:  # KL is a metric only; an infinite one leaves the loss alone
        return corrected, None
    beta = config.beta
    if config.use_bias_correction_kl and not ratio.per_sequence:
        # Token levels: where d r_t / d logp_t is r_t (no clamp holds) the two parts of the
        # gradient join as r_t * (d kl / d logp + kl), taken without k3's cancellation.
        together = kl_slope_plus_estimate(logp, ref_logp, config.kl_estimator, config.kl_clamp)
        joined = torch.where(ratio.slope == ratio_value, together, d_kl)
        return corrected, _Term(beta * corrected, beta * joined * ratio_value, None)
    if config.use_bias_correction_kl:
        return corrected, _Term(beta * corrected, beta * d_kl * ratio_value, beta * kl)
    return corrected, _Term(beta * kl, beta * d_kl, None)


# Derivatives that are identically zero are None, not zero tensors: each tensor would cost ops
# on every call (a small micro-batch's host time is its op count). These two treat None as 0.
def _times(x, weight):
    return x if weight is None or x is None else x * weight


def _plus(x, y):
    return y if x is None else x if y is None else x + y


class _ResponseOnly:
    """x in the loss's dtype with every row outside the response set to 0: a NaN from a padding
    row (e.g. an out-of-range pad id) would otherwise reach the loss or the gradient through
    0 * NaN. The mask is its own zero there (False promotes to 0.0): no zero tensor to make.
    Without a mask every row is in the response: nothing to zero, only a per-sequence value to
    broadcast."""

    def __init__(self, batch: LossBatch, dtype: torch.dtype):
        self.mask, self.masked, self.dtype = batch.mask, batch.masked, dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        if self.masked:
            return torch.where(self.mask, x, self.mask)
        return x if x.shape == self.mask.shape else x.expand(self.mask.shape)


def _policy_inputs(config: GSPOConfig, batch: LossBatch, logp: torch.Tensor, response_only: _ResponseOnly):
    """(PolicyInputs, the old log-probs where a correction reads them, the counts, the mean
    log-ratio of each sequence): what every objective and correction reads."""
    dtype, mask, seg = logp.dtype, batch.mask, batch.segments
    needs_logp = config.objective in ("cispo", "vespo") or config.level == "sequence_token" or \
        batch.ref_logprobs is not None or config.off_policy_mask_threshold is not None
    logp_r = response_only(logp) if needs_logp else None
    # The old log-probs themselves only feed the corrections that read the sampler's policy.
    needs_old = config.rollout_correction is not None or config.off_policy_mask_threshold is not None
    if batch.old_logprobs is None:
        # On-policy: old = sg[logp], so the log-ratio logp - sg[logp] is 0, and NaN where logp is
        # not finite (a NaN or +inf logit, a row of -inf, an out-of-range id): the loss is NaN
        # then, as the reference's and TRL's are, never a finite loss over a NaN gradient.
        old = logp_r if logp_r is not None else response_only(logp)
        log_ratio = old - old
    else:
        old = response_only(batch.old_logprobs) if needs_old else None
        log_ratio = response_only(logp - batch.old_logprobs.to(dtype))
    tokens_per_seq, seq_log_ratio_sum = seg.seq_sums((mask, log_ratio), dtype)
    counts = _counts(tokens_per_seq)
    adv = batch.advantages.to(dtype)
    adv = response_only(adv if batch.advantages_per_token else seg.per_row(adv))
    x = PolicyInputs(logp_r, log_ratio, adv, mask, seg, counts.length, counts.n_tokens, config.log_ratio_clamp)
    return x, old, counts, seq_log_ratio_sum / counts.length


def _evaluate(config: GSPOConfig, batch: LossBatch, logp: torch.Tensor, entropy: torch.Tensor, aggregation=None):
    """(the weighted per-token loss terms, g = dLoss/dlogp, h = dLoss/dH or None, metrics).
    aggregation: W when `batch` is a group of whole sequences cut from a larger batch (the larger
    batch's, sequence_groups.py); None: this batch's own."""
    response_only = _ResponseOnly(batch, logp.dtype)
    x, old, counts, seq_log_ratio = _policy_inputs(config, batch, logp, response_only)
    ratio = importance_ratio(config.level, x, seq_log_ratio)
    # An objective with a log-ratio of its own (OWN_LOG_RATIO: GMPO's) has a ratio of its own,
    # pulled back apart; the KL's bias correction keeps the level's.
    own_log_ratio = OWN_LOG_RATIO.get(config.objective)
    policy_ratio = ratio if own_log_ratio is None else \
        importance_ratio(config.level, x, seq_log_ratio, own_log_ratio(config, x))
    term = policy_term(config, x, policy_ratio.value)
    entropy_r = response_only(entropy)
    rollout = None if batch.rollout_logprobs is None else response_only(batch.rollout_logprobs)
    weight, extra = corrections.apply(config, x, old, rollout, entropy_r, batch.entropy_threshold)
    if batch.token_weights is not None:  # weights computed elsewhere (e.g. verl's rollout_is_weights)
        weight = _times(response_only(batch.token_weights), weight)

    per_token = _times(term.value, weight)
    d_logp, d_policy_ratio = _times(term.d_logp, weight), _times(term.d_ratio, weight)
    d_ratio = d_policy_ratio if own_log_ratio is None else None  # one pull for the term and the KL
    kl = None
    if batch.ref_logprobs is not None:
        kl, penalty = _kl_term(config, x.logp, response_only(batch.ref_logprobs), ratio, response_only)
        if penalty is not None:
            per_token, d_logp, d_ratio = per_token + penalty.value, _plus(d_logp, penalty.d_logp), \
                _plus(d_ratio, penalty.d_ratio)
    if config.entropy_coef != 0.0:
        per_token = per_token - config.entropy_coef * entropy_r

    w = _aggregation_weight(config, batch, counts) if aggregation is None else aggregation
    # W per row, not masked: every derivative above is 0 outside the response (A, the log-ratio
    # and the corrections' weights are), and the where below keeps the terms' values out.
    w_row = batch.segments.per_row(w) if isinstance(w, torch.Tensor) and w.dim() else w
    g = _times(d_logp, w_row)
    if d_ratio is not None:
        g = _plus(g, ratio.pull(x, w_row * d_ratio))
    if own_log_ratio is not None:
        g = _plus(g, policy_ratio.pull(x, w_row * d_policy_ratio))
    g = response_only(g)
    h = None
    if config.entropy_coef != 0.0:  # a number W times the mask in the loss's dtype (not float32)
        mask = batch.mask
        h = (mask * w_row if isinstance(w_row, torch.Tensor) else mask.to(logp.dtype) * w_row) * -config.entropy_coef
    # With the default aggregation W is each token's share in a mean of sequence means.
    share = w_row if w is counts.seq_share else None
    metrics = _metrics(batch, term, ratio.seq_ratio, entropy_r, kl, counts, share)
    metrics.update(extra)
    # Outside the response a term may be NaN (an overflowed ratio times A = 0): the mask, not a
    # product with W, keeps it out of the loss.
    return response_only(w_row * per_token), g, h, metrics


def gspo_objective(config: GSPOConfig, batch: LossBatch, logp: torch.Tensor, entropy: torch.Tensor):
    """(loss, metrics) from per-token log-probs and entropies of the token shape (autograd-
    connected: the loss's gradient reaches them)."""
    with torch.no_grad():
        logp_d, entropy_d = logp.detach(), entropy.detach()
        weighted, g, h, metrics = _evaluate(config, batch, logp_d, entropy_d)
    metrics = {"token_logprobs": logp_d.float(), "entropy": entropy_d.float(), **metrics}
    return attach_gradient(weighted, batch.segments.total, logp, entropy, g, h), metrics


def aggregation_weight(config: GSPOConfig, batch: LossBatch, dtype: torch.dtype):
    """The batch's W (a number, a 0-d or a per-sequence tensor), from its mask, normalizer and
    horizon alone: what a group of its sequences needs to give each token the weight it has in
    the whole batch's loss."""
    (tokens_per_seq,) = batch.segments.seq_sums((batch.mask,), dtype)
    return _aggregation_weight(config, batch, _counts(tokens_per_seq))


def sequence_coefficients(config: GSPOConfig, group: LossBatch, logp: torch.Tensor, entropy: torch.Tensor,
                          aggregation):
    """(g, h) of a group of whole sequences of a batch whose W is `aggregation` (sliced to the
    group's sequences when per sequence): each token's coefficients in the whole batch's loss,
    since every term but W reads only its own sequence. Not for an option that reads a statistic
    of the whole batch (a top_entropy_quantile threshold found from the entropies)."""
    with torch.no_grad():
        _, g, h, _ = _evaluate(config, group, logp, entropy, aggregation)
    return g, h


def _metrics(batch: LossBatch, term, seq_ratio, entropy_r, kl, counts: _Counts, share_per_token):
    low, high = term.clipped_low, term.clipped_high
    clipped = low | high if term.clipped is None else term.clipped
    columns = torch.stack([clipped, low, high, entropy_r] + ([] if kl is None else [kl]), dim=-1).to(entropy_r.dtype)
    # Every token mean is a column sum over tokens, and TRL's per-sequence view of the clip
    # fractions (each non-empty sequence's share of clipped tokens, averaged over the non-empty
    # sequences) is a product with each token's share 1 / (|y_i| * non-empty sequences). Padded,
    # per-sequence sums come first (one reduction; one collective across context-parallel
    # ranks); packed, where a segment sum costs three ops, the product runs over the tokens.
    # The other columns' shares come along unread: one product is fewer ops than a slice and one.
    seg = batch.segments
    if seg.padded_layout or seg.group is not None:
        per_seq = seg.column_sums(columns)
        means = per_seq.sum(0) / counts.n_tokens
        shares = (per_seq * seg.as_column(counts.seq_share)).sum(0)
    else:
        by_column = columns.T
        means = by_column.sum(1) / counts.n_tokens
        shares = by_column.mv(seg.per_row(counts.seq_share) if share_per_token is None else share_per_token)
    means, seq_shares = means.float().unbind(0), shares.float().unbind(0)
    metrics = {
        "seq_ratio": seg.per_sequence(seq_ratio).float(),
        "clip_frac": means[0],
        "clip_frac_low": means[1],
        "clip_frac_high": means[2],
        "seq_clip_frac_low": seq_shares[1],
        "seq_clip_frac_high": seq_shares[2],
        "entropy_mean": means[3],
    }
    if kl is not None:
        metrics["kl"] = means[4]
    return metrics
