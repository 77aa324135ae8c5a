"""Keeps drawn problems away from kinks that rounding could put on either side, and says when
one is too close anyway (`near_tie`).

At a kink (a clip bound, a clamp, a rollout-weight bound, the off-policy or entropy threshold)
the loss's value or gradient jumps. A value within float32's rounding of one may fall on the
other side in the kernels than in the float64 reference, which is not a defect, so the test
discards such a problem (hypothesis.assume). The one deliberate exception: on-policy
(old_logprobs=None) the ratio is exactly 1 in every precision, so eps_low=0 or eps_high=0 puts it
exactly on a bound, where the documented tie rule (a clamp passes the gradient strictly inside
its bounds only, a min/max tie splits it in half) must hold to rounding; it is never discarded.
"""

from __future__ import annotations

import math

import torch

from gspo_kernels.testing import reference

# Kinks closer than this (in log-ratio units, or nats of entropy) to a value are "near ties".
# float32 log-probs are good to ~1e-6 here (|lp| < 50), so 1e-4 leaves a wide margin.
TIE_MARGIN = 1e-4


def kink_bounds(opts: dict) -> list[float]:
    """Log-ratio values where some objective's value or gradient has a kink."""
    lo, hi = 1 - opts.get("eps_low", 3e-4), 1 + opts.get("eps_high", 4e-4)
    out = [math.log(lo), math.log(hi)]
    if opts.get("objective") == "gmpo":
        out += [-opts.get("eps_low", 3e-4), opts.get("eps_high", 4e-4)]
    for name in ("delta", "clip_ratio_c"):
        if opts.get(name) is not None:
            out.append(math.log(opts[name]))
    for b in opts.get("log_ratio_clamp", (-20.0, 20.0)):
        if b is not None:
            out.append(b)
    if opts.get("objective") == "vespo":
        out += [-20.0, 20.0, math.log(1e-8)]
    return out


def _kl64(lp, ref, estimator, clamp):
    log_ratio = ref - lp
    if estimator == "k1":
        return lp - ref
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    if clamp is not None:
        log_ratio = log_ratio.clamp(-20, 20)
    return torch.exp(log_ratio) - 1 - log_ratio


def midpoint_threshold(values: list[float], pick: float, pad: float) -> float:
    """A threshold between two of `values` (or beyond them), at least TIE_MARGIN * 10 from each."""
    vals = sorted(set(v for v in values if abs(v) < 1e6))  # NaN, inf and nan_to_num's 1.8e308 left out
    if not vals:
        return 0.0
    cands = [vals[0] - pad]
    cands += [(a + b) / 2 for a, b in zip(vals, vals[1:]) if b - a > 20 * TIE_MARGIN]
    cands.append(vals[-1] + pad)
    return round(cands[min(int(pick * len(cands)), len(cands) - 1)], 9)


def _behaviour_flat(built):
    if built.rollout is not None:
        return built.rollout.reshape(-1).double()
    if built.old is not None:
        return built.old.reshape(-1).double()
    return built.lp64


def off_policy_gaps(built) -> list[float]:
    """Each sequence's mean of behaviour - lp over its response, as the reference computes it."""
    behaviour, out = _behaviour_flat(built), []
    for rows in built.seq_rows:
        resp = [r for r in rows if built.in_response[r]]
        if not resp:
            out.append(0.0)
            continue
        gap = torch.nan_to_num(behaviour[resp] - built.lp64[resp], nan=0.0)
        out.append(float(gap.mean()))
    return out


def _near(values, bounds) -> float | None:
    for v in values:
        if not math.isfinite(v):
            continue
        for b in bounds:
            if abs(v - b) < TIE_MARGIN * max(1.0, abs(b) * 1e-2):
                return v
    return None


