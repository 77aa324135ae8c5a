"""Stage 2: the sequence math, on `[N]` and `[S]` tensors, the same for every backend.

Plain differentiable PyTorch: autograd turns the loss into dLoss/dlogp and dLoss/dH per row,
which the token-stats Function hands to the gradient kernel. No host syncs and no
data-dependent Python branches, so it traces under torch.compile(fullgraph=True). The policy
term of each objective lives in objectives.py, the weights and selections that scale it in
corrections.py; this module wires them together and aggregates.
"""

from __future__ import annotations

import torch

from . import corrections
from ..config import GSPOConfig
from .inputs import LossBatch
from .objectives import PolicyInputs, policy_term


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str, clamp: float | None = None):
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1, k2, k3).

    With `clamp` (verl's k3 habit, applied to every estimator): the log-ratio is clamped to
    [-20, 20] before k3's exp, and the estimate to [-clamp, clamp]."""
    log_ratio = ref_logp - logp
    if estimator == "k1":
        kl = -log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio.square()
    else:
        if clamp is not None:
            log_ratio = log_ratio.clamp(-20.0, 20.0)
        kl = torch.expm1(log_ratio) - log_ratio
    return kl if clamp is None else kl.clamp(-clamp, clamp)


def log_ratio_clamp(config: GSPOConfig):
    """The configured clamp of a log-ratio before exp (config.log_ratio_clamp, default
    [-20, 20]): a stale or wrong old log-prob then cannot overflow a ratio to inf, where
    inf * (A = 0) would turn the whole loss into NaN; values inside are untouched."""
    low, high = config.log_ratio_clamp
    if low is None and high is None:
        return lambda x: x
    return lambda x: x.clamp(min=low, max=high)


def _importance_ratio(config: GSPOConfig, batch: LossBatch, logp, log_ratio, seq_log_ratio, clamp):
    seg = batch.segments
    if config.level == "sequence":
        return seg.per_row(torch.exp(clamp(seq_log_ratio)))
    if config.level == "sequence_token":
        # Value s_i, gradient of exp(logp_t): each token carries its own advantage's weight.
        # The combined log-ratio is clamped, as verl does. (A -inf log-prob would make
        # logp - sg[logp] NaN; its ratio is s_i, its gradient 0.)
        unit = torch.where(torch.isfinite(logp), logp - logp.detach(), torch.zeros_like(logp))
        return torch.exp(clamp(seg.per_row(seq_log_ratio.detach()) + unit))
    return torch.exp(clamp(log_ratio))


def _aggregate(config: GSPOConfig, batch: LossBatch, per_token, x: PolicyInputs):
    if config.loss_agg in ("token-mean", "token-sum"):
        # Every row lies in a sequence, so the token count is the sum of the (already global)
        # per-sequence counts: no second reduction across ranks.
        count = x.n_tokens if config.loss_agg == "token-mean" else 1.0
        denom = batch.normalizer if batch.normalizer is not None else count
        return batch.segments.total(per_token) / denom
    per_seq = batch.segments.seq_sum(per_token)
    if config.loss_agg == "seq-mean-token-mean":
        per_seq = per_seq / x.length
    elif config.loss_agg == "seq-mean-token-sum-norm":
        per_seq = per_seq / batch.horizon
    if batch.normalizer is not None:
        return per_seq.sum() / batch.normalizer
    return per_seq.sum() / (x.tokens_per_seq > 0).sum().clamp(min=1).to(per_seq.dtype)


def gspo_objective(config: GSPOConfig, batch: LossBatch, logp: torch.Tensor, entropy: torch.Tensor):
    """(loss, metrics) from per-row log-probs and entropies (`[N]`, autograd-connected)."""
    dtype = logp.dtype
    mask = batch.mask
    mask_f = mask.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=logp.device)

    # Zero every per-row input outside the response first: a NaN from a padding row (e.g. an
    # out-of-range pad id) would otherwise reach the gradient through 0 * NaN.
    def response_only(x):
        return torch.where(mask, x.to(dtype), zero)

    logp_r = response_only(logp)
    entropy_r = response_only(entropy)
    old = logp_r.detach() if batch.old_logprobs is None else response_only(batch.old_logprobs)
    log_ratio = logp_r - old
    clamp = log_ratio_clamp(config)

    seg = batch.segments
    tokens_per_seq = seg.seq_sum(mask_f)
    length = tokens_per_seq.clamp(min=1)
    seq_log_ratio = seg.seq_sum(log_ratio) / length
    ratio = _importance_ratio(config, batch, logp_r, log_ratio, seq_log_ratio, clamp)
    adv = batch.advantages.to(dtype)
    adv = response_only(adv if batch.advantages_per_token else seg.per_row(adv))

    # Every rank's tokens already: tokens_per_seq is a global per-sequence sum.
    inputs = PolicyInputs(logp_r, log_ratio, ratio, adv, mask, seg, tokens_per_seq, clamp, length,
                          tokens_per_seq.sum().clamp(min=1))
    term = policy_term(config, inputs)
    rollout = None if batch.rollout_logprobs is None else response_only(batch.rollout_logprobs)
    per_token, extra = corrections.apply(config, inputs, term.per_token, old, rollout, entropy_r,
                                         batch.entropy_threshold)
    if batch.token_weights is not None:  # weights computed elsewhere (e.g. verl's rollout_is_weights)
        per_token = per_token * response_only(batch.token_weights)

    kl = None
    if batch.ref_logprobs is not None:
        kl = response_only(kl_penalty(logp_r, response_only(batch.ref_logprobs), config.kl_estimator, config.kl_clamp))
        if config.use_bias_correction_kl:
            # TRL's bias correction weights the KL by the (differentiable) importance ratio; the
            # kl metric reads this corrected estimate too, as TRL's does.
            kl = kl * ratio
        if config.beta > 0:
            per_token = per_token + config.beta * kl
    if config.entropy_coef != 0.0:
        per_token = per_token - config.entropy_coef * entropy_r
    per_token = response_only(per_token)

    loss = seg.replicated_loss(_aggregate(config, batch, per_token, inputs))
    metrics = _metrics(batch, logp, entropy, entropy_r, term, torch.exp(clamp(seq_log_ratio)), kl, mask_f, inputs)
    metrics.update(extra)
    return loss, metrics


