"""Turns a FuzzCase into the tensors of one problem, deterministically from its seed.

Order matters and follows the data: the mask and target ids first (in their layouts, since an
expanded layout changes their values), then the logits (or hidden states), their float64
log-probs as the reference computes them, and only then the old log-probs, planned from those
log-probs so that each sequence's ratio lands in its drawn zone (above, below or inside the
clip range, far away, beyond float32's exp range); advantages, reference and rollout log-probs,
and the thresholds that depend on the data (off-policy gap, entropy threshold) last.

A problem within rounding of a kink is flagged (`near_tie`, fuzz_ties.py) and discarded by the
tests; on-policy ties on an eps = 0 bound are exact by construction and kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import gspo_kernels as gk

from gspo_kernels.testing import reference

from fuzz_case import FuzzCase
from fuzz_layouts import lay_out, logits_base
from fuzz_ties import TIE_MARGIN, midpoint_threshold, near_sampling_tie, near_tie, off_policy_gaps

@dataclass
class Built:
    case: FuzzCase
    options: dict  # GSPOConfig keywords, data-derived thresholds resolved
    base: torch.Tensor  # logits (hidden states for fused_linear) buffer; view(base) is the input
    view: object
    logits64: torch.Tensor  # the float64 logits the reference sees (materialised for fused_linear)
    targets: torch.Tensor
    mask: torch.Tensor | None
    in_response: torch.Tensor  # flat bool rows: what the reference counts
    seq_rows: list  # flat row indices of each sequence
    lp64: torch.Tensor  # flat float64 log-probs and entropies, as the reference computes them
    ent64: torch.Tensor
    old: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    ref: torch.Tensor | None = None
    rollout: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    normalizer: object = None
    entropy_threshold: object = None
    weight: torch.Tensor | None = None  # fused_linear: weight base and view, bias
    weight_view: object = None
    bias: torch.Tensor | None = None
    near_tie: str | None = None  # why float32 may fall on the other side of a kink (fuzz_ties.py)
    kept_tokens: object = None  # the engine's kept sets handed to the code under test (KeptTokens)
    reference_kept: object = None  # ... and to the reference: None for the whole vocabulary (plain)

    @property
    def token_shape(self):
        return tuple(self.targets.shape)

    def call_kwargs(self, reference: bool = False) -> dict:
        """The per-call keyword tensors, as gspo_loss (and, reference=True, the reference) take them."""
        out = {"mask": self.mask, "cu_seqlens": self.cu_seqlens, "ref_logprobs": self.ref,
               "rollout_logprobs": self.rollout, "normalizer": self.normalizer,
               "entropy_threshold": self.entropy_threshold,
               "kept_tokens": self.reference_kept if reference else self.kept_tokens}
        return {k: v for k, v in out.items() if v is not None}


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _layout_of(case: FuzzCase, name: str) -> str:
    return dict(case.views).get(name, "contiguous")


def _rows(case: FuzzCase):
    """(token shape, flat response flags, per-sequence flat row lists, cu_seqlens values)."""
    spans = case.spans
    gen = torch.Generator().manual_seed(case.seed + 1)
    if case.packed:
        lengths = [p + r + t for p, r, t in spans]
        n = sum(lengths)
        resp = torch.zeros(n, dtype=torch.bool)
        seq_rows, start = [], 0
        for (p, r, t), length in zip(spans, lengths):
            resp[start + p:start + p + r] = True
            seq_rows.append(list(range(start, start + length)))
            start += length
        cu = [0]
        for length in lengths:
            cu.append(cu[-1] + length)
        shape = (n,)
    else:
        b = len(spans)
        t_len = max([p + r + t for p, r, t in spans], default=0) + case.pad_extra
        resp2 = torch.zeros(b, t_len, dtype=torch.bool)
        for i, (p, r, _) in enumerate(spans):
            resp2[i, p:p + r] = True
        resp = resp2.reshape(-1)
        seq_rows = [list(range(i * t_len, (i + 1) * t_len)) for i in range(b)]
        cu, shape = None, (b, t_len)
    if case.holes:  # drop ~30% of response rows, keeping each span's first so the plan stays
        first = set()
        for rows in seq_rows:
            on = [r for r in rows if resp[r]]
            if on:
                first.add(on[0])
        drop = torch.rand(resp.shape, generator=gen) < 0.3
        for r in range(resp.numel()):
            if drop[r] and r not in first:
                resp[r] = False
    return shape, resp, seq_rows, cu


def _pick_row(rows: list, gen) -> int | None:
    if not rows:
        return None
    return rows[int(torch.randint(0, len(rows), (1,), generator=gen))]


def _inject_ids(case, targets_flat, in_response, gen):
    for kind, place in case.injections:
        rows = [r for r in range(in_response.numel()) if bool(in_response[r]) == (place == "response")]
        row = _pick_row(rows, gen)
        if row is None:
            continue
        if kind == "id_neg":
            targets_flat[row] = -100
        elif kind == "id_big":
            targets_flat[row] = case.vocab + int(torch.randint(0, 3, (1,), generator=gen))


def _kept_sets(case, targets_flat, in_response, logits64, gen):
    """case.kept_sets as a KeptTokens (None for "none"). Rows in the response hold their target (a
    valid id there: the strategies keep bad ids to the padding); padding rows may hold none."""
    if case.kept_sets == "none":
        return None
    rows, vocab = logits64.shape
    sets = []
    for row in range(rows):
        target = int(targets_flat[row])
        valid = 0 <= target < vocab
        if case.kept_sets == "whole":
            ids = list(range(vocab))
        elif case.kept_sets == "singletons":
            ids = [target] if valid else []
        else:
            low = 1 if bool(in_response[row]) else 0
            k = int(torch.randint(low, vocab + 1, (1,), generator=gen))
            if case.kept_sets == "sampler":  # the top k by the logits (NaN rows: any order)
                ids = torch.nan_to_num(logits64[row], nan=0.0).topk(k).indices.tolist()
            else:
                ids = torch.randperm(vocab, generator=gen)[:k].tolist()
            if valid and target not in ids and ids:
                ids[-1] = target
            elif valid and not ids and bool(in_response[row]):
                ids = [target]
        sets.append(ids)
    return gk.KeptTokens.from_lists(sets, vocab)


def _inject_logits(case, rows_values, targets_flat, in_response, gen, fused):
    """Bad values into one row of the (flat) logits, or of the hidden states for fused_linear
    (where only NaN and +inf can be placed: any value of the hidden row reaches every logit).
    fused_linear: response rows only. A NaN hidden row in the padding reaches d weight as
    0 * NaN in the materialised reference's matmul, and docs/fused_linear.md gives no rule."""
    vocab = rows_values.shape[-1]
    for kind, place in case.injections:
        if kind in ("id_neg", "id_big") or (fused and place == "padding"):
            continue
        rows = [r for r in range(in_response.numel()) if bool(in_response[r]) == (place == "response")]
        row = _pick_row(rows, gen)
        if row is None:
            continue
        col = int(torch.randint(0, vocab, (1,), generator=gen))
        target = int(targets_flat[row])
        if fused:
            rows_values[row, col] = float("nan") if kind in ("nan", "row_ninf", "target_banned") else float("inf")
        elif kind == "nan":
            rows_values[row, col] = float("nan")
        elif kind == "pinf":
            rows_values[row, col] = float("inf")
        elif kind == "ninf":  # a banned token that was not sampled: probability 0, zero gradient
            if 0 <= target < vocab and col == target:
                col = (col + 1) % vocab
            if vocab > 1 and not (0 <= target < vocab and col == target):
                rows_values[row, col] = float("-inf")
        elif kind == "row_ninf":
            rows_values[row, :] = float("-inf")
        elif kind == "target_banned" and 0 <= target < vocab:  # the sampled token has logit -inf
            rows_values[row, target] = float("-inf")