def near_tie(built, opts: dict) -> str | None:
    """Why this problem sits within rounding of a kink (so float32 may fall on the other side), or None."""
    case = built.case
    lp = built.lp64
    resp_rows = [[r for r in rows if built.in_response[r]] for rows in built.seq_rows]
    if built.old is not None:
        old = built.old.reshape(-1).double()
        bounds = kink_bounds(opts)
        per_token, means, sums, gmpo_means = [], [], [], []
        for resp in resp_rows:
            if not resp:
                continue
            d = lp[resp] - old[resp]
            per_token += d.tolist()
            means.append(float(d.mean()))
            sums.append(float(d.clamp(-20, 20).sum()))
            if opts.get("objective") == "gmpo":
                gmpo_means.append(float(d.clamp(-opts.get("eps_low", 3e-4), opts.get("eps_high", 4e-4)).mean()))
        hit = _near(per_token + means + sums + gmpo_means, bounds)
        if hit is not None:
            return f"log-ratio {hit} within {TIE_MARGIN} of a bound in {bounds}"
    if opts.get("rollout_correction") is not None:
        base = built.old.reshape(-1).double() if built.old is not None else lp
        diff = torch.nan_to_num(base - built.rollout.reshape(-1).double(), nan=0.0)
        logs = []
        for resp in resp_rows:
            if not resp:
                continue
            dd = diff[resp]
            if opts["rollout_correction"].startswith("sequence"):
                product = opts.get("rollout_sequence_weight", "geometric-mean") == "product"
                logs.append(float(dd.sum() if product else dd.mean()))
            else:
                logs += dd.tolist()
        bounds = [math.log(b) for b in (opts.get("rollout_is_min"), opts.get("rollout_is_max", 2.0))
                  if b is not None and b > 0]
        hit = _near(logs, bounds)
        if hit is not None:
            return f"rollout log-weight {hit} within {TIE_MARGIN} of a bound in {bounds}"
        # Not a tie but float32's range: a weight e^80 times a zero term is NaN in float32 and 0
        # in float64, and no option bounds it (log_ratio_clamp bounds ratios only).
        if any(v > 80 for v in logs if math.isfinite(v)):
            return "a rollout log-weight > 80: beyond float32's exp range"
    if opts.get("off_policy_mask_threshold") is not None:
        hit = _near(off_policy_gaps(built), [opts["off_policy_mask_threshold"]])
        if hit is not None:
            return f"off-policy gap {hit} at the threshold"
    q = opts.get("top_entropy_quantile", 1.0)
    if q < 1.0 and built.entropy_threshold is None:
        ent = built.ent64[built.in_response]
        if ent.numel() and torch.isfinite(ent).all():
            thr = float(torch.quantile(ent, 1 - q))
            pos = (ent.numel() - 1) * (1 - q)
            close = [float(e) for e in ent if abs(float(e) - thr) < TIE_MARGIN]
            if any(e != thr for e in close) or (close and abs(pos - round(pos)) > 1e-9):
                return f"an entropy within {TIE_MARGIN} of the {1 - q} quantile {thr}"
    if opts.get("kl_clamp") is not None and built.ref is not None:
        c = opts["kl_clamp"]
        ref = built.ref.reshape(-1).double()
        rows = [r for resp in resp_rows for r in resp]
        kl = _kl64(lp[rows], ref[rows], opts.get("kl_estimator", "k3"), c)
        hit = _near(kl.tolist() + (ref[rows] - lp[rows]).tolist(), [-c, c, -20.0, 20.0])
        if hit is not None:
            return f"KL {hit} at its clamp"
    return None


def near_sampling_tie(built, opts: dict) -> str | None:
    """Why the sampler's kept set (sampling_top_p / _min_p) could differ between float32 and
    float64, or None: a row whose top-p mass above some token, or whose probability ratio to the
    largest, lies within rounding of the bound. A soft-cap saturates many logits to one float32
    value (top_p = 0.8 over five equal ones is then exactly on the bound)."""
    top_p, min_p = opts.get("sampling_top_p"), opts.get("sampling_min_p")
    if top_p is None and min_p is None:
        return None
    z = built.logits64.reshape(-1, built.logits64.shape[-1]) * opts.get("logit_scale", 1.0)
    if opts.get("logit_softcap") is not None:
        z = opts["logit_softcap"] * torch.tanh(z / opts["logit_softcap"])
    z = z / opts.get("temperature", 1.0)
    finite = torch.isfinite(z).all(-1)
    z = z[finite]
    if z.numel() == 0:
        return None
    probs = torch.softmax(z, -1)
    if min_p is not None and bool(((probs / probs.amax(-1, keepdim=True) - min_p).abs() < TIE_MARGIN).any()):
        return f"a probability within {TIE_MARGIN} of min_p = {min_p} times its row's largest"
    if top_p is not None:  # over what min_p and top_k keep, renormalised (the sampler's order)
        raw = built.logits64.reshape(-1, built.logits64.shape[-1])[finite]
        kept = reference.sampler_kept(z, opts.get("sampling_top_k"), None, min_p, order=raw)
        ranked = torch.softmax(torch.where(kept, z, -math.inf), -1).sort(-1, descending=True).values
        above = ranked.cumsum(-1) - ranked
        if bool(((above - top_p).abs() < TIE_MARGIN).any()):
            return f"a row's mass above a token within {TIE_MARGIN} of top_p = {top_p}"
    return None
