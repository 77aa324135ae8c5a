"""The loss denominator of a data-parallel step (and of gradient accumulation)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..config import LOSS_AGGS

_SEQUENCE_MEANS = tuple(agg for agg in LOSS_AGGS if agg.startswith("seq-mean"))


def _count(mask: torch.Tensor, loss_agg: str, cu_seqlens, cp_group) -> torch.Tensor:
    """This rank's count, with a cp_group over every cp rank's part of its sequences."""
    if not isinstance(mask, torch.Tensor) or mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError("mask must be a bool or 0/1 integer tensor (or a list of them, one per micro-batch)")
    flags = mask != 0
    if loss_agg == "token-mean":
        count = flags.sum().to(torch.float32)
        if cp_group is not None:
            dist.all_reduce(count, op=dist.ReduceOp.SUM, group=cp_group)
        return count
    if cu_seqlens is None:
        if flags.dim() != 2:
            raise ValueError(f"a sequence count needs a padded (B, T) mask, or cu_seqlens with a packed (N,) one; "
                             f"got a mask of shape {tuple(flags.shape)}")
        per_seq = flags.sum(dim=1).to(torch.float32)
    else:
        if flags.dim() != 1:
            raise ValueError(f"with cu_seqlens the mask is packed (N,); got shape {tuple(flags.shape)}")
        # unsafe=True: the safe form reads the offsets on the host (a sync on a GPU).
        per_seq = torch.segment_reduce(flags.to(torch.float32), "sum", offsets=cu_seqlens.to(flags.device).long(),
                                       unsafe=True)
    if cp_group is not None:  # a sequence counts once if any cp rank holds one of its response tokens
        dist.all_reduce(per_seq, op=dist.ReduceOp.SUM, group=cp_group)
    return (per_seq > 0).sum().to(torch.float32)


def global_normalizer(mask, loss_agg: str = "seq-mean-token-mean", group=None, *, cu_seqlens=None,
                      cp_group=None, averaged_grads: bool = False) -> torch.Tensor:
    """The denominator the loss uses by default, counted over every rank of `group` (and
    every micro-batch): pass it as `normalizer=` so that each rank's loss is its share of the
    whole step's loss.

    mask: this rank's response mask, `(B, T)` padded or `(N,)` packed with `cu_seqlens`; or a
    list of them (and of cu_seqlens), one per gradient-accumulation micro-batch.
    loss_agg: 'token-mean' counts response tokens; the 'seq-mean-*' ones count sequences with
    at least one response token (our default rule; a trainer that divides by every row passes
    its own count). 'token-sum' has no denominator.
    group: the data-parallel group (ranks holding different sequences); None is
    torch.distributed's default group when it is initialized, else this process alone.
    cp_group: with context parallelism, the ranks holding the other parts of this rank's
    sequences (not part of `group`): the counts are first summed over it, so that a sequence
    split over cp ranks counts once.
    averaged_grads: True when the framework averages gradients over the group (DDP and FSDP
    do): the count is divided by the group's size, so that the averaged gradient is the
    gradient of the whole step's loss.

    Returns a float32 0-d tensor on the mask's device, at least 1. One all_reduce (plus one
    per micro-batch over cp_group), no host sync (the count never leaves the device).
    """
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGS}; got {loss_agg!r}")
    if loss_agg == "token-sum":
        raise ValueError("loss_agg='token-sum' divides by nothing: it needs no normalizer")
    masks = list(mask) if isinstance(mask, Sequence) else [mask]
    if not masks:
        raise ValueError("mask is an empty list: pass at least one micro-batch's mask")
    cus = list(cu_seqlens) if isinstance(cu_seqlens, Sequence) else [cu_seqlens] * len(masks)
    if len(cus) != len(masks):
        raise ValueError(f"got {len(masks)} masks but {len(cus)} cu_seqlens: one per micro-batch")
    distributed = dist.is_available() and dist.is_initialized()
    if (group is not None or cp_group is not None) and not distributed:
        raise RuntimeError("a group was given but torch.distributed is not initialized")
    count = sum(_count(m, loss_agg, cu, cp_group) for m, cu in zip(masks, cus))
    world = 1
    if distributed:
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
        world = dist.get_world_size(group)
    count = count.clamp(min=1)
    return count / world if averaged_grads else count
