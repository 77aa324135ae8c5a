"""The documented rules a result is held to, next to the float64 reference's result.

- NaN placement: an output (the loss, a per-token value, a gradient element) is NaN exactly where
  the reference's is: a NaN never passes as "close", and a finite value never hides a NaN.
- Where the reference's value is beyond the output dtype's range (a ratio e^100 in float32), the
  output must be the matching inf; elsewhere finite values agree to Tolerance.for_dtype
  (gspo_kernels/testing/verify.py: fp32 ~1e-5 relative, 16-bit gradients 1e-2, VESPO 1e-4),
  fractions of tokens to rounding.
- Exact zeros: every gradient row outside the response mask is 0.0, bitwise (not -0.0, not 1e-30).
- Ranges (docs/semantics.md, Metrics): fractions in [0, 1] when finite, entropy_mean >= 0,
  seq_ratio >= 0 and 0 only where the reference's underflows the output dtype.

Where these bend (a NaN sequence, float32's range and precision), the
callers pass allowances from fuzz_leniency.py, each with its reason.
"""

from __future__ import annotations

import math

import torch

from gspo_kernels.testing.verify import Tolerance

# Fractions of tokens or sequences: one token's difference is >= 1/N, so they agree to rounding.
COUNT_METRICS = ("clip_frac", "clip_frac_low", "clip_frac_high", "seq_clip_frac_low", "seq_clip_frac_high",
                 "rollout_masked_frac", "entropy_kept_frac", "off_policy_masked_frac")
COUNT_TOL = 1e-6


def _where(mask: torch.Tensor, limit: int = 4) -> str:
    idx = mask.nonzero().tolist()
    more = f" (+{len(idx) - limit} more)" if len(idx) > limit else ""
    return f"{idx[:limit]}{more}"


