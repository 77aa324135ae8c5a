"""The oracle: GSPO written the naive way, for reading and for testing the kernels against.

Everything is float64: the full `[N, V]` log_softmax, then one Python loop over sequences
that spells out the paper's formulas. It shares no math with the fused path (only the
option checks in GSPOConfig), so agreement between the two means something. It is slow and
memory-hungry on purpose; use it on small problems.
"""

from __future__ import annotations

import torch

from .config import GSPOConfig

MAX_LOG_RATIO = 20.0


def _token_logprobs_and_entropy(logits, target_ids, temperature, in_response):
    rows = logits.double().reshape(-1, logits.shape[-1])
    # Rows outside the response keep their values (reported in the metrics) but pass no
    # gradient, whatever they hold: NaN logits or a -100 pad id there cost nothing.
    rows = torch.where(in_response.to(rows.device).unsqueeze(-1), rows, rows.detach())
    log_probs = torch.log_softmax(rows / temperature, dim=-1)
    probs = log_probs.exp()
    # -p log p is 0 where p = 0 (a -inf logit); log p is zeroed first so no 0 * -inf
    # appears in the forward or the backward pass.
    entropy = -(probs * torch.where(probs > 0, log_probs, torch.zeros_like(log_probs))).sum(-1)
    vocab = logits.shape[-1]
    ids = target_ids.reshape(-1)
    valid = (ids >= 0) & (ids < vocab)
    logp = log_probs.gather(-1, ids.long().clamp(0, vocab - 1).unsqueeze(-1)).squeeze(-1)
    # An out-of-range id: a NaN log-prob, and (times NaN) a NaN gradient row in the response.
    logp = logp * torch.where(valid, 1.0, float("nan")).to(logp)
    return logp, entropy


def _sequences(logits, cu_seqlens):
    """Row ranges of each sequence in the flattened token axis."""
    if logits.dim() == 3:
        batch, seq_len = logits.shape[:2]
        return [range(b * seq_len, (b + 1) * seq_len) for b in range(batch)]
    bounds = [int(c) for c in cu_seqlens]
    return [range(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def _kl(logp, ref_logp, estimator):
    log_ratio = ref_logp - logp  # log(pi_ref / pi)
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return torch.exp(log_ratio) - 1 - log_ratio  # k3


def gspo_loss(logits, target_ids, old_logprobs, advantages, *, mask=None, cu_seqlens=None,
              level="sequence", eps_low=3e-4, eps_high=4e-4, temperature=1.0,
              loss_agg="seq-mean-token-mean", normalizer=None, max_len=None, ref_logprobs=None,
              beta=0.0, kl_estimator="k3", entropy_coef=0.0, backend="auto", inplace=False):
    """Same signature and meaning as gspo_kernels.gspo_loss; backend and inplace are ignored.

    Returns a float64 loss (differentiable w.r.t. logits) and float64 metrics.
    """
    cfg = GSPOConfig(level=level, eps_low=eps_low, eps_high=eps_high, temperature=temperature,
                     loss_agg=loss_agg, max_len=max_len, beta=beta, kl_estimator=kl_estimator,
                     entropy_coef=entropy_coef)
    in_response = (torch.ones(target_ids.numel(), dtype=torch.bool) if mask is None
                   else mask.reshape(-1).cpu() != 0)
    logp, entropy = _token_logprobs_and_entropy(logits, target_ids, cfg.temperature, in_response)
    old = None if old_logprobs is None else old_logprobs.reshape(-1).double()
    ref = None if ref_logprobs is None else ref_logprobs.reshape(-1).double()
    sequences = _sequences(logits, cu_seqlens)
    adv = advantages.double()
    adv_per_token = adv.shape != (len(sequences),)
    if adv_per_token:
        adv = adv.reshape(-1)

    seq_terms, seq_ratios = [], []
    ratios, advs, kls, entropies = [], [], [], []
    for i, rows in enumerate(sequences):
        idx = torch.tensor([r for r in rows if in_response[r]], dtype=torch.long, device=logp.device)
        lp = logp[idx]
        old_lp = lp.detach() if old is None else old[idx]
        # s_i: the exponentiated mean log-ratio over the response (1 for an empty response).
        # Log-ratios are clamped to [-20, 20] before exp, so no ratio overflows.
        mean_log_ratio = (lp - old_lp).mean() if len(idx) else torch.zeros((), dtype=torch.float64, device=logp.device)
        s_i = torch.exp(mean_log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
        if cfg.level == "sequence":
            ratio = s_i.expand(len(idx))
        elif cfg.level == "sequence_token":
            # value s_i, d ratio / d lp = s_i; a -inf lp would give -inf - -inf, so it gets 0.
            unit = torch.where(torch.isfinite(lp), lp - lp.detach(), torch.zeros_like(lp))
            ratio = s_i.detach() * torch.exp(unit)
        else:
            ratio = torch.exp((lp - old_lp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
        a = adv[idx] if adv_per_token else adv[i].expand(len(idx))
        clipped = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
        term = -torch.minimum(ratio * a, clipped * a)
        if ref is not None:
            kl = _kl(lp, ref[idx], cfg.kl_estimator)
            if cfg.beta > 0:  # beta = 0: KL is a metric only; an infinite one leaves the loss alone
                term = term + cfg.beta * kl
            kls.append(kl)
        term = term - cfg.entropy_coef * entropy[idx]
        seq_terms.append(term)
        seq_ratios.append(s_i)
        ratios.append(ratio)
        advs.append(a)
        entropies.append(entropy[idx])

    nonempty = [t for t in seq_terms if len(t)]
    n_tokens = sum(len(t) for t in seq_terms)
    norm = float(normalizer) if normalizer is not None else None
    if cfg.loss_agg == "token-mean":
        total = sum(t.sum() for t in nonempty) if nonempty else torch.zeros((), dtype=torch.float64, device=logp.device)
        loss = total / (norm or max(n_tokens, 1))
    else:
        if cfg.loss_agg == "seq-mean-token-mean":
            per_seq = [t.mean() for t in nonempty]
        elif cfg.loss_agg == "seq-mean-token-sum":
            per_seq = [t.sum() for t in nonempty]
        else:
            horizon = cfg.max_len if cfg.max_len is not None else logits.shape[1]
            per_seq = [t.sum() / horizon for t in nonempty]
        total = sum(per_seq) if per_seq else torch.zeros((), dtype=torch.float64, device=logp.device)
        loss = total / (norm or max(len(nonempty), 1))

    ratio = torch.cat(ratios).detach()
    a = torch.cat(advs)
    low = (ratio < 1 - cfg.eps_low) & (a < 0)
    high = (ratio > 1 + cfg.eps_high) & (a > 0)
    denom = max(n_tokens, 1)
    metrics = {
        "token_logprobs": logp.detach().reshape(target_ids.shape),
        "entropy": entropy.detach().reshape(target_ids.shape),
        "seq_ratio": torch.stack(seq_ratios).detach(),
        "clip_frac": (low | high).sum().double() / denom,
        "clip_frac_low": low.sum().double() / denom,
        "clip_frac_high": high.sum().double() / denom,
        "entropy_mean": torch.cat(entropies).detach().sum() / denom,
    }
    if ref is not None:
        metrics["kl"] = torch.cat(kls).detach().sum() / denom
    return loss, metrics