def _zone_center(zone: str, lo_b: float, hi_b: float, gen) -> float:
    u = float(torch.rand((), generator=gen, dtype=torch.float64))
    if zone == "inside" and hi_b - lo_b > 8 * TIE_MARGIN:
        return lo_b + (0.2 + 0.6 * u) * (hi_b - lo_b)
    if zone in ("above", "inside"):
        return hi_b + 2e-3 + 0.3 * u
    if zone == "below":
        return lo_b - 2e-3 - 0.3 * u
    if zone == "far_above":
        return 1.0 + 24.0 * u
    if zone == "far_below":
        return -1.0 - 24.0 * u
    return 95.0 + 20.0 * u  # overflow: exp passes float32's range (> 88.7); float64 keeps it


def _plan_old(case, opts, lp64, in_response, seq_rows, gen):
    """old = lp - d, with d's sequence mean in the drawn zone and a zero-mean per-token spread,
    and old <= 0 as a log-prob is: far below the range a ratio goes only as low as the current
    log-prob allows (the old policy was sure of the token), so no exp of old - rollout leaves
    float32's range through an impossible old log-prob."""
    gmpo = opts.get("objective") == "gmpo"
    eps_low, eps_high = opts.get("eps_low", 3e-4), opts.get("eps_high", 4e-4)
    lo_b = -eps_low if gmpo else math.log(1 - eps_low)
    hi_b = eps_high if gmpo else math.log(1 + eps_high)
    noise = torch.randn(lp64.shape, generator=gen, dtype=torch.float64) * 3 - 4
    old = noise.clone()
    for i, rows in enumerate(seq_rows):
        resp = [r for r in rows if in_response[r]]
        if not resp:
            continue
        zone = case.zones[i] if i < len(case.zones) else "inside"
        center = _zone_center(zone, lo_b, hi_b, gen)
        spread = torch.randn(len(resp), generator=gen, dtype=torch.float64) * case.token_spread
        if len(resp) > 1:
            spread -= spread.mean()
        else:
            spread.zero_()
        for r, s in zip(resp, spread.tolist()):
            d = center + s
            old[r] = min(lp64[r] - d, 0.0) if math.isfinite(float(lp64[r])) else noise[r]
    return old.clamp(max=0.0)