def _rounded(ref: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The reference rounded to the output's dtype: where float64 holds e^100 float32 holds inf."""
    if out.dtype.is_floating_point and out.dtype != torch.float64:
        return ref.to(out.dtype).double()
    return ref


def compare(failures: list, name: str, out, ref, tol: float, floor: float = 1e-6, absolute: bool = False,
            allow_nan=None, atol: float = 0.0) -> None:
    """NaN placement, inf placement and closeness of `out` to the float64 `ref`: the norm of the
    difference within tol * max(||ref||, floor) + atol (atol: the float32 precision of the
    inputs to the computation, fuzz_leniency.precision_rows). `allow_nan` (bool, out's shape)
    marks elements that may be NaN where the reference's are finite."""
    if not isinstance(out, torch.Tensor):
        failures.append(f"{name}: not a tensor ({type(out).__name__})")
        return
    o = out.detach().double().cpu()
    r = ref.detach().double().cpu()
    if o.shape != r.shape:
        failures.append(f"{name}: shape {tuple(o.shape)}, reference {tuple(r.shape)}")
        return
    rr = _rounded(r, out.detach().cpu())
    o_nan, r_nan = torch.isnan(o), torch.isnan(r)
    extra = o_nan & ~r_nan
    if allow_nan is not None:
        extra = extra & ~allow_nan.cpu()
    if not torch.equal(o_nan, r_nan):
        if extra.any():
            failures.append(f"{name}: NaN where the reference is finite at {_where(extra)} "
                            f"(reference {r[extra][:3].tolist()})")
        if (r_nan & ~o_nan).any():
            failures.append(f"{name}: finite where the reference is NaN at {_where(r_nan & ~o_nan)} "
                            f"(got {o[r_nan & ~o_nan][:3].tolist()})")
    inf = (torch.isinf(o) | torch.isinf(rr)) & ~o_nan & ~r_nan
    if inf.any() and not torch.equal(o[inf], rr[inf]):
        bad = inf & (o != rr)
        failures.append(f"{name}: inf mismatch at {_where(bad)}: got {o[bad][:3].tolist()}, "
                        f"reference {r[bad][:3].tolist()}")
    ok = ~(o_nan | r_nan | inf)
    if not ok.any():
        return
    diff, scale = (o[ok] - r[ok]), r[ok]
    if out.dtype.is_floating_point:
        # The output dtype's own resolution: float16 holds a gradient of 5e-6 as a subnormal,
        # to 6e-8 absolute (1% of it), whatever the kernel computed before rounding.
        info = torch.finfo(out.dtype)
        atol = atol + info.tiny * info.eps * float(ok.sum()) ** 0.5
    if absolute:
        err, limit = float(diff.abs().max()), tol
    else:
        denom = max(float(scale.norm()), floor)
        err, limit = float(diff.norm()) / denom, tol + atol / denom
    if not err <= limit:
        worst = int(diff.abs().argmax())
        failures.append(f"{name}: error {err:.3g} > {limit:.3g} (worst: got {float(o[ok][worst])!r}, "
                        f"reference {float(r[ok][worst])!r})")


def stats_floor(name: str, ref: torch.Tensor) -> float:
    """The norm below which a statistic is held to an absolute error instead of a relative one.
    Log-probs and entropies: 3e-6 per element (verify.STATS_LIMIT: float32 statistics land at
    1-2e-6), so a peaked row's entropy of 1e-3, which float32 computes as a difference of
    numbers ~10, is not asked for 1e-5 of itself. The KL: 0.1, as verify.run_case holds it."""
    if name == "kl":
        return 0.1
    if name in ("token_logprobs", "entropy", "entropy_mean"):
        return 0.3 * max(1, ref.numel()) ** 0.5
    return 1e-6


def compare_metrics(failures: list, metrics: dict, ref_metrics: dict, tol: Tolerance, skip=(), atols=None) -> None:
    """Every metric the reference gives, present and close; no metric the reference lacks.
    atols: absolute allowances by name (compare's atol)."""
    atols = atols or {}
    want = {k for k in ref_metrics if k not in skip}
    got = {k for k in metrics if k not in skip}
    if want != got:
        failures.append(f"metric keys: missing {sorted(want - got)}, unexpected {sorted(got - want)}")
    for name in sorted(want & got):
        if name in COUNT_METRICS:
            compare(failures, name, metrics[name], ref_metrics[name], COUNT_TOL, absolute=True)
        else:
            # A KL estimate is a signed mean of log-prob differences, known to the float32
            # log-probs' absolute precision: held to that below 0.1 (as verify.run_case does).
            compare(failures, name, metrics[name], ref_metrics[name], tol.stats,
                    floor=stats_floor(name, ref_metrics[name]), atol=atols.get(name, 0.0))


# A float32 mean of fractions may land an ulp or two above 1 (5 * 0.2f = 1.0000001): rounding,
# not a token counted twice. Anything beyond this is.
RANGE_SLACK = 1e-6


def check_ranges(failures: list, metrics: dict, ref_metrics: dict) -> None:
    for name in COUNT_METRICS:
        if name in metrics:
            v = float(metrics[name])
            if math.isfinite(v) and not 0.0 <= v <= 1.0 + RANGE_SLACK:
                failures.append(f"{name} = {v!r} outside [0, 1]")
            if math.isinf(v):
                failures.append(f"{name} = {v!r}")
    if "entropy_mean" in metrics:
        v = float(metrics["entropy_mean"])
        if v < 0:
            failures.append(f"entropy_mean = {v!r} < 0")
    if "seq_ratio" in metrics:
        s = metrics["seq_ratio"].detach().double().cpu()
        if (s < 0).any():
            failures.append(f"seq_ratio negative at {_where(s < 0)}")
        if "seq_ratio" in ref_metrics:
            rr = _rounded(ref_metrics["seq_ratio"].double().cpu(), metrics["seq_ratio"].cpu())
            zero = (s == 0) & (rr != 0)
            if zero.any():
                failures.append(f"seq_ratio 0 at {_where(zero)} where the reference's is {rr[zero][:3].tolist()}")
    for name in ("rollout_is_mean", "rollout_is_max"):
        if name in metrics and float(metrics[name]) < 0:
            failures.append(f"{name} = {float(metrics[name])!r} < 0")


def check_zero_rows(failures: list, name: str, grad: torch.Tensor, keep: torch.Tensor, bitwise: bool = True) -> None:
    """grad (rows, ...) is exactly +0.0 on every row where keep is False (bitwise: -0.0 fails too;
    policy_loss's log-prob and entropy gradients come from autograd's products with the mask,
    where -0.0 = -c * 0 is as exact a zero, so they are checked with bitwise=False)."""
    if grad is None:
        return
    g = grad.detach().cpu()
    if g.numel() == 0:
        return
    rows = g.reshape(keep.numel(), -1)[~keep.cpu()]
    bad = (rows != 0) | (torch.signbit(rows) if bitwise else torch.zeros_like(rows, dtype=torch.bool))
    if bad.any():
        where = (~keep.cpu()).nonzero().flatten()[bad.any(-1)]
        failures.append(f"{name}: rows outside the response not exactly 0.0 at rows {where[:4].tolist()} "
                        f"(values {rows[bad][:3].tolist()})")


def loss_floor(built, opts: dict) -> float:
    """The loss's absolute precision scale (as verify.run_case): 0.1 per term a sum adds without
    dividing by their count, scaled by how much the normalizer shrinks the denominator."""
    resp = built.in_response
    agg = opts.get("loss_agg", "seq-mean-token-mean")
    n_tokens = int(resp.sum())
    lengths = [int(resp[rows].sum()) for rows in built.seq_rows]
    nonempty = sum(1 for n in lengths if n)
    if agg == "token-sum":
        summed, default = n_tokens, 1.0
    elif agg == "seq-mean-token-sum":
        summed, default = max(lengths, default=0), max(nonempty, 1)
    elif agg == "token-mean":
        summed, default = 1, max(n_tokens, 1)
    else:
        summed, default = 1, max(nonempty, 1)
    floor = 0.1 * max(summed, 1)
    if built.normalizer is not None:  # replaces `default` as the denominator
        floor *= max(1.0, default / float(built.normalizer))
    return floor
