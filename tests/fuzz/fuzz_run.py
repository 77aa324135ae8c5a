"""Runs one built FuzzCase through its entry point and through the float64 reference, and lists
every rule the result breaks (fuzz_oracle.py). An empty list means the case passed.

The reference always sees the same tensors (same views, same dtypes for the per-token inputs)
with the logits upcast to float64: `gk.reference.gspo_loss`, the materialised logits
`hidden @ weight.T + bias` for the fused-linear path, and the reference's own per-token
log-softmax (`_token_logprobs_and_entropy`) for selective_log_softmax and, chained to the
logits, for policy_loss. An exception from the code under test on a valid input is a failure
(a crash is not a clear error); one from the reference is reported as such.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

import gspo_kernels as gk
from gspo_kernels import backends
from gspo_kernels.testing import reference
from gspo_kernels.testing.verify import Tolerance

from fuzz_build import Built, build
from fuzz_case import FuzzCase
from fuzz_leniency import (bad_rows, kl_precision, log_prob_scale, loss_precision,
                           overflow_rows, poisoned_rows, precision_rows)
from fuzz_oracle import check_ranges, check_zero_rows, compare, compare_metrics, loss_floor, stats_floor


class ReferenceFailed(Exception):
    """The float64 reference itself raised on this problem."""


class UnderTestFailed(Exception):
    """The entry point under test raised on a valid input (forward or backward)."""


def _under_test(thunk):
    try:
        return thunk()
    except Exception as exc:  # noqa: BLE001 - a crash on valid input is itself the finding
        raise UnderTestFailed(f"{type(exc).__name__}: {exc}") from exc


@contextlib.contextmanager
def _triton_block(case: FuzzCase):
    """Triton's vocab block forced small (as tests/conftest.py's small_blocks), so that a row of
    V <= 70 spans several blocks and the multi-block paths run."""
    triton = backends.triton_backend
    if case.backend != "triton" or case.triton_block_v is None or triton is None:
        yield
        return
    old = triton.block_v_override
    triton.block_v_override = case.triton_block_v
    try:
        yield
    finally:
        triton.block_v_override = old


def _same(a, b) -> bool:
    if a is None or not isinstance(a, torch.Tensor):
        return True
    if a.dtype.is_floating_point:
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


def _inputs(built: Built) -> dict:
    return {"target_ids": built.targets, "mask": built.mask, "old_logprobs": built.old,
            "advantages": built.advantages, "ref_logprobs": built.ref, "rollout_logprobs": built.rollout}


def _snapshot(built: Built) -> dict:
    return {k: v.clone() for k, v in _inputs(built).items() if isinstance(v, torch.Tensor)}


def _check_untouched(failures: list, built: Built, before: dict) -> None:
    for name, value in _inputs(built).items():
        if name in before and not _same(value, before[name]):
            failures.append(f"{name} was modified by the call")


def _reference_loss(built: Built, logits64, opts: dict):
    ref_opts = {k: v for k, v in opts.items() if k != "backend"}
    kwargs = built.call_kwargs(reference=True)
    try:
        return reference.gspo_loss(logits64, built.targets, built.old, built.advantages, **kwargs, **ref_opts)
    except Exception as exc:  # say whose exception it is: the reference's, not the code under test's
        raise ReferenceFailed(f"{type(exc).__name__}: {exc}") from exc


@contextlib.contextmanager
def _upstream_of_reference():
    """The reference's d loss / d log-prob and d loss / d entropy per row, read by keeping the
    gradients of what its `_token_logprobs_and_entropy` returns (the reference is not changed:
    its module attribute is wrapped for the duration of the call and restored)."""
    original = reference._token_logprobs_and_entropy
    seen = {}

    def keeping(*args, **kwargs):
        lp, ent = original(*args, **kwargs)
        for t in (lp, ent):
            if t.requires_grad:
                t.retain_grad()
        seen["lp"], seen["ent"] = lp, ent
        return lp, ent

    reference._token_logprobs_and_entropy = keeping
    try:
        yield seen
    finally:
        reference._token_logprobs_and_entropy = original


def _precision(built: Built, seen: dict) -> torch.Tensor:
    lp, ent = seen.get("lp"), seen.get("ent")
    return precision_rows(built, None if lp is None else lp.grad, None if ent is None else ent.grad)


def _backward(loss, *leaves):
    if loss.requires_grad:
        loss.backward()
    return [None if t is None else (t.grad if t.grad is not None else torch.zeros_like(t)) for t in leaves]


def _tolerance(built: Built, dtype) -> Tolerance:
    """verify.py's tolerances, sized for log-probs of magnitude ~10: a float32 log-prob is good
    to ~1e-7 of its magnitude in absolute terms, and a ratio exp(lp - old) (or a KL with the
    bias correction) turns that absolute error into a relative one, so peaked rows at a low
    temperature (|lp| up to ~60 here) get a proportionally wider limit."""
    tol = Tolerance.for_dtype(dtype, built.options.get("objective", "clip"))
    grow = max(1.0, log_prob_scale(built) / 16.0)
    return replace(tol, loss=tol.loss * grow, stats=tol.stats * grow, grad=tol.grad * grow)


def _check_loss_and_metrics(failures, built, loss, metrics, ref_loss, ref_metrics, tol, seen, skip=()):
    # The loss may be NaN where a non-finite input reaches it even if the reference's is finite
    # (its torch.where drops a NaN term that entropy or off-policy selection discards), and it
    # must be NaN when a response row is bad: docs/semantics.md says so whatever the options.
    poisoned = torch.tensor(bool(poisoned_rows(built).any()))
    d_lp = seen["lp"].grad if seen.get("lp") is not None else None
    compare(failures, "loss", loss, ref_loss, tol.loss, floor=loss_floor(built, built.options), allow_nan=poisoned,
            atol=loss_precision(built, d_lp))
    bad = bad_rows(built)
    if bad.any() and not torch.isnan(loss.detach()).item():
        failures.append(f"loss = {float(loss)!r} is finite though response rows {bad.nonzero().flatten()[:4].tolist()} "
                        f"are bad (NaN/+inf logit, all -inf row or out-of-range id: docs say the loss is NaN)")
    compare_metrics(failures, metrics, ref_metrics, tol, skip=skip, atols={"kl": kl_precision(built)})
    check_ranges(failures, metrics, ref_metrics)


def _rows_of(view_grad: torch.Tensor, built: Built) -> torch.Tensor:
    return view_grad.reshape(-1, view_grad.shape[-1])


def run_gspo_loss(built: Built) -> list[str]:
    case, opts, failures = built.case, built.options, []
    before = _snapshot(built)
    base = built.base.clone().requires_grad_()
    loss, metrics = _under_test(lambda: gk.gspo_loss(built.view(base), built.targets, built.old, built.advantages,
                                                     backend=case.backend, **built.call_kwargs(), **opts))
    (grad,) = _under_test(lambda: _backward(loss, base))
    _check_untouched(failures, built, before)

    base64 = built.base.double().requires_grad_()
    with _upstream_of_reference() as seen:
        ref_loss, ref_metrics = _reference_loss(built, built.view(base64), opts)
        (ref_grad,) = _backward(ref_loss, base64)
    atol = 2 * float(_precision(built, seen).norm())

    tol = _tolerance(built, built.base.dtype)
    _check_loss_and_metrics(failures, built, loss, metrics, ref_loss, ref_metrics, tol, seen)
    _compare_logits_grad(failures, built, grad, ref_grad, tol, atol=atol)
    return failures


def _row_allowance(built: Built, rows: torch.Tensor) -> torch.Tensor:
    let_off = poisoned_rows(built) | overflow_rows(built)
    return let_off.unsqueeze(-1).expand(rows.shape[0], rows.shape[-1])


def _compare_logits_grad(failures, built: Built, grad, ref_grad, tol, name="grad logits", zero_rows=True,
                         per_sequence=True, atol=0.0) -> None:
    """The gradient rows the entry point saw (its view of the base), then the rest of the base,
    which must be untouched: exactly 0. per_sequence: a loss, whose bad rows may turn their
    whole sequence NaN (Built.poisoned_rows); selective_log_softmax's rows stand alone."""
    rows, ref_rows = _rows_of(built.view(grad), built), _rows_of(built.view(ref_grad), built)
    allow = _row_allowance(built, rows) if per_sequence else None
    compare(failures, name, rows, ref_rows, tol.grad, allow_nan=allow, atol=atol)
    if zero_rows:
        check_zero_rows(failures, name, rows, built.in_response)
    outside = torch.ones(grad.shape, dtype=torch.bool)
    built.view(outside).fill_(False)
    if (grad.detach()[outside] != 0).any():
        failures.append(f"{name}: non-zero gradient outside the view the entry point was given")