def _advantage_rows(case, n_rows, seq_rows, gen):
    """Per-sequence advantages (S,) and, when drawn, per-token ones; zeros included."""
    signs = [case.signs[i] if i < len(case.signs) else 1 for i in range(len(seq_rows))]
    mags = 0.5 + torch.rand(len(seq_rows), generator=gen, dtype=torch.float64)
    per_seq = torch.tensor(signs, dtype=torch.float64) * mags
    per_tok = torch.zeros(n_rows, dtype=torch.float64)
    for i, rows in enumerate(seq_rows):
        for r in rows:
            u = float(torch.rand((), generator=gen))
            flip = -1.0 if u < 0.25 else 1.0
            zero = 0.0 if u > 0.9 else 1.0
            per_tok[r] = signs[i] * flip * zero * (0.5 + float(torch.rand((), generator=gen)))
    return per_seq, per_tok


def _force_positive(case, per_seq, per_tok, seq_rows):
    """A ratio beyond float32's range meets only positive advantages: there the clip (or the
    gate of CISPO, GMPO, VESPO) bounds the term, so float32 and float64 agree on a finite value.
    (With A <= 0 an overflowing ratio is inf * A in float32, NaN at A = 0: the documented
    price of log_ratio_clamp=(None, ...), which the float64 reference does not pay.)
    A stride-0 layout of the advantages or of the old log-probs repeats one value (or row) of
    another sequence over every token (an overflowing sequence's old log-prob overflows them
    all), so there every advantage is made positive."""
    overflow = [i < len(case.zones) and case.zones[i] == "overflow" for i in range(len(seq_rows))]
    repeated = ("expanded", "row_expanded")
    if any(overflow) and (_layout_of(case, "advantages") in repeated or _layout_of(case, "old") in repeated):
        overflow = [True] * len(seq_rows)
    for i, rows in enumerate(seq_rows):
        if overflow[i]:
            per_seq[i] = abs(float(per_seq[i])) + 0.5
            for r in rows:
                per_tok[r] = abs(float(per_tok[r])) + 0.5


