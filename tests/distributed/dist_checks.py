"""The checks of one distributed case on one rank: the distributed loss on this rank's part
against the single-process loss on the whole problem, computed on the same rank (the loss,
every gradient slice, and the metrics); and the set-up helpers, once per world. Each returns
the failures it saw ([] = passed)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import gspo_kernels as gk
from gspo_kernels.linear import chunked
from gspo_kernels.testing.problem_split import even_parts

from dist_grid import Case
from dist_problems import SEQ_LEN, VOCAB, options_of, per_call, whole_problem
from dist_split import RankView, input_leaves, view_of


def _run(case: Case, p: dict, view: RankView | None, normalizer=None):
    leaves = input_leaves(case, p, view)
    rows = None if view is None else view.rows
    seqs = None if view is None else view.seqs
    token_shape = p["token_shape"] if view is None else view.token_shape
    kw = per_call(case, p, rows, seqs)
    kw = {k: (v.reshape(token_shape) if k != "advantages" else v) for k, v in kw.items()}
    targets = (p["targets"].reshape(-1) if rows is None else p["targets"].reshape(-1)[rows]).reshape(token_shape)
    cu = p["cu_seqlens"] if view is None else view.cu_seqlens
    groups = {} if view is None else dict(view.groups)
    opts = options_of(case)
    linear_kw = {}
    if case.linear:
        linear_kw = {"bias": leaves["bias"], "chunk_size": 5, "fused": case.fused}
        if case.sweep != "auto" and case.entry != "selective":  # a forced sweep: two passes (the loss's default is one)
            linear_kw["schedule"] = "two_pass"
        if view is not None and "tp_group" in groups:
            linear_kw["reduce_hidden_grad"] = dict(case.options).get("reduce_hidden_grad", True)
    if case.entry == "selective":
        tp = {k: groups[k] for k in ("tp_group", "vocab_start") if k in groups}
        # A soft-cap here: the vocab slices' one-hot fix-up (slice_grad.py) then runs through its slope.
        sel_kw = dict(temperature=0.9, return_entropy=True, backend=case.backend, mask=kw["mask"], logit_softcap=4.0,
                      **tp)
        if case.linear:
            logp, ent = gk.fused_linear_selective_log_softmax(leaves["hidden"], leaves["weight"], targets,
                                                              **linear_kw, **sel_kw)
        else:
            logp, ent = gk.selective_log_softmax(leaves["logits"], targets, **sel_kw)
        # A fixed mix of both outputs, every entry weighted differently.
        weights = torch.linspace(0.5, 1.5, logp.numel(), dtype=torch.float32).reshape(logp.shape)
        loss = (torch.where(kw["mask"], logp * weights + 0.3 * ent, torch.zeros_like(logp))).sum()
        metrics = {"token_logprobs": logp.detach(), "entropy": ent.detach()}
    else:
        if cu is not None:
            kw["cu_seqlens"] = cu
        if normalizer is not None:
            kw["normalizer"] = normalizer
        adv = kw.pop("advantages")
        old = kw.pop("old_logprobs")
        if case.linear:
            loss, metrics = gk.fused_linear_gspo_loss(leaves["hidden"], leaves["weight"], targets, old, adv,
                                                      **linear_kw, **kw, **groups, **opts)
        else:
            loss, metrics = gk.gspo_loss(leaves["logits"], targets, old, adv, **kw, **groups, **opts)
    with _forced_sweep(case.sweep):
        loss.backward()
    return loss.detach(), metrics, {k: v.grad for k, v in leaves.items()}


@contextlib.contextmanager
def _forced_sweep(sweep: str):
    """fused linear's backward sweep forced for one backward (and checked to have been chosen)."""
    if sweep == "auto":
        yield
        return
    calls = []
    original = chunked.choose_sweep
    chunked.choose_sweep = lambda *args: calls.append(args) or sweep
    try:
        yield
    finally:
        chunked.choose_sweep = original
    assert calls, "the forced sweep was never asked for"


# --- checks ------------------------------------------------------------------------------------

def _tolerance(case: Case) -> tuple[float, float]:
    return {"float64": (1e-10, 1e-12), "float32": (2e-5, 2e-6), "bfloat16": (2e-2, 1e-3)}[case.dtype]


