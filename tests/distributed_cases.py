"""The multi-process cases of test_distributed.py: each one cuts a whole GSPO problem the way
a split (tp, cp, tp x cp, dp) holds it, runs the distributed loss on every rank, and checks
it against the single-process loss on the whole problem, computed on the same rank: the loss,
every gradient slice, and the metrics. Run by spawned workers over gloo; each rank records
the failures it saw per case, and the parent turns them into one pytest case each."""

from __future__ import annotations

import contextlib
import json
import os
import traceback
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist

import gspo_kernels as gk
from gspo_kernels.linear import chunked
from gspo_kernels.distributed.problem_split import context_part, data_part, even_parts

LEVELS = ("sequence", "sequence_token", "token")
LOSS_AGGS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")
BATCH, SEQ_LEN, VOCAB, HIDDEN = 4, 7, 37, 8
PACKED_LENGTHS = (6, 1, 0, 9, 5)  # 1 and 0: some rank holds an empty part, or nothing at all


@dataclass(frozen=True)
class Case:
    split: str  # tp, cp, tpcp, dp
    layout: str = "padded"  # or packed
    level: str = "sequence"
    loss_agg: str = "seq-mean-token-mean"
    backend: str = "cpu"
    dtype: str = "float32"
    linear: bool = False  # fused linear from hidden states and the lm_head weight
    even_vocab: bool = False  # V divisible by the tp size, default vocab_start
    entry: str = "loss"  # or selective (selective_log_softmax with entropy)
    edges: bool = False  # rows that stress the vocab-parallel merge (selective, padded only)
    fused: bool = False  # fused linear through the Triton tile kernels (fused=True)
    sweep: str = "auto"  # fused linear's backward sweep (rows or vocab), forced; auto: choose_sweep's
    options: tuple = field(default_factory=tuple)  # extra GSPOConfig options, (key, value) pairs

    @property
    def id(self) -> str:
        parts = [self.split, self.layout, self.level, self.loss_agg, self.backend, self.dtype]
        if self.linear:
            parts.append("linear")
        if self.even_vocab:
            parts.append("even_vocab")
        if self.entry != "loss":
            parts.append(self.entry)
        if self.edges:
            parts.append("edges")
        if self.sweep != "auto":
            parts.append(f"sweep_{self.sweep}")
        if self.fused:
            parts.append("fused")
        parts += [f"{k}={v}" for k, v in self.options]
        return "-".join(parts)


def _cpu_backends() -> tuple[str, ...]:
    """Backends that run on CPU tensors here: Triton only through its interpreter."""
    triton = gk.backends.triton_backend
    return ("torch", "triton") if triton is not None and triton.INTERPRETED else ("torch",)