def _garbage(values, in_response, gen):
    """NaN, +-inf and huge values on mask-0 rows: padding the loss must never read."""
    choices = torch.tensor([float("nan"), float("inf"), float("-inf"), 1e30], dtype=torch.float64)
    for r in range(values.numel()):
        if not in_response[r]:
            values[r] = choices[int(torch.randint(0, 4, (1,), generator=gen))]


def _finish(case: FuzzCase, name: str, values: torch.Tensor, in_response, gen, dtype, shape) -> torch.Tensor:
    """Per-token values in their dtype and layout, with padding garbage when drawn. Not under a
    stride-0 layout: there one value (or row) stands for every token, so garbage would leak into
    response rows, and NaN old log-probs in the response are not what padding_garbage probes."""
    kind = _layout_of(case, name)
    if case.padding_garbage and kind not in ("expanded", "row_expanded"):
        _garbage(values, in_response, gen)
    return lay_out(values.to(dtype).reshape(shape), kind)


def build(case: FuzzCase) -> Built:
    gen = torch.Generator().manual_seed(case.seed)
    opts = dict(case.options)
    fused = case.entry == "fused_linear"
    shape, resp_plan, seq_rows, cu = _rows(case)
    n_rows, vocab = resp_plan.numel(), case.vocab

    # The mask, in its dtype and layout; an expanded layout repeats one value (or row).
    mask = None
    in_response = torch.ones(n_rows, dtype=torch.bool)
    if case.mask_form != "none":
        mask = lay_out(resp_plan.reshape(shape).to(_dtype(case.mask_form)), _layout_of(case, "mask"))
        in_response = mask.reshape(-1) != 0

    targets_flat = torch.randint(0, vocab, (n_rows,), generator=gen)
    _inject_ids(case, targets_flat, in_response, gen)
    targets = lay_out(targets_flat.reshape(shape).to(_dtype(case.index_dtype)), _layout_of(case, "targets"))
    targets_flat = targets.reshape(-1).long()

    ldtype = _dtype(case.logits_dtype)
    weight = weight_view = bias = None
    if fused:
        hidden_vals = torch.randn(n_rows, case.hidden, generator=gen, dtype=torch.float64) * 0.6
        w_vals = torch.randn(vocab, case.hidden, generator=gen, dtype=torch.float64) * (0.6 * case.logit_std / 2)
        b_vals = torch.randn(vocab, generator=gen, dtype=torch.float64) * 0.2
        _inject_logits(case, hidden_vals, targets_flat, in_response, gen, fused=True)
        hidden_vals = hidden_vals.to(ldtype)
        base, view = logits_base(hidden_vals.reshape(*shape, case.hidden), case.logits_view)
        w_vals = w_vals.to(ldtype)
        if case.weight_transposed:  # an (H, V) buffer seen as (V, H)
            weight, weight_view = w_vals.t().contiguous(), (lambda w: w.t())
        else:
            weight, weight_view = w_vals.clone(), (lambda w: w)
        bias = b_vals.to(ldtype) if case.bias else None
        logits64 = hidden_vals.double() @ w_vals.double().t() + (0 if bias is None else bias.double())
        logits64 = logits64.reshape(*shape, vocab)
    else:
        rows_vals = torch.randn(n_rows, vocab, generator=gen, dtype=torch.float64) * case.logit_std
        rows_vals = rows_vals.to(ldtype).double()  # what a 16-bit tensor holds, exactly
        _inject_logits(case, rows_vals, targets_flat, in_response, gen, fused=False)
        values = rows_vals.to(ldtype).reshape(*shape, vocab)
        base, view = logits_base(values, case.logits_view)
        logits64 = values.double()

    temperature = opts.get("temperature", 1.0)
    kept = _kept_sets(case, targets_flat, in_response, logits64.reshape(n_rows, vocab), gen)
    reference_kept = None if case.kept_sets == "whole" else kept
    lp64, ent64 = reference._token_logprobs_and_entropy(logits64, targets, temperature, in_response,
                                                        opts.get("logit_scale", 1.0), opts.get("logit_softcap"),
                                                        tuple(opts.get(f"sampling_{k}") for k in ("top_k", "top_p", "min_p")),
                                                        kept_tokens=reference_kept)
    lp64, ent64 = lp64.detach(), ent64.detach()

    built = Built(case=case, options=opts, base=base, view=view, logits64=logits64, targets=targets,
                  mask=mask, in_response=in_response, seq_rows=seq_rows, lp64=lp64, ent64=ent64,
                  weight=weight, weight_view=weight_view, bias=bias, kept_tokens=kept, reference_kept=reference_kept)
    if case.entry == "selective_log_softmax":
        built.near_tie = near_sampling_tie(built, opts)
        return built

    pdtype = _dtype(case.logprob_dtype)
    if cu is not None:
        built.cu_seqlens = torch.tensor(cu, dtype=_dtype(case.cu_dtype))

    old = None
    if not case.on_policy:
        old = _plan_old(case, opts, lp64, in_response, seq_rows, gen)
        built.old = _finish(case, "old", old, in_response, gen, pdtype, shape)

    per_seq, per_tok = _advantage_rows(case, n_rows, seq_rows, gen)
    _force_positive(case, per_seq, per_tok, seq_rows)
    read_per_sequence = case.packed and len(seq_rows) == n_rows  # (N,) advantages with S == N
    if read_per_sequence:
        per_tok = per_seq.clone()
    if case.adv_per_token and read_per_sequence:
        built.advantages = lay_out(per_tok.to(pdtype), _layout_of(case, "advantages"))
    elif case.adv_per_token:
        built.advantages = _finish(case, "advantages", per_tok, in_response, gen, pdtype, shape)
    else:
        built.advantages = per_seq.to(pdtype)

    if case.with_ref:
        ref = torch.where(torch.isfinite(lp64), lp64, torch.zeros_like(lp64)) - 0.1
        ref = (ref + 0.3 * torch.randn(n_rows, generator=gen, dtype=torch.float64)).clamp(max=0.0)
        built.ref = _finish(case, "ref", ref, in_response, gen, pdtype, shape)

    if case.rollout != "none":
        behaviour = (built.old.reshape(-1).double() if old is not None else lp64).clone()
        behaviour = torch.where(torch.isfinite(behaviour), behaviour, torch.full_like(behaviour, -3.0))
        offsets = torch.tensor([-1.2, -0.3, 0.1, 0.4, 1.1], dtype=torch.float64)
        seq_off = offsets[torch.randint(0, 5, (max(len(seq_rows), 1),), generator=gen)]
        rollout = behaviour.clone()
        for i, rows in enumerate(seq_rows):
            for k, r in enumerate(rows):
                jitter = 0.05 * float(torch.rand((), generator=gen))
                rollout[r] = behaviour[r] - seq_off[i] - (0.5 if k % 2 else -0.5) * (case.token_spread > 0) - jitter
        # The sampler's log-probs of tokens it sampled: in [-30, 0], so no importance weight
        # exp(old - rollout) leaves float32's range.
        rollout = rollout.clamp(-30.0, 0.0)
        if case.rollout == "given_with_nan":  # "a NaN rollout log-prob counts as no correction"
            for r in range(n_rows):
                if float(torch.rand((), generator=gen)) < 0.2:
                    rollout[r] = float("nan")
        built.rollout = _finish(case, "rollout", rollout, in_response, gen, pdtype, shape)

    if case.normalizer != "none":
        value = round(0.5 + 20 * float(torch.rand((), generator=gen)), 3)
        built.normalizer = value if case.normalizer == "float" else torch.tensor(value, dtype=pdtype)

    resp_ent = [float(ent64[r]) for r in range(n_rows) if in_response[r]]
    if case.entropy_threshold != "none" and opts.get("top_entropy_quantile", 1.0) < 1.0:
        thr = midpoint_threshold(resp_ent, case.pick, 0.1)
        built.entropy_threshold = thr if case.entropy_threshold == "float" else torch.tensor(thr)

    if case.off_policy:
        opts["off_policy_mask_threshold"] = midpoint_threshold(off_policy_gaps(built), case.pick, 0.5)

    built.near_tie = near_tie(built, opts)
    return built