def run_fused_linear(built: Built) -> list[str]:
    case, opts, failures = built.case, built.options, []
    before = _snapshot(built)
    leaves = [built.base.clone().requires_grad_(), built.weight.clone().requires_grad_(),
              None if built.bias is None else built.bias.clone().requires_grad_()]
    linear = {"chunk_size": case.chunk_size, "batch_invariant": case.batch_invariant, "schedule": case.schedule}
    if case.fused:
        linear["fused"] = True
    loss, metrics = _under_test(lambda: gk.fused_linear_gspo_loss(
        built.view(leaves[0]), built.weight_view(leaves[1]), built.targets, built.old, built.advantages,
        bias=leaves[2], backend=case.backend, **linear, **built.call_kwargs(), **opts))
    grads = _under_test(lambda: _backward(loss, *leaves))
    _check_untouched(failures, built, before)
    # Which schedule ran (not a reference metric): two passes wherever one is not allowed.
    one_pass = metrics.pop("fused_linear_one_pass").item()
    if one_pass not in (0.0, 1.0) or (one_pass and (case.schedule == "two_pass" or case.batch_invariant or case.fused)):
        failures.append(f"fused_linear_one_pass is {one_pass} with schedule={case.schedule!r}, "
                        f"batch_invariant={case.batch_invariant}, fused={case.fused}")

    refs = [None if t is None else t.detach().double().requires_grad_() for t in leaves]
    logits64 = built.view(refs[0]) @ built.weight_view(refs[1]).t()
    if refs[2] is not None:
        logits64 = logits64 + refs[2]
    with _upstream_of_reference() as seen:
        ref_loss, ref_metrics = _reference_loss(built, logits64, opts)
        ref_grads = _backward(ref_loss, *refs)
    # d hidden = dz @ W, d weight = dz.T @ hidden, d bias = dz summed over rows: dz's allowance
    # times the operand it is multiplied by (Frobenius norms: an upper bound).
    dz = 2 * float(_precision(built, seen).norm())
    hidden = torch.nan_to_num(built.view(refs[0].detach()), nan=0.0, posinf=0.0, neginf=0.0)
    atol = {"grad hidden": dz * float(built.weight.double().norm()), "grad weight": dz * float(hidden.norm()),
            "grad bias": dz * max(1, built.in_response.numel()) ** 0.5}

    tol = _tolerance(built, built.base.dtype)
    _check_loss_and_metrics(failures, built, loss, metrics, ref_loss, ref_metrics, tol, seen)
    _compare_logits_grad(failures, built, grads[0], ref_grads[0], tol, name="grad hidden", atol=atol["grad hidden"])
    # A NaN row of d hidden (a bad row's sequence, or an overflowing one) is a NaN row of dz,
    # which reaches every entry of d weight and d bias through dz.T @ hidden.
    let_off = bool((poisoned_rows(built) | overflow_rows(built)).any())
    limit = tol.grad
    for name, g, rg in zip(("grad weight", "grad bias"), grads[1:], ref_grads[1:]):
        if g is not None:
            compare(failures, name, g, rg, limit, allow_nan=torch.full(g.shape, let_off), atol=atol[name])
    return failures