@torch.no_grad()
def _metrics(batch, logp, entropy, entropy_r, term, seq_ratio, kl, mask_f, x: PolicyInputs):
    mask = batch.mask
    low, high = mask & term.clipped_low, mask & term.clipped_high
    seg = batch.segments
    # Every token mean and every per-sequence share comes from one per-sequence sum of stacked
    # columns (one reduction, and one collective across context-parallel ranks).
    columns = [low | high, low, high, entropy_r] + ([] if kl is None else [kl])
    per_seq = seg.seq_sum(torch.stack([c.to(mask_f.dtype) for c in columns], dim=1))
    means = (per_seq.sum(0) / x.n_tokens).float().unbind(0)
    # TRL's per-sequence view: each non-empty sequence's share of clipped tokens, averaged over
    # the non-empty sequences (an empty one has a share of 0 / 1 = 0).
    shares = (per_seq[:, 1:3] / x.length.unsqueeze(1)).sum(0)
    seq_shares = (shares / (x.tokens_per_seq > 0).sum().clamp(min=1)).float().unbind(0)
    metrics = {
        "token_logprobs": logp.detach().float().reshape(batch.token_shape),
        "entropy": entropy.detach().float().reshape(batch.token_shape),
        "seq_ratio": seq_ratio.detach().float(),
        "clip_frac": means[0],
        "clip_frac_low": means[1],
        "clip_frac_high": means[2],
        "seq_clip_frac_low": seq_shares[0],
        "seq_clip_frac_high": seq_shares[1],
        "entropy_mean": means[3],
    }
    if kl is not None:
        metrics["kl"] = means[4]
    return metrics
