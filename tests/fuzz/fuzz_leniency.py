"""Where the documented rules let a result differ from the float64 reference's, and why.

Each function names rows (flat, the token order of the call) or a condition; fuzz_run.py passes
them to the oracle's checks. Everything here is a decision about semantics the docs leave open
or a limit of float32: keep it short, and say why each one holds.
"""

from __future__ import annotations

import torch


def bad_rows(built) -> torch.Tensor:
    """Response rows docs/semantics.md calls bad: a NaN or +inf logit, a row of all -inf, or
    an out-of-range target id (the reference's log-prob or entropy is NaN there). The loss
    must then be NaN: "that token's log-prob, the loss and that row's whole gradient are NaN"."""
    return built.in_response & (torch.isnan(built.lp64) | torch.isnan(built.ent64))


def _non_finite_inputs(built) -> torch.Tensor:
    """Response rows where a value the loss reads is not finite: a bad row, a -inf log-prob
    (the sampled token's logit was -inf), or NaN/inf old or reference log-probs or
    advantages, or an infinite rollout log-prob (a NaN one means "no correction")."""
    out = built.in_response & ~(torch.isfinite(built.lp64) & torch.isfinite(built.ent64))
    for t in (built.old, built.ref, built.advantages if built.advantages is not None and
              built.advantages.shape == built.targets.shape else None):
        if t is not None:
            out |= built.in_response & ~torch.isfinite(t.reshape(-1).double())
    if built.rollout is not None:
        out |= built.in_response & torch.isinf(built.rollout.reshape(-1))
    if built.advantages is not None and built.advantages.shape != built.targets.shape:
        for rows, a in zip(built.seq_rows, built.advantages.tolist()):
            if not torch.isfinite(torch.tensor(a)):
                out[rows] |= built.in_response[rows]
    return out


def overflow_rows(built) -> torch.Tensor:
    """Rows of sequences whose log-ratio passes float32's exp range (> 88) with the clamp's
    upper side open. float32 holds their ratio as inf, and d ratio / d lp = ratio turns the
    clip's zero gradient into 0 * inf = NaN on every backend (float64 holds e^100, and gets
    0): the documented price of log_ratio_clamp=(..., None). Their loss stays finite (the
    advantages there are positive), so only their gradient rows are let off."""
    out = torch.zeros_like(built.in_response)
    if built.old is None or built.options.get("log_ratio_clamp", (-20.0, 20.0))[1] is not None:
        return out
    d = built.lp64 - built.old.reshape(-1).double()
    for rows in built.seq_rows:
        resp = [r for r in rows if built.in_response[r]]
        if resp and (d[resp] > 80).any() | (d[resp].mean() > 80):
            out[rows] = True
    return out


def poisoned_rows(built) -> torch.Tensor:
    """Flat rows whose gradient may be NaN where the reference's is finite: every row of a
    sequence holding a response row with a non-finite input. The reference's autograd passes
    no gradient through a NaN ratio (a NaN fails every comparison in min, max and clamp), so
    the siblings of such a row get finite values there, while the kernels turn the whole
    sequence NaN, which issue 24 accepts ("today the whole sequence's rows are NaN (which
    is fine: say so)"). With this call's entropy quantile, a NaN entropy makes the threshold
    NaN for every sequence, so then every row is poisoned."""
    bad = _non_finite_inputs(built)
    out = torch.zeros_like(bad)
    if not bad.any():
        return out
    if (built.options.get("top_entropy_quantile", 1.0) < 1.0 and built.entropy_threshold is None
            and not torch.isfinite(built.ent64[built.in_response]).all()):
        return torch.ones_like(bad)
    for rows in built.seq_rows:
        if bad[rows].any():
            out[rows] = True
    return out


def log_prob_scale(built) -> float:
    """max |log-prob| over finite response rows: float32 log-probs are good to ~1e-7 of it
    in absolute terms, which exp(lp - old) turns into that much relative error."""
    lp = built.lp64[built.in_response]
    lp = lp[torch.isfinite(lp)]
    return float(lp.abs().max()) if lp.numel() else 0.0


