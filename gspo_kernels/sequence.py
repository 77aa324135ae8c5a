"""Stage 2: the sequence math, on `[N]` and `[S]` tensors, the same for every backend.

Plain differentiable PyTorch: autograd turns the loss into dLoss/dlogp and dLoss/dH per row,
which the token-stats Function hands to the gradient kernel. No host syncs and no
data-dependent Python branches, so it traces under torch.compile(fullgraph=True).
"""

from __future__ import annotations

import torch

from .config import GSPOConfig
from .inputs import LossBatch


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1, k2, k3)."""
    log_ratio = ref_logp - logp
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    return torch.expm1(log_ratio) - log_ratio


# Log-ratios are clamped before exp (as verl does): a stale or wrong old log-prob then cannot
# overflow the ratio to inf, where inf * (A = 0) would turn the whole loss into NaN.
MAX_LOG_RATIO = 20.0


def _importance_ratio(config: GSPOConfig, batch: LossBatch, logp, log_ratio, seq_ratio):
    seg = batch.segments
    if config.level == "sequence":
        return seg.per_row(seq_ratio)
    if config.level == "sequence_token":
        # Value s_i, gradient of exp(logp_t): each token carries its own advantage's weight.
        # (A -inf log-prob would make logp - sg[logp] NaN; its ratio is s_i, its gradient 0.)
        unit = torch.where(torch.isfinite(logp), logp - logp.detach(), torch.zeros_like(logp))
        return seg.per_row(seq_ratio.detach()) * torch.exp(unit)
    return torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def _aggregate(config: GSPOConfig, batch: LossBatch, per_token, mask_f, tokens_per_seq):
    if config.loss_agg == "token-mean":
        denom = batch.normalizer if batch.normalizer is not None else mask_f.sum().clamp(min=1)
        return per_token.sum() / denom
    per_seq = batch.segments.seq_sum(per_token)
    if config.loss_agg == "seq-mean-token-mean":
        per_seq = per_seq / tokens_per_seq.clamp(min=1)
    elif config.loss_agg == "seq-mean-token-sum-norm":
        per_seq = per_seq / batch.horizon
    if batch.normalizer is not None:
        return per_seq.sum() / batch.normalizer
    return per_seq.sum() / (tokens_per_seq > 0).sum().clamp(min=1).to(per_seq.dtype)


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

    seg = batch.segments
    tokens_per_seq = seg.seq_sum(mask_f)
    seq_log_ratio = seg.seq_sum(log_ratio) / tokens_per_seq.clamp(min=1)
    seq_ratio = torch.exp(seq_log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    ratio = _importance_ratio(config, batch, logp_r, log_ratio, seq_ratio)

    adv = batch.advantages.to(dtype)
    adv = response_only(adv if batch.advantages_per_token else seg.per_row(adv))
    lo, hi = 1.0 - config.eps_low, 1.0 + config.eps_high
    per_token = -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)

    kl = None
    if batch.ref_logprobs is not None:
        kl = response_only(kl_penalty(logp_r, response_only(batch.ref_logprobs), config.kl_estimator))
        if config.beta > 0:
            per_token = per_token + config.beta * kl
    if config.entropy_coef != 0.0:
        per_token = per_token - config.entropy_coef * entropy_r
    per_token = response_only(per_token)

    loss = _aggregate(config, batch, per_token, mask_f, tokens_per_seq)
    metrics = _metrics(config, batch, logp, entropy, entropy_r, ratio, adv, seq_ratio, kl, mask_f)
    return loss, metrics


@torch.no_grad()
def _metrics(config, batch, logp, entropy, entropy_r, ratio, adv, seq_ratio, kl, mask_f):
    mask = batch.mask
    n_tokens = mask_f.sum().clamp(min=1)
    ratio = ratio.detach()
    low = mask & (ratio < 1.0 - config.eps_low) & (adv < 0)
    high = mask & (ratio > 1.0 + config.eps_high) & (adv > 0)

    def fraction(flags):
        return (flags.to(mask_f.dtype).sum() / n_tokens).float()

    metrics = {
        "token_logprobs": logp.detach().float().reshape(batch.token_shape),
        "entropy": entropy.detach().float().reshape(batch.token_shape),
        "seq_ratio": seq_ratio.detach().float(),
        "clip_frac": fraction(low | high),
        "clip_frac_low": fraction(low),
        "clip_frac_high": fraction(high),
        "entropy_mean": (entropy_r.detach().sum() / n_tokens).float(),
    }
    if kl is not None:
        metrics["kl"] = (kl.detach().sum() / n_tokens).float()
    return metrics