def _close(name: str, got: torch.Tensor, want: torch.Tensor, tol) -> list[str]:
    rtol, atol = tol
    if got.shape != want.shape:
        return [f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"]
    g, w = got.double(), want.double()
    if torch.allclose(g, w, rtol=rtol, atol=atol, equal_nan=True):
        return []
    bad = ~torch.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
    diff = (g - w).abs().nan_to_num(float("inf"))[bad].max().item()
    return [f"{name}: {int(bad.sum())} of {g.numel()} entries differ, worst |diff| {diff:.3g}"]


def _slice_rows(t: torch.Tensor, view: RankView, per_row_shape: tuple) -> torch.Tensor:
    flat = t.reshape(-1, *per_row_shape)
    return flat if view.rows is None else flat[view.rows]


def _grad_slice(case: Case, name: str, whole: torch.Tensor, view: RankView) -> torch.Tensor:
    if name == "logits":
        g = _slice_rows(whole, view, (whole.shape[-1],))
        return g if view.vocab is None else g[:, view.vocab[0]:view.vocab[1]]
    if name == "hidden":
        return _slice_rows(whole, view, (whole.shape[-1],))
    return whole if view.vocab is None else whole[view.vocab[0]:view.vocab[1]]


def check_case(case: Case, rank: int, world: int, groups: dict, seed: int) -> list[str]:
    vocab = VOCAB - 1 if case.even_vocab else VOCAB
    p = whole_problem(case, vocab, seed, world)
    tol = _tolerance(case)
    view = view_of(case, p, rank, world, groups, vocab)
    normalizer = None
    dp_group = groups["tp"] if case.split == "dpcp" else groups["dp"]  # dpcp: dp pairs {0, 1}, {2, 3}
    if case.split in ("dp", "dpcp") and case.loss_agg != "token-sum" and case.entry == "loss":
        local_mask = p["mask"].reshape(-1)[view.rows].reshape(view.token_shape)
        normalizer = gk.distributed.global_normalizer(local_mask, case.loss_agg, dp_group,
                                                      cu_seqlens=view.cu_seqlens,
                                                      cp_group=groups["cp"] if case.split == "dpcp" else None)
    whole_loss, whole_metrics, whole_grads = _run(case, p, None)
    loss, metrics, grads = _run(case, p, view, normalizer)
    failures = []
    if case.split in ("dp", "dpcp"):
        # Each dp rank's loss is its share: the shares sum to the whole loss.
        total = loss.clone()
        dist.all_reduce(total, group=dp_group)
        failures += _close("loss (sum over dp ranks)", total, whole_loss, tol)
    else:
        failures += _close("loss", loss, whole_loss, tol)
    for name, grad in grads.items():
        want = _grad_slice(case, name, whole_grads[name], view)
        if name in ("weight", "bias") and case.split in ("cp", "tpcp", "dp"):
            # Each rank's tokens give their part of the lm_head gradient: the parts sum to it.
            grad = grad.clone()
            dist.all_reduce(grad, group=groups["dp" if case.split == "dp" else "cp"])
        if name == "hidden" and case.split in ("tp", "tpcp") and not dict(case.options).get("reduce_hidden_grad", True):
            grad = grad.clone()
            dist.all_reduce(grad, group=groups["tp"])
        failures += _close(f"d {name}", grad.reshape(want.shape), want, tol)
    if case.split not in ("dp", "dpcp"):  # data-parallel metrics are each rank's own
        for name, value in whole_metrics.items():
            got = metrics.get(name)
            if got is None:
                failures.append(f"metric {name} missing")
                continue
            if name == "fused_linear_one_pass":  # which schedule ran: two passes under cp_group, one without
                expected = 0.0 if "cp" in case.split else value.item()
                if got.item() != expected:
                    failures.append(f"metric {name}: {got.item()}, expected {expected}")
                continue
            if name in ("token_logprobs", "entropy"):
                value = _slice_rows(value, view, ())
                got = got.reshape(-1)
            failures += _close(f"metric {name}", got, value, tol)
    return failures


# --- set-up helpers, checked once per world ------------------------------------------------------

def _expect_error(what: str, fn, *args, **kwargs) -> list[str]:
    try:
        fn(*args, **kwargs)
    except ValueError:
        return []
    return [f"{what}: no ValueError"]


def check_setup_helpers(rank: int, world: int, groups: dict) -> list[str]:
    """check_vocab_split on good and bad splits; global_normalizer against the whole count."""
    failures = []
    tp = groups["tp"]
    tp_world, tp_rank = dist.get_world_size(tp), dist.get_rank(tp)
    start, stop = even_parts(VOCAB, tp_world)[tp_rank]
    got = gk.distributed.check_vocab_split(tp, stop - start, start, vocab_size=VOCAB)
    if got != VOCAB:
        failures.append(f"check_vocab_split returned {got}, not {VOCAB}")
    if gk.distributed.check_vocab_split(tp, 12) != 12 * tp_world:
        failures.append("check_vocab_split with the default (equal) slices")
    failures += _expect_error("a gap", gk.distributed.check_vocab_split, tp, 10, start)
    failures += _expect_error("an overlap", gk.distributed.check_vocab_split, tp, stop - start + 1, start)
    failures += _expect_error("a wrong vocab_size", gk.distributed.check_vocab_split, tp, stop - start, start,
                              vocab_size=VOCAB + 1)
    # global_normalizer: two micro-batches per rank, every rank's rows of one whole batch each.
    gen = torch.Generator().manual_seed(7)
    whole = [torch.rand(world * 3, SEQ_LEN, generator=gen) < 0.3 for _ in range(2)]
    mine = [m[rank * 3:(rank + 1) * 3] for m in whole]
    for agg, want in (("token-mean", sum(int(m.sum()) for m in whole)),
                      ("seq-mean-token-sum", sum(int(m.any(1).sum()) for m in whole))):
        got = gk.distributed.global_normalizer(mine, agg, groups["dp"])
        if float(got) != max(want, 1):
            failures.append(f"global_normalizer({agg}) = {float(got)}, whole count {want}")
        averaged = gk.distributed.global_normalizer(mine, agg, groups["dp"], averaged_grads=True)
        if abs(float(averaged) - max(want, 1) / world) > 1e-6:
            failures.append(f"global_normalizer({agg}, averaged_grads=True) = {float(averaged)}")
    packed = [m.reshape(-1) for m in mine]
    cus = [torch.arange(0, 3 * SEQ_LEN + 1, SEQ_LEN)] * 2
    got = gk.distributed.global_normalizer(packed, "seq-mean-token-mean", groups["dp"], cu_seqlens=cus)
    want = max(sum(int(m.any(1).sum()) for m in whole), 1)
    if float(got) != want:
        failures.append(f"global_normalizer, packed = {float(got)}, whole count {want}")
    return failures