def row_ratios(built) -> torch.Tensor:
    """Each response row's ratio as the reference forms it (1 on-policy), its log-ratio clamped
    to the drawn log_ratio_clamp (an open side: up to float32's largest exp, 88)."""
    n = built.in_response.numel()
    if built.old is None:
        return torch.ones(n, dtype=torch.float64)
    low, high = built.options.get("log_ratio_clamp", (-20.0, 20.0))
    low, high = -88.0 if low is None else low, 88.0 if high is None else high
    d = torch.nan_to_num(built.lp64 - built.old.reshape(-1).double(), nan=0.0, posinf=high, neginf=low)
    if built.options.get("level", "sequence") != "token":
        for rows in built.seq_rows:
            resp = [r for r in rows if built.in_response[r]]
            if resp:
                d[rows] = d[resp].mean()
    return torch.exp(d.clamp(low, high))


def row_advantages(built) -> torch.Tensor:
    """|A| of each row as the reference reads it (per sequence or per token)."""
    n = built.in_response.numel()
    adv = built.advantages.detach().double().reshape(-1)
    if adv.numel() == n and tuple(built.advantages.shape) == built.token_shape and \
            not (built.case.packed and len(built.seq_rows) == n):
        out = adv.abs()
    else:
        out = torch.zeros(n, dtype=torch.float64)
        for rows, a in zip(built.seq_rows, adv.tolist()):
            out[rows] = abs(a)
    return torch.nan_to_num(out, nan=0.0, posinf=0.0)


def row_weights(built) -> torch.Tensor:
    """What the loss multiplies each response row's term by: 1 / its loss_agg denominator."""
    opts, resp = built.options, built.in_response
    agg = opts.get("loss_agg", "seq-mean-token-mean")
    norm = None if built.normalizer is None else float(built.normalizer)
    lengths = [int(resp[rows].sum()) for rows in built.seq_rows]
    n_seq = norm or max(sum(1 for k in lengths if k), 1)
    out = torch.zeros(resp.numel(), dtype=torch.float64)
    for rows, k in zip(built.seq_rows, lengths):
        if agg == "token-mean":
            denom = norm or max(int(resp.sum()), 1)
        elif agg == "token-sum":
            denom = norm or 1.0
        elif agg == "seq-mean-token-mean":
            denom = n_seq * max(k, 1)
        elif agg == "seq-mean-token-sum":
            denom = n_seq
        else:
            denom = n_seq * (opts.get("max_len") or built.token_shape[-1] or 1)
        out[rows] = 1.0 / denom
    return torch.where(resp, out, torch.zeros_like(out))


def _kl_parts(built):
    """Per row: |kl|, |d kl / d lp|, |d2 kl / d lp2| of the drawn estimator (0 without ref)."""
    n = built.in_response.numel()
    if built.ref is None:
        zero = torch.zeros(n, dtype=torch.float64)
        return zero, zero, zero
    x = torch.nan_to_num(built.ref.reshape(-1).double() - built.lp64, nan=0.0, posinf=20.0, neginf=-20.0)
    est = built.options.get("kl_estimator", "k3")
    if est == "k1":
        kl, d1, d2 = x.abs(), torch.ones_like(x), torch.zeros_like(x)
    elif est == "k2":
        kl, d1, d2 = 0.5 * x * x, x.abs(), torch.ones_like(x)
    else:
        e = torch.exp(x.clamp(-20.0, 20.0))
        kl, d1, d2 = (e - 1 - x).abs(), (e - 1).abs(), e
    return kl, d1, d2


F32_RELATIVE = 1e-7  # float32's rounding, with a little room for the sums of a few terms


def log_prob_precision(built) -> torch.Tensor:
    """Per row, how far a float32 log-prob (and entropy) may sit from float64's: a logsumexp
    of logits up to m = max |logit / temperature| is good to a few ulp of m (0.0 for a row of
    logits near 0 is not good to 1e-9). verify.STATS_LIMIT (3e-6) is the same bound for rows
    of V = 12388."""
    temperature = built.options.get("temperature", 1.0)
    rows = built.logits64.reshape(-1, built.logits64.shape[-1]).abs() * built.options.get("logit_scale", 1.0)
    if built.options.get("logit_softcap") is not None:
        rows = built.options["logit_softcap"] * torch.tanh(rows / built.options["logit_softcap"])
    rows = rows / temperature
    rows = torch.where(torch.isfinite(rows), rows, torch.zeros_like(rows))
    peak = rows.max(-1).values if rows.shape[-1] else torch.zeros(rows.shape[0], dtype=torch.float64)
    return 2 * F32_RELATIVE * (1.0 + peak)


