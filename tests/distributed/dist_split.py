"""One rank's part of the whole problem: the rows (cp, dp), the vocab slice (tp) and the
process groups a rank passes to the loss, and its differentiable inputs cut to match."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gspo_kernels.testing.problem_split import context_part, data_part, even_parts

from dist_grid import Case
from dist_problems import BATCH, SEQ_LEN


@dataclass
class RankView:
    """What this rank feeds the loss, and how to cut the whole problem's results to match."""

    rows: torch.Tensor | None  # the whole problem's rows this rank holds (None: all)
    token_shape: tuple
    cu_seqlens: torch.Tensor | None
    vocab: tuple[int, int] | None  # [start, stop) of V (None: all)
    seqs: tuple[int, int] | None = None  # dp: the sequences this rank holds
    groups: dict = field(default_factory=dict)


def view_of(case: Case, p: dict, rank: int, world: int, groups: dict, vocab: int) -> RankView:
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


def input_leaves(case: Case, p: dict, view: RankView | None) -> dict:
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
