"""The oracle: GSPO written the naive way, for reading and for testing the kernels against.

Everything is float64: the full `[N, V]` log_softmax, then one Python loop over sequences
that spells out the paper's formulas. It shares no math with the fused path (only the
option checks in GSPOConfig), so agreement between the two means something. It is slow and
memory-hungry on purpose; use it on small problems.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import GSPOConfig

def sampler_kept(z, top_k=None, top_p=None, min_p=None, order=None):
    """`[N, V]` bool: the tokens vLLM's v1 sampler keeps from logits z (after the temperature):
    min-p (probability >= min_p * the row's largest), then top-k (>= the k-th largest), then
    top-p over what is left (sorted ascending, the prefix whose cumulative probability is <=
    1 - top_p goes, the largest token always stays). Ties at the top-p boundary are all kept. A
    row without a finite softmax (a NaN or +inf logit, or all -inf) keeps every token: it stays NaN, as
    docs/semantics.md says of such rows. order: the values that rank the tokens for top-k and
    top-p (the raw logits; z by default), the masses being z's."""
    order = z if order is None else order
    no_softmax = (torch.isnan(z) | (z == math.inf)).any(-1, keepdim=True) | (z == -math.inf).all(-1, keepdim=True)
    keep = torch.ones_like(z, dtype=torch.bool)
    if min_p is not None and min_p > 0:
        probs = torch.softmax(z, -1)
        keep &= probs >= min_p * probs.amax(-1, keepdim=True)
    if top_k is not None and top_k < z.shape[-1]:
        ascending = torch.where(keep, order, torch.full_like(order, -math.inf)).sort(-1).values
        keep &= order >= ascending[:, -top_k].unsqueeze(-1)  # vLLM: the sorted row at V - k
    if top_p is not None and top_p < 1:
        ascending, index = torch.where(keep, order, torch.full_like(order, -math.inf)).sort(-1)
        masses = torch.where(keep, z, torch.full_like(z, -math.inf)).gather(-1, index)
        cumulative = torch.softmax(masses, -1).cumsum(-1)
        gone = cumulative <= 1 - top_p
        gone[:, -1] = False
        boundary = torch.where(gone, torch.full_like(ascending, math.inf), ascending).amin(-1, keepdim=True)
        keep &= order >= boundary
    return keep | no_softmax


def _token_logprobs_and_entropy(logits, target_ids, temperature, in_response, logit_scale=1.0, logit_softcap=None,
                                sampling=None, sampling_threshold=None, kept_tokens=None):
    rows = logits.double().reshape(-1, logits.shape[-1])
    # Rows outside the response keep their values (reported in the metrics) but pass no
    # gradient, whatever they hold: NaN logits or a -100 pad id there cost nothing.
    rows = torch.where(in_response.to(rows.device).unsqueeze(-1), rows, rows.detach())
    # The model's multiplier, then its soft-cap, then the trainer's temperature, as Hugging Face
    # models and the trainers apply them (Cohere: logits * logit_scale; Gemma 2:
    # c * tanh(logits / c); then TRL's logits / temperature).
    raw = rows.detach()
    if kept_tokens is not None:  # the engine's sets: only their logits are read (a NaN elsewhere is not)
        listed = torch.zeros(rows.shape, dtype=torch.bool, device=rows.device)
        listed[kept_tokens.row_index.to(rows.device), kept_tokens.token_ids.to(rows.device)] = True
        rows = torch.where(listed, rows, torch.zeros_like(rows))
    rows = rows * logit_scale
    if logit_softcap is not None:
        rows = logit_softcap * torch.tanh(rows / logit_softcap)
    rows = rows / temperature
    # The sampler's kept set: the others are -inf (probability 0, no gradient); a target among
    # them gets a -inf log-prob.
    unmasked = rows
    if sampling is not None and any(v is not None for v in sampling):
        rows = torch.where(sampler_kept(rows.detach(), *sampling, order=raw), rows, torch.full_like(rows, -math.inf))
    elif sampling_threshold is not None:
        kept = raw >= sampling_threshold.reshape(-1, 1).double().to(raw.device)
        rows = torch.where(kept, rows, torch.full_like(rows, -math.inf))
    elif kept_tokens is not None:
        rows = torch.where(listed, rows, torch.full_like(rows, -math.inf))
    log_probs = torch.log_softmax(rows, dim=-1)
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
    if rows is not unmasked:  # NaN also into the logits outside the kept set: the whole row, as documented
        nan_if_bad = torch.where(valid, 0.0, math.nan).to(logp)  # 0 (no gradient) for a valid row
        logp = logp + nan_if_bad * torch.nan_to_num(unmasked, nan=0.0, posinf=0.0, neginf=0.0).sum(-1)
    return logp, entropy


def _sequences(token_shape, cu_seqlens):
    """Row ranges of each sequence in the flattened token axis: the rows of a padded (B, T), or
    cu_seqlens' spans of a packed (N,)."""
    if len(token_shape) == 2:
        batch, seq_len = token_shape
        return [range(b * seq_len, (b + 1) * seq_len) for b in range(batch)]
    bounds = [int(c) for c in cu_seqlens]
    return [range(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def _kl(logp, ref_logp, estimator, clamp=None):
    log_ratio = ref_logp - logp  # log(pi_ref / pi)
    if estimator == "k1":
        kl = logp - ref_logp
    elif estimator == "k2":
        kl = 0.5 * log_ratio**2
    else:
        if clamp is not None:  # verl: the log-ratio inside k3's exp is clamped first
            log_ratio = _clamp(log_ratio, (-20, 20))
        kl = torch.exp(log_ratio) - 1 - log_ratio  # k3
    return kl if clamp is None else _clamp(kl, (-clamp, clamp))


def _quantile(values, q):
    """torch.quantile, NaN over no value at all (no response token: nothing to select)."""
    return torch.quantile(values, q) if values.numel() else values.new_full((), float("nan"))


def _clamp(x, bounds):
    """clamp(x) whose gradient passes strictly inside the bounds only: the rule at a kink that
    stage 2 follows (docs/semantics.md, "Ties and bounds"), spelled out because autograd's
    clamp has not had the same rule on a bound in every torch release. A tie of
    torch.minimum/maximum splits the gradient in half, which is the same rule's other half."""
    low, high = bounds
    if low is None and high is None:
        return x
    inside = torch.ones_like(x, dtype=torch.bool)
    if low is not None:
        inside = inside & (x > low)
    if high is not None:
        inside = inside & (x < high)
    return torch.where(inside, x, x.detach().clamp(min=low, max=high))


def _policy_terms(cfg, lp, log_ratio, ratio, a):
    """(per-token term, clipped low, clipped high) of one sequence, spelled out per objective."""
    lo, hi = 1 - cfg.eps_low, 1 + cfg.eps_high
    r = ratio.detach()
    if cfg.objective == "clip":
        capped = ratio if cfg.delta is None else _clamp(ratio, (None, cfg.delta))
        term = -torch.minimum(capped * a, _clamp(ratio, (lo, hi)) * a)
        if cfg.clip_ratio_c is not None:  # dual clip: a negative-advantage term is at most -c A
            term = torch.where(a < 0, torch.minimum(term, -cfg.clip_ratio_c * a), term)
        return term, (r < lo) & (a < 0), (r > hi) & (a > 0)
    if cfg.objective == "cispo":
        return -r.clamp(lo, hi) * a * lp, r < lo, r > hi
    if cfg.objective == "sapo":
        tau = torch.tensor([cfg.sapo_tau_pos if x > 0 else cfg.sapo_tau_neg for x in a.tolist()], dtype=a.dtype,
                           device=a.device)
        no = torch.zeros(len(a), dtype=torch.bool, device=a.device)
        return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a, no, no
    if cfg.objective == "vespo":  # the gamma weight of the sequence's product ratio, detached
        log_w = log_ratio.detach().clamp(-20, 20).sum().clamp(math.log(1e-8), 20)
        k = torch.tensor([cfg.vespo_k_pos if x >= 0 else cfg.vespo_k_neg for x in a.tolist()], dtype=a.dtype,
                         device=a.device)
        lam = torch.tensor([cfg.vespo_lambda_pos if x >= 0 else cfg.vespo_lambda_neg for x in a.tolist()],
                           dtype=a.dtype, device=a.device)
        # TRL's gamma weight is 0 where it is not finite (a NaN log-ratio in the sequence).
        phi = torch.nan_to_num(torch.exp(lam + k * log_w - lam * torch.exp(log_w)), nan=0.0, posinf=0.0, neginf=0.0)
        no = torch.zeros(len(a), dtype=torch.bool, device=a.device)
        return -phi * a * lp, no, no
    # gmpo: per-token log-ratios clipped on the pessimistic side of sign(A), geometric mean.
    clipped_lr = _clamp(log_ratio, (-cfg.eps_low, cfg.eps_high))
    sign = torch.sign(a)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clipped_lr)
    if len(lp) == 0:
        return lp * 0, torch.zeros(0, dtype=torch.bool, device=lp.device), torch.zeros(0, dtype=torch.bool, device=lp.device)
    seq_ratio = torch.exp(_clamp(pessimistic.mean(), cfg.log_ratio_clamp))
    term = (-a.mean() * seq_ratio).expand(len(lp))
    lr = log_ratio.detach()
    changed = (lr < -cfg.eps_low) | (lr > cfg.eps_high)  # a NaN log-ratio is never clipped
    return term, changed & (a < 0), changed & (a > 0)


def _rollout_weights(cfg, old_lp, rollout_lp):
    """Importance weights pi_old / pi_rollout of one sequence, and which were rejected."""
    diff = torch.nan_to_num(old_lp.detach() - rollout_lp, nan=0.0)
    if cfg.rollout_correction.startswith("sequence"):
        per_sequence = diff.mean() if cfg.rollout_sequence_weight == "geometric-mean" and len(diff) else diff.sum()
        diff = per_sequence.expand(len(diff))
    w = torch.exp(diff)
    low = 0.0 if cfg.rollout_is_min is None else cfg.rollout_is_min
    high = float("inf") if cfg.rollout_is_max is None else cfg.rollout_is_max
    if cfg.rollout_correction.endswith("truncate"):
        return w.clamp(low, high), torch.zeros(len(w), dtype=torch.bool, device=w.device)
    rejected = (w < low) | (w > high)
    return torch.where(rejected, torch.zeros_like(w), w), rejected


@dataclass(frozen=True)
class _Call:
    """One call's per-token inputs, flattened to rows (float64), and its scalars."""

    token_shape: tuple
    in_response: torch.Tensor
    old: torch.Tensor | None
    advantages: torch.Tensor
    ref: torch.Tensor | None
    rollout: torch.Tensor | None
    token_weights: torch.Tensor | None
    normalizer: object
    entropy_threshold: object
    sequences: list

    @staticmethod
    def of(token_shape, mask, cu_seqlens, old_logprobs, advantages, ref_logprobs=None, rollout_logprobs=None,
           token_weights=None, normalizer=None, entropy_threshold=None):
        def per_token(t):
            return None if t is None else t.reshape(-1).double()

        n = math.prod(token_shape)
        in_response = torch.ones(n, dtype=torch.bool) if mask is None else mask.reshape(-1).cpu() != 0
        return _Call(tuple(token_shape), in_response, per_token(old_logprobs), advantages.double(),
                     per_token(ref_logprobs), per_token(rollout_logprobs), per_token(token_weights), normalizer,
                     entropy_threshold, _sequences(tuple(token_shape), cu_seqlens))


def gspo_loss(logits, target_ids, old_logprobs, advantages, *, mask=None, cu_seqlens=None, ref_logprobs=None,
              rollout_logprobs=None, normalizer=None, entropy_threshold=None, sampling_threshold=None, kept_tokens=None,
              config=None, **options):
    """Same signature and meaning as gspo_kernels.gspo_loss; backend and inplace are ignored.

    Returns a float64 loss (differentiable w.r.t. logits) and float64 metrics."""
    cfg = config if config is not None else GSPOConfig(**options)
    call = _Call.of(target_ids.shape, mask, cu_seqlens, old_logprobs, advantages, ref_logprobs, rollout_logprobs,
                    None, normalizer, entropy_threshold)
    logp, entropy = _token_logprobs_and_entropy(
        logits, target_ids, cfg.temperature, call.in_response, cfg.logit_scale, cfg.logit_softcap,
        (cfg.sampling_top_k, cfg.sampling_top_p, cfg.sampling_min_p), sampling_threshold, kept_tokens)
    return _objective(cfg, call, logp, entropy)


def policy_loss(logprobs, old_logprobs, advantages, *, mask=None, cu_seqlens=None, entropy=None, ref_logprobs=None,
                rollout_logprobs=None, token_weights=None, normalizer=None, entropy_threshold=None, config=None,
                **options):
    """Same signature and meaning as gspo_kernels.policy_loss: the loss from per-token
    log-probs, float64, differentiable w.r.t. logprobs (and entropy). Metrics as policy_loss's
    (no entropy metrics without entropy)."""
    cfg = config if config is not None else GSPOConfig(**options)
    call = _Call.of(logprobs.shape, mask, cu_seqlens, old_logprobs, advantages, ref_logprobs, rollout_logprobs,
                    token_weights, normalizer, entropy_threshold)
    logp = logprobs.reshape(-1).double()
    ent = torch.zeros_like(logp) if entropy is None else entropy.reshape(-1).double()
    loss, metrics = _objective(cfg, call, logp, ent)
    if entropy is None:
        del metrics["entropy"], metrics["entropy_mean"]
    return loss, metrics


def selective_log_softmax(logits, target_ids, temperature=1.0, return_entropy=False, *, mask=None,
                          logit_scale=1.0, logit_softcap=None, sampling_top_k=None, sampling_top_p=None,
                          sampling_min_p=None, sampling_threshold=None, kept_tokens=None):
    """gspo_kernels.selective_log_softmax in float64 with plain autograd: (logp, entropy) shaped
    like target_ids; rows outside mask pass no gradient."""
    in_response = (torch.ones(target_ids.numel(), dtype=torch.bool) if mask is None
                   else mask.reshape(-1).cpu() != 0)
    logp, entropy = _token_logprobs_and_entropy(logits, target_ids, temperature, in_response, logit_scale,
                                                 logit_softcap, (sampling_top_k, sampling_top_p, sampling_min_p),
                                                 sampling_threshold, kept_tokens)
    logp, entropy = logp.reshape(target_ids.shape), entropy.reshape(target_ids.shape)
    return (logp, entropy) if return_entropy else logp


def _linear_logits(hidden, weight, bias):
    """hidden @ weight.T + bias in float64: the logits the fused-linear entry points never form."""
    logits = hidden.double() @ weight.double().t()
    return logits if bias is None else logits + bias.double()


def fused_linear_gspo_loss(hidden, weight, target_ids, old_logprobs, advantages, *, bias=None, config=None,
                           **options):
    """gspo_kernels.fused_linear_gspo_loss in float64: gspo_loss on hidden @ weight.T + bias,
    differentiable w.r.t. hidden, weight and bias. LinearConfig options (how the fused path runs)
    are accepted and ignored; the per-call tensors and loss options are gspo_loss's."""
    from ..config import LINEAR_OPTIONS

    options = {k: v for k, v in options.items() if k not in LINEAR_OPTIONS and k not in ("linear", "backend")}
    return gspo_loss(_linear_logits(hidden, weight, bias), target_ids, old_logprobs, advantages, config=config,
                     **options)


def fused_linear_selective_log_softmax(hidden, weight, target_ids, *, bias=None, temperature=1.0,
                                       return_entropy=False, mask=None, logit_scale=1.0, logit_softcap=None,
                                       sampling_top_k=None, sampling_top_p=None, sampling_min_p=None, kept_tokens=None,
                                       **ignored):
    """gspo_kernels.fused_linear_selective_log_softmax in float64 (how-it-runs options ignored)."""
    return selective_log_softmax(_linear_logits(hidden, weight, bias), target_ids, temperature, return_entropy,
                                 mask=mask, logit_scale=logit_scale, logit_softcap=logit_softcap,
                                 sampling_top_k=sampling_top_k, sampling_top_p=sampling_top_p,
                                 sampling_min_p=sampling_min_p, kept_tokens=kept_tokens)


def _objective(cfg: GSPOConfig, call: _Call, logp, entropy):
    """One function on purpose: it reads top to bottom as the formulas of docs/semantics.md, one
    sequence at a time (ratio, policy term, corrections, KL, entropy), with plain autograd for
    the gradient, so that it can be checked against the docs line by line; only the aggregation
    and the metrics, which read the finished per-sequence terms, live apart."""
    in_response, old, ref, rollout = call.in_response, call.old, call.ref, call.rollout
    adv = call.advantages
    adv_per_token = adv.shape != (len(call.sequences),)
    if adv_per_token:
        adv = adv.reshape(-1)
    # Top-entropy selection: the quantile of every response token's entropy in this call.
    threshold = None
    if cfg.top_entropy_quantile < 1.0:
        threshold = (_quantile(entropy.detach()[in_response], 1 - cfg.top_entropy_quantile)
                     if call.entropy_threshold is None
                     else torch.as_tensor(call.entropy_threshold, dtype=torch.float64))

    seq_terms, seq_ratios = [], []
    low_flags, high_flags, kls, entropies = [], [], [], []
    weights_all, rejected_all, kept_entropy, kept_on_policy = [], [], [], []
    for i, rows in enumerate(call.sequences):
        idx = torch.tensor([r for r in rows if in_response[r]], dtype=torch.long, device=logp.device)
        lp = logp[idx]
        old_lp = lp.detach() if old is None else old[idx]
        log_ratio = lp - old_lp
        # s_i: the exponentiated mean log-ratio over the response (1 for an empty response).
        # Log-ratios are clamped (default [-20, 20]) before exp, so no ratio overflows.
        mean_log_ratio = log_ratio.mean() if len(idx) else torch.zeros((), dtype=torch.float64, device=logp.device)
        s_i = torch.exp(_clamp(mean_log_ratio, cfg.log_ratio_clamp))
        if cfg.level == "sequence":
            ratio = s_i.expand(len(idx))
        elif cfg.level == "sequence_token":
            # value s_i, d ratio / d lp = s_i; a -inf lp would give -inf - -inf, so it gets 0.
            unit = torch.where(torch.isfinite(lp), lp - lp.detach(), torch.zeros_like(lp))
            ratio = torch.exp(_clamp(mean_log_ratio.detach() + unit, cfg.log_ratio_clamp))
        else:
            ratio = torch.exp(_clamp(log_ratio, cfg.log_ratio_clamp))
        a = adv[idx] if adv_per_token else adv[i].expand(len(idx))
        term, low, high = _policy_terms(cfg, lp, log_ratio, ratio, a)
        if cfg.rollout_correction is not None:
            w, rejected = _rollout_weights(cfg, old_lp, rollout[idx])
            term = term * w
            weights_all.append(w)
            rejected_all.append(rejected)
        if threshold is not None:
            keep = entropy[idx].detach() >= threshold
            term = torch.where(keep, term, torch.zeros_like(term))
            kept_entropy.append(keep)
        if cfg.off_policy_mask_threshold is not None:
            behaviour = old_lp if rollout is None else rollout[idx]
            gap = torch.nan_to_num(behaviour - lp.detach(), nan=0.0)
            far = (gap.mean() if len(idx) else gap.sum()) > cfg.off_policy_mask_threshold
            keep = ~((a < 0) & far)
            term = torch.where(keep, term, torch.zeros_like(term))
            kept_on_policy.append(keep)
        if call.token_weights is not None:  # weights computed elsewhere (policy_loss's token_weights)
            term = term * call.token_weights[idx]
        if ref is not None:
            kl = _kl(lp, ref[idx], cfg.kl_estimator, cfg.kl_clamp)
            if cfg.use_bias_correction_kl:  # the loss and the metric alike
                kl = kl * ratio
            if cfg.beta > 0:  # beta = 0: KL is a metric only; an infinite one leaves the loss alone
                term = term + cfg.beta * kl
            kls.append(kl)
        term = term - cfg.entropy_coef * entropy[idx]
        seq_terms.append(term)
        seq_ratios.append(s_i)
        low_flags.append(low)
        high_flags.append(high)
        entropies.append(entropy[idx])

    padded_len = call.token_shape[1] if len(call.token_shape) == 2 else 1
    horizon = cfg.max_len if cfg.max_len is not None else padded_len
    loss = _aggregate(cfg, seq_terms, call.normalizer, horizon, logp.new_zeros(()))
    flags = dict(low=low_flags, high=high_flags, entropies=entropies, kls=kls, weights=weights_all,
                 rejected=rejected_all, kept_entropy=kept_entropy, kept_on_policy=kept_on_policy)
    return loss, _metrics(cfg, logp, entropy, call.token_shape, seq_ratios, flags, ref is not None)


def _aggregate(cfg, seq_terms, normalizer, horizon, zero):
    """The loss from each sequence's per-token terms, by cfg.loss_agg (docs/semantics.md)."""
    nonempty = [t for t in seq_terms if len(t)]
    n_tokens = sum(len(t) for t in seq_terms)
    norm = float(normalizer) if normalizer is not None else None
    if cfg.loss_agg in ("token-mean", "token-sum"):
        total = sum(t.sum() for t in nonempty) if nonempty else zero
        return total / (norm or (max(n_tokens, 1) if cfg.loss_agg == "token-mean" else 1.0))
    if cfg.loss_agg == "seq-mean-token-mean":
        per_seq = [t.mean() for t in nonempty]
    elif cfg.loss_agg == "seq-mean-token-sum":
        per_seq = [t.sum() for t in nonempty]
    else:
        per_seq = [t.sum() / max(horizon, 1) for t in nonempty]
    total = sum(per_seq) if per_seq else zero
    return total / (norm or max(len(nonempty), 1))


def _cat(parts, dtype):
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)


def _metrics(cfg, logp, entropy, token_shape, seq_ratios, flags, with_kl: bool):
    """The metrics of gspo_kernels.gspo_loss (means over response tokens), from each sequence's
    flags and values."""
    zero = torch.zeros((), dtype=torch.float64)
    low, high = _cat(flags["low"], torch.bool), _cat(flags["high"], torch.bool)
    denom = max(len(low), 1)

    def seq_share(per_seq):
        shares = [f.double().mean() for f in per_seq if len(f)]
        return sum(shares) / max(len(shares), 1) if shares else zero

    metrics = {
        "token_logprobs": logp.detach().reshape(token_shape),
        "entropy": entropy.detach().reshape(token_shape),
        "seq_ratio": torch.stack(seq_ratios).detach() if seq_ratios else torch.zeros(0, dtype=torch.float64),
        "clip_frac": (low | high).sum().double() / denom,
        "clip_frac_low": low.sum().double() / denom,
        "clip_frac_high": high.sum().double() / denom,
        "seq_clip_frac_low": torch.as_tensor(seq_share(flags["low"]), dtype=torch.float64),
        "seq_clip_frac_high": torch.as_tensor(seq_share(flags["high"]), dtype=torch.float64),
        "entropy_mean": _cat(flags["entropies"], torch.float64).detach().sum() / denom,
    }
    if with_kl:
        metrics["kl"] = _cat(flags["kls"], torch.float64).detach().sum() / denom
    if cfg.rollout_correction is not None:
        w = _cat(flags["weights"], torch.float64).detach()
        metrics["rollout_is_mean"] = w.sum() / denom
        metrics["rollout_is_max"] = w.max() if len(w) else zero
        metrics["rollout_masked_frac"] = _cat(flags["rejected"], torch.bool).sum().double() / denom
    if cfg.top_entropy_quantile < 1.0:
        metrics["entropy_kept_frac"] = _cat(flags["kept_entropy"], torch.bool).sum().double() / denom
    if cfg.off_policy_mask_threshold is not None:
        metrics["off_policy_masked_frac"] = (~_cat(flags["kept_on_policy"], torch.bool)).sum().double() / denom
    return metrics