def _term_scales(built):
    """Per row: a bound on |term| and on |d2 term / d lp2| (policy, KL, entropy terms). The
    policy term is at most |A| r times 2 (VESPO's weight phi <= 1.25 at its defaults and the
    drawn ones), or 4 / tau for SAPO (tau down to 0.5)."""
    ratio = row_ratios(built)
    factor = 8.0 if built.options.get("objective") == "sapo" else 2.0
    policy = factor * row_advantages(built) * ratio.clamp(min=1.0)
    if built.options.get("objective") == "cispo":  # its term is -sg(clip(r)) A lp: |lp| times that
        policy = policy * torch.nan_to_num(built.lp64.abs(), nan=0.0, posinf=0.0).clamp(min=1.0)
    kl, d1, d2 = _kl_parts(built)
    bias = ratio if built.options.get("use_bias_correction_kl") else torch.ones_like(ratio)
    beta = built.options.get("beta", 0.0)
    ent = torch.nan_to_num(built.ent64, nan=0.0, posinf=0.0)
    value = policy + beta * kl * bias + built.options.get("entropy_coef", 0.0) * ent
    curvature = policy + beta * bias * (d2 + 2 * d1 + kl)
    return value, curvature


def precision_rows(built, d_logprob, d_entropy) -> torch.Tensor:
    """How far (absolute, in norm) each row's logits gradient may sit from float64's, half of it,
    from float32's own precision. A log-prob off by log_prob_precision moves the row's gradient
    through the upstream d loss / d log-prob and d loss / d entropy (d_logprob, d_entropy:
    float64, from the reference), and moves the upstream itself by the term's curvature; and
    float32 computes the upstream from terms of size |A| ratio to F32_RELATIVE of them (SAPO's
    gate derivative s (1 - s) keeps only 3e-8 of s once saturated, as torch's sigmoid backward).
    A real defect (a gradient 2x at a tie, a dropped term) is of the order of |A| / n."""
    u = torch.zeros(built.in_response.numel(), dtype=torch.float64)
    if d_logprob is not None:
        u += torch.nan_to_num(d_logprob.detach().abs(), nan=0.0, posinf=0.0)
    if d_entropy is not None:
        ent = torch.nan_to_num(built.ent64, nan=0.0, posinf=0.0)
        u += torch.nan_to_num(d_entropy.detach().abs(), nan=0.0, posinf=0.0) * (2.0 + ent)
    delta = log_prob_precision(built)
    out = delta * u
    if built.case.entry != "selective_log_softmax":
        value, curvature = _term_scales(built)
        out = out + row_weights(built) * (delta * curvature + 4 * F32_RELATIVE * value)
    return torch.where(built.in_response, out, torch.zeros_like(out))


def loss_precision(built, d_logprob) -> float:
    """The loss's absolute precision from float32: each row's log-prob error through its
    upstream, and float32's rounding of each term."""
    u = torch.zeros(built.in_response.numel(), dtype=torch.float64)
    if d_logprob is not None:
        u = torch.nan_to_num(d_logprob.detach().abs(), nan=0.0, posinf=0.0)
    value, _ = _term_scales(built)
    out = log_prob_precision(built) * u + 4 * F32_RELATIVE * row_weights(built) * value
    if built.options.get("objective") == "cispo":
        # Its weight sg(clip(r)) is off by r times the log-ratio's error, which d loss / d lp
        # (the stop-gradient's zero) does not carry: the term moves by that fraction of itself.
        out = out + log_prob_precision(built) * row_weights(built) * value
    return float(out[built.in_response].sum())


def kl_precision(built) -> float:
    """The kl metric's absolute precision (a mean over response tokens of kl, times the ratio
    with use_bias_correction_kl): log_prob_precision through d kl / d lp, F32 of each value,
    and with the ratio the float32 rounding of its log-ratio, which exp turns into a relative
    error of F32 * |log ratio| (7e-6 at a ratio of 1e8)."""
    resp = built.in_response
    if built.ref is None or not resp.any():
        return 0.0
    kl, d1, _ = _kl_parts(built)
    ratio = row_ratios(built) if built.options.get("use_bias_correction_kl") else torch.ones_like(kl)
    rounding = 4 + 2 * ratio.log().abs()
    per_row = ratio * (log_prob_precision(built) * (d1 + kl) + rounding * F32_RELATIVE * kl)
    return float(per_row[resp].mean())