def run_policy_loss(built: Built) -> list[str]:
    """policy_loss on the reference's own log-probs (rounded to the log-prob dtype). Its gradient
    with respect to them is chained to the logits (through the reference's log-softmax, response
    rows only) and compared with the reference's logits gradient."""
    case, opts, failures = built.case, built.options, []
    pdtype = getattr(torch, case.logprob_dtype)
    lp_in = built.lp64.reshape(built.token_shape).to(pdtype).requires_grad_()
    ent_in = built.ent64.reshape(built.token_shape).to(pdtype).requires_grad_() if case.return_entropy else None
    before = _snapshot(built)
    loss, metrics = _under_test(lambda: gk.policy_loss(lp_in, built.old, built.advantages, entropy=ent_in,
                                                       **built.call_kwargs(), **opts))
    g_lp, g_ent = _under_test(lambda: _backward(loss, lp_in, ent_in))
    _check_untouched(failures, built, before)

    base64 = built.logits64.clone().requires_grad_()
    with _upstream_of_reference() as seen:
        ref_loss, ref_metrics = _reference_loss(built, base64, opts)
        (ref_grad,) = _backward(ref_loss, base64)
    atol = 2 * float(_precision(built, seen).norm())

    keep = built.in_response
    check_zero_rows(failures, "grad logprobs", g_lp.reshape(-1, 1), keep, bitwise=False)
    if g_ent is not None:
        check_zero_rows(failures, "grad entropy", g_ent.reshape(-1, 1), keep, bitwise=False)
    # Chain d loss / d (log-prob, entropy) to the logits, on response rows only (the reference
    # detaches the others, and a NaN logit there would turn 0 * NaN into a NaN row).
    leaf = built.logits64.clone().requires_grad_()
    lp64, ent64 = reference._token_logprobs_and_entropy(leaf, built.targets, 1.0, keep)
    outs, ups = [lp64], [torch.where(keep, g_lp.reshape(-1).double(), 0.0)]
    if g_ent is not None:
        outs.append(ent64)
        ups.append(torch.where(keep, g_ent.reshape(-1).double(), 0.0))
    chained = torch.autograd.grad(outs, leaf, ups, allow_unused=True)[0]
    chained = torch.zeros_like(leaf) if chained is None else chained

    tol = _tolerance(built, pdtype)
    skip = () if case.return_entropy else ("entropy", "entropy_mean")
    _check_loss_and_metrics(failures, built, loss, metrics, ref_loss, ref_metrics, tol, seen, skip=skip)
    rows = _rows_of(chained, built)
    limit = tol.grad
    compare(failures, "grad logits (chained)", rows, _rows_of(ref_grad, built), limit,
            allow_nan=_row_allowance(built, rows), atol=atol)
    return failures


