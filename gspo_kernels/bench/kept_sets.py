"""The engine's kept sets as a fused-linear contender (kept_64, kept_512): per token, the ids a
top-k sampler keeps on the problem's own logits (the k largest, the row's target in place of the
k-th when it is not among them), handed to gk.fused_linear_gspo_loss as kept_tokens. Only those
k weight rows are multiplied per token: 6NkH multiply-adds where the full vocabulary takes 6NVH.
"""

from __future__ import annotations

import torch

from ..inputs.kept_tokens import KeptTokens
from ..linear import fused_linear_gspo_loss
from .problem import EPS_HIGH, EPS_LOW

_SET_ROWS = 256  # rows of logits formed at a time while the sets are built (not timed)
KEPT_SIZES = {"kept_64": 64, "kept_512": 512}  # the contenders and their ids a token


def kept_flops(name: str, vocab: int) -> str:
    """The table's FLOPs cell: 6NkH, and what it is in units of NVH."""
    return f"6NkH = {6 * KEPT_SIZES[name] / vocab:.3g}NVH"


def sampler_kept_sets(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, k: int) -> KeptTokens:
    """Top-k sets of the rows `hidden @ weight.T`, each holding its row's target."""
    rows, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    k = min(k, weight.shape[0])
    parts = []
    with torch.no_grad():
        w = weight.float()
        for start in range(0, rows.shape[0], _SET_ROWS):
            ids = (rows[start:start + _SET_ROWS].float() @ w.t()).topk(k, dim=-1).indices
            target = flat_targets[start:start + _SET_ROWS, None]
            missing = ~(ids == target).any(-1, keepdim=True)
            ids[:, -1:] = torch.where(missing, target, ids[:, -1:])
            parts.append(ids)
    ids = torch.cat(parts)
    offsets = torch.arange(0, ids.numel() + 1, k, device=ids.device)
    return KeptTokens(offsets, ids.reshape(-1), weight.shape[0])


def kept_loss(k: int):
    """The contender's loss over top-k sets, built once per step (like the problem's other tensors)."""
    def loss(h, w, p):
        kept = getattr(p, "_kept_sets", {}).get(k)
        if kept is None:
            kept = sampler_kept_sets(p.hidden, p.weight, p.target_ids, k)
            p.__dict__.setdefault("_kept_sets", {})[k] = kept
        return fused_linear_gspo_loss(h, w, p.target_ids, p.old_logprobs, p.advantages, mask=p.mask,
                                      eps_low=EPS_LOW, eps_high=EPS_HIGH, kept_tokens=kept)[0]

    return loss