def cases(world: int) -> list[Case]:
    """The grid for one world size (4 is the 2 x 2 tp x cp mesh)."""
    extra_backends = _cpu_backends()
    if world == 4:
        grid = [Case("tpcp", layout, level, agg) for layout in ("padded", "packed") for level in LEVELS
                for agg in LOSS_AGGS]
        grid += [Case("tpcp", layout, linear=True) for layout in ("padded", "packed")]
        grid += [Case("tpcp", "packed", backend=b) for b in extra_backends]
        grid += [Case("tpcp", "padded", dtype="bfloat16"), Case("tpcp", "packed", options=EXTRA_OPTIONS[0]),
                 Case("tpcp", "packed", options=EXTRA_OPTIONS[5])]
        grid += [Case("dpcp", layout, level, agg) for layout in ("padded", "packed") for level in ("sequence", "token")
                 for agg in ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")]
        return grid
    grid = []
    for split in ("tp", "cp", "dp"):
        grid += [Case(split, layout, level, agg) for layout in ("padded", "packed") for level in LEVELS
                 for agg in LOSS_AGGS]
        grid += [Case(split, layout, level, backend=b, dtype="float64" if b == "torch" else "float32")
                 for layout in ("padded", "packed") for level in LEVELS for b in extra_backends]
        grid += [Case(split, layout, linear=True, loss_agg=agg) for layout in ("padded", "packed")
                 for agg in ("seq-mean-token-mean", "token-mean")]
        grid += [Case(split, "packed", options=opts) for opts in EXTRA_OPTIONS]
    grid += [Case("tp", "padded", even_vocab=True), Case("tp", "packed", even_vocab=True, linear=True),
             Case("tp", "padded", dtype="bfloat16"),
             *[Case("tp", "padded", backend=b, dtype="bfloat16") for b in extra_backends if b == "triton"],
             Case("tp", "padded", entry="selective"), Case("tp", "packed", entry="selective", linear=True),
             Case("tp", "padded", linear=True, options=(("reduce_hidden_grad", False),)),
             Case("tp", "padded", options=(("inplace", True),)), Case("tp", "packed", linear=True, dtype="bfloat16")]
    # The vocab sweep's blocks nested in a rank's vocab slice (tp alone picks rows at these sizes),
    # and the rows sweep where a cp rank's few rows would pick vocab.
    grid += [Case("tp", "packed", linear=True, sweep="vocab"),
             Case("tp", "padded", linear=True, entry="selective", sweep="vocab"),
             Case("tp", "padded", linear=True, options=(("reduce_hidden_grad", False),), sweep="vocab"),
             Case("cp", "packed", linear=True, sweep="rows")]
    grid += [Case("tp", "padded", backend=b, dtype="float64" if b == "torch" else "float32", entry="selective",
                  edges=True) for b in ("cpu",) + extra_backends]
    if "triton" in extra_backends:  # the tile kernels with vocab slices (and their one-hot rule)
        grid += [Case(split, "packed", linear=True, backend="triton", fused=True) for split in ("tp", "cp")]
        grid += [Case("tp", "padded", linear=True, backend="triton", fused=True, entry="selective")]
    return grid


EXTRA_OPTIONS = (
    (("objective", "gmpo"),),
    (("objective", "cispo"), ("level", "token")),
    (("objective", "sapo"),),
    (("beta", 0.1), ("kl_estimator", "k3")),
    (("entropy_coef", 0.01), ("temperature", 0.7)),
    (("rollout_correction", "sequence-truncate"), ("rollout_sequence_weight", "product")),
    (("off_policy_mask_threshold", 0.05),),
)


# --- the whole problem -------------------------------------------------------------------------

def _stress_rows(p: dict, vocab: int, world: int) -> None:
    """Rows of sequence 0 that stress the merge across the ranks' vocab slices; the first rank's
    slice is [0, first)."""
    first = even_parts(vocab, world)[0][1]
    logits, targets, mask = p["logits"], p["targets"], p["mask"]
    row = logits[0]
    mask[0, :6] = True
    targets[0, :6] = torch.tensor([first + 1, first + 2, 1, 2, vocab + 3, first])
    row[0, :first] = 130.0  # the target's slice lies ~130 below the peak: its weight underflows
    row[1, :first] = float("-inf")  # a slice with no mass
    row[2, :first] = float("-inf")  # ... holding the target: logp = -inf
    row[3, 0] = float("nan")  # a NaN logit in the loss: NaN log-prob, NaN gradient row
    row[4, :] = row[4, :] * 3  # a target outside the global vocab: NaN log-prob and gradient row
    row[5, first + 2] = float("inf")  # +inf on another rank's slice than the target's
    mask[0, 6] = False
    row[6, 1] = float("nan")  # outside the loss: zeros, whatever it holds


def _whole_problem(case: Case, vocab: int, seed: int, world: int = 2) -> dict:
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    if case.layout == "padded":
        token_shape, cu, num_seqs = (BATCH, SEQ_LEN), None, BATCH
        mask = torch.rand(token_shape, generator=gen) < 0.8
        mask[:, :2] = False  # a prompt: rank 0's first columns are outside the loss
        mask[1, : SEQ_LEN // 2 + 1] = False  # sequence 1 has no response token on rank 0's part
        mask[3] = False  # an empty sequence
    else:
        lengths = torch.tensor(PACKED_LENGTHS)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        token_shape, num_seqs = (int(cu[-1]),), len(PACKED_LENGTHS)
        mask = torch.rand(token_shape, generator=gen) < 0.85
    targets = torch.randint(0, vocab, token_shape, generator=gen)
    targets = torch.where(mask, targets, torch.full_like(targets, -100))  # pad ids outside the loss
    p = {"token_shape": token_shape, "cu_seqlens": cu, "num_seqs": num_seqs, "mask": mask, "targets": targets,
         "advantages": torch.randn(num_seqs, generator=gen, dtype=torch.float64).float()}
    if case.linear:
        p["hidden"] = torch.randn(*token_shape, HIDDEN, generator=gen).to(dtype)
        p["weight"] = (torch.randn(vocab, HIDDEN, generator=gen) * 0.7).to(dtype)
        p["bias"] = (torch.randn(vocab, generator=gen) * 0.3).to(dtype)
        logits = (p["hidden"].double() @ p["weight"].double().T + p["bias"].double())
    else:
        logits = torch.randn(*token_shape, vocab, generator=gen, dtype=torch.float64) * 2.0
        p["logits"] = logits.to(dtype)
    if case.edges:
        _stress_rows(p, vocab, world)
        logits = p["logits"].double()
    # Old, reference and rollout log-probs near the current ones: ratios inside and outside
    # the clip range, none on its edge.
    current = torch.log_softmax(logits, -1).gather(-1, targets.clamp(0, vocab - 1).unsqueeze(-1)).squeeze(-1)
    for name, scale in (("old_logprobs", 0.08), ("ref_logprobs", 0.2), ("rollout_logprobs", 0.05)):
        p[name] = (current + torch.randn(token_shape, generator=gen, dtype=torch.float64) * scale).float()
    return p


def _options(case: Case) -> dict:
    opts = dict(level=case.level, loss_agg=case.loss_agg, backend=case.backend, eps_low=0.02, eps_high=0.03)
    opts.update(case.options)
    opts.pop("reduce_hidden_grad", None)
    if case.loss_agg == "seq-mean-token-sum-norm":
        opts["max_len"] = SEQ_LEN if case.layout == "padded" else max(PACKED_LENGTHS)
    return opts


def _per_call(case: Case, p: dict, rows=None, seqs=None) -> dict:
    """gspo_loss's tensor keywords for the whole problem, or for some rows and sequences."""
    def take(name):
        t = p[name].reshape(-1)
        return t if rows is None else t[rows]
    kw = {"old_logprobs": take("old_logprobs"), "mask": take("mask")}
    opts = dict(case.options)
    if opts.get("beta", 0) > 0:
        kw["ref_logprobs"] = take("ref_logprobs")
    if "rollout_correction" in opts or "off_policy_mask_threshold" in opts:
        kw["rollout_logprobs"] = take("rollout_logprobs")
    kw["advantages"] = p["advantages"] if seqs is None else p["advantages"][seqs[0]:seqs[1]]
    return kw


# --- one rank's view ---------------------------------------------------------------------------

@dataclass
class RankView:
    """What this rank feeds the loss, and how to cut the whole problem's results to match."""

    rows: torch.Tensor | None  # the whole problem's rows this rank holds (None: all)
    token_shape: tuple
    cu_seqlens: torch.Tensor | None
    vocab: tuple[int, int] | None  # [start, stop) of V (None: all)
    seqs: tuple[int, int] | None = None  # dp: the sequences this rank holds
    groups: dict = field(default_factory=dict)


def _view(case: Case, p: dict, rank: int, world: int, groups: dict, vocab: int) -> RankView:
    tp_rank, cp_rank = rank, rank
    tp_world, cp_world = world, world
    if case.split == "tpcp":
        tp_world = cp_world = 2
        tp_rank, cp_rank = rank % 2, rank // 2
    view = RankView(None, p["token_shape"], p["cu_seqlens"], None)
    if case.split in ("tp", "tpcp"):
        view.vocab = even_parts(vocab, tp_world)[tp_rank]
        view.groups["tp_group"] = groups["tp"]
        if not case.even_vocab:
            view.groups["vocab_start"] = view.vocab[0]
    if case.split in ("cp", "tpcp"):
        part = context_part(cp_rank, cp_world, BATCH, SEQ_LEN, p["cu_seqlens"])
        view.rows, view.cu_seqlens = part.rows, part.cu_seqlens
        view.token_shape = (BATCH, part.columns[1] - part.columns[0]) if part.columns else (part.rows.numel(),)
        view.groups["cp_group"] = groups["cp"]
    if case.split in ("dp", "dpcp"):
        dp_rank, dp_world = (rank % 2, 2) if case.split == "dpcp" else (rank, world)
        part, view.seqs = data_part(dp_rank, dp_world, BATCH, SEQ_LEN, p["cu_seqlens"])
        view.rows, view.cu_seqlens = part.rows, part.cu_seqlens
        n_seqs = view.seqs[1] - view.seqs[0]
        view.token_shape = (n_seqs, SEQ_LEN) if case.layout == "padded" else (part.rows.numel(),)
        if case.split == "dpcp":  # then this rank's part of each of those sequences
            sub = context_part(rank // 2, 2, n_seqs, SEQ_LEN, view.cu_seqlens)
            view.rows, view.cu_seqlens = part.rows[sub.rows], sub.cu_seqlens
            view.token_shape = (n_seqs, sub.columns[1] - sub.columns[0]) if sub.columns else (sub.rows.numel(),)
            view.groups["cp_group"] = groups["cp"]
    return view


def _leaves(case: Case, p: dict, view: RankView | None) -> dict:
    """The differentiable inputs, cut to this rank (view) or whole (None), as fresh leaves."""
    def rows_of(t):
        flat = t.reshape(-1, t.shape[-1])
        if view is None:
            return t
        flat = flat if view.rows is None else flat[view.rows]
        return flat.reshape(*view.token_shape, t.shape[-1])
    def vocab_of(t, dim):
        if view is None or view.vocab is None:
            return t
        return t.narrow(dim, view.vocab[0], view.vocab[1] - view.vocab[0])
    if case.linear:
        out = {"hidden": rows_of(p["hidden"]), "weight": vocab_of(p["weight"], 0), "bias": vocab_of(p["bias"], 0)}
    else:
        out = {"logits": vocab_of(rows_of(p["logits"]), -1)}
    return {k: v.detach().clone().requires_grad_(True) for k, v in out.items()}


def _run(case: Case, p: dict, view: RankView | None, normalizer=None):
    leaves = _leaves(case, p, view)
    rows = None if view is None else view.rows
    seqs = None if view is None else view.seqs
    token_shape = p["token_shape"] if view is None else view.token_shape
    kw = _per_call(case, p, rows, seqs)
    kw = {k: (v.reshape(token_shape) if k != "advantages" else v) for k, v in kw.items()}
    targets = (p["targets"].reshape(-1) if rows is None else p["targets"].reshape(-1)[rows]).reshape(token_shape)
    cu = p["cu_seqlens"] if view is None else view.cu_seqlens
    groups = {} if view is None else dict(view.groups)
    opts = _options(case)
    linear_kw = {}
    if case.linear:
        linear_kw = {"bias": leaves["bias"], "chunk_size": 5, "fused": case.fused}
        if view is not None and "tp_group" in groups:
            linear_kw["reduce_hidden_grad"] = dict(case.options).get("reduce_hidden_grad", True)
    if case.entry == "selective":
        tp = {k: groups[k] for k in ("tp_group", "vocab_start") if k in groups}
        sel_kw = dict(temperature=0.9, return_entropy=True, backend=case.backend, mask=kw["mask"], **tp)
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
    p = _whole_problem(case, vocab, seed, world)
    tol = _tolerance(case)
    view = _view(case, p, rank, world, groups, vocab)
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


SETUP_CASE = "setup-helpers"


# --- the worker --------------------------------------------------------------------------------

def _groups(rank: int, world: int) -> dict:
    """The process groups of the splits; every rank creates every group, in the same order."""
    groups = {"dp": dist.group.WORLD}
    if world == 4:  # 2 x 2 mesh: tp pairs {0, 1}, {2, 3}; cp pairs {0, 2}, {1, 3}
        tp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        cp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        groups["tp"], groups["cp"] = tp[rank // 2], cp[rank % 2]
    else:
        groups["tp"] = groups["cp"] = dist.group.WORLD
    return groups


def worker(rank: int, world: int, init_file: str, out_dir: str, only=None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    groups = _groups(rank, world)
    results = {}
    for index, case in enumerate(cases(world)):
        if only is not None and not any(key in case.id for key in only):
            continue
        try:
            failures = check_case(case, rank, world, groups, seed=1000 + index)
        except Exception:  # recorded, so one broken case does not hide the others
            failures = [traceback.format_exc(limit=6)]
        results[case.id] = failures
    if only is None or any(key in SETUP_CASE for key in only):
        try:
            results[SETUP_CASE] = check_setup_helpers(rank, world, groups)
        except Exception:
            results[SETUP_CASE] = [traceback.format_exc(limit=6)]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def run_world(world: int, tmp_dir: str, only=None) -> dict[str, list[str]]:
    """Spawns `world` workers; returns each case's failures, over all ranks ([] = passed).
    only: substrings of case ids, to run a few while debugging."""
    import torch.multiprocessing as mp

    init_file = os.path.join(tmp_dir, "init")
    mp.spawn(worker, args=(world, init_file, tmp_dir, only), nprocs=world, join=True)
    merged: dict[str, list[str]] = {}
    for rank in range(world):
        with open(os.path.join(tmp_dir, f"rank{rank}.json")) as f:
            for case_id, failures in json.load(f).items():
                merged.setdefault(case_id, []).extend(f"rank {rank}: {m}" for m in failures)
    return merged


__all__ = ["Case", "cases", "run_world", "replace"]