def _sampling(options: dict) -> dict:
    return {k: v for k, v in options.items() if k.startswith("sampling_")}


def run_selective_log_softmax(built: Built) -> list[str]:
    """Log-probs and entropies against float64, and the logits gradient for random upstream
    gradients, some rows of them exactly 0 (a bad row's gradient is NaN whatever its upstream)."""
    case, failures = built.case, []
    temperature = built.options.get("temperature", 1.0)
    gen = torch.Generator().manual_seed(case.seed + 7)
    n = built.in_response.numel()
    g = torch.randn(n, generator=gen, dtype=torch.float64) * (torch.rand(n, generator=gen) > 0.2)
    h = torch.randn(n, generator=gen, dtype=torch.float64) * (torch.rand(n, generator=gen) > 0.2)

    before = _snapshot(built)
    base = built.base.clone().requires_grad_()
    out = _under_test(lambda: gk.selective_log_softmax(
        built.view(base), built.targets, temperature, case.return_entropy, backend=case.backend,
        inplace=built.options.get("inplace", False), mask=built.mask, logit_scale=built.options.get("logit_scale", 1.0),
        logit_softcap=built.options.get("logit_softcap"), kept_tokens=built.kept_tokens, **_sampling(built.options)))
    lp, ent = out if case.return_entropy else (out, None)
    outs, ups = [lp], [g.reshape(built.token_shape).to(lp.dtype)]
    if ent is not None:
        outs.append(ent)
        ups.append(h.reshape(built.token_shape).to(ent.dtype))
    if lp.requires_grad:
        _under_test(lambda: torch.autograd.backward(outs, ups))
    grad = base.grad if base.grad is not None else torch.zeros_like(base)
    _check_untouched(failures, built, before)

    base64 = built.base.double().requires_grad_()
    ref_lp, ref_ent = reference._token_logprobs_and_entropy(built.view(base64), built.targets, temperature,
                                                           built.in_response, built.options.get("logit_scale", 1.0),
                                                           built.options.get("logit_softcap"),
                                                           tuple(_sampling(built.options).get(f"sampling_{k}")
                                                                 for k in ("top_k", "top_p", "min_p")),
                                                           kept_tokens=built.reference_kept)
    ref_outs, ref_ups = [ref_lp], [g]
    if ent is not None:
        ref_outs.append(ref_ent)
        ref_ups.append(h)
    if ref_lp.requires_grad:
        torch.autograd.backward(ref_outs, ref_ups)
    ref_grad = base64.grad if base64.grad is not None else torch.zeros_like(base64)

    tol = _tolerance(built, built.base.dtype)
    compare(failures, "token_logprobs", lp, ref_lp.reshape(built.token_shape), tol.stats,
            floor=stats_floor("token_logprobs", ref_lp))
    if ent is not None:
        compare(failures, "entropy", ent, ref_ent.reshape(built.token_shape), tol.stats,
                floor=stats_floor("entropy", ref_ent))
    atol = 2 * float(precision_rows(built, g, h if ent is not None else None).norm())
    _compare_logits_grad(failures, built, grad, ref_grad, tol, zero_rows=built.mask is not None, per_sequence=False,
                         atol=atol)
    return failures


RUNNERS = {"gspo_loss": run_gspo_loss, "fused_linear": run_fused_linear, "policy_loss": run_policy_loss,
           "selective_log_softmax": run_selective_log_softmax}


def check_built(built: Built) -> list[str]:
    with _triton_block(built.case):
        try:
            return RUNNERS[built.case.entry](built)
        except ReferenceFailed as exc:
            return [f"the reference raised {str(exc).splitlines()[0]}"]
        except UnderTestFailed as exc:
            return [f"{built.case.entry} raised {str(exc).splitlines()[0]}"]


def check_case(case: FuzzCase) -> tuple[Built, list[str]]:
    built = build(case)
    return built, check_built(built)
