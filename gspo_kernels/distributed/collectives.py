"""The collectives the distributed loss is built from, on torch.distributed. None is
differentiable: stage 2 computes the loss and its gradient coefficients from the summed values
in one no-grad pass (sequence/gradient.py), so each rank's rows get their part of the
single-process gradient with no collective in backward; the fused-linear backward sums
`d hidden` over the vocab shards itself (sum_over_ranks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def replicated_sum(local: torch.Tensor, group) -> torch.Tensor:
    """The sum of `local` over the group's ranks, on every rank, in a new tensor (not
    differentiable). `group=None`: no group, `local` is returned."""
    if group is None:
        return local
    total = local.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total


def all_reduce_max(local: torch.Tensor, group) -> torch.Tensor:
    """The elementwise max over the group's ranks (not differentiable; NaN-free inputs only,
    as backends differ on NaN in a max)."""
    if group is None:
        return local
    out = local.clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


def sum_over_ranks(local: torch.Tensor, group, in_rank_order: bool = False) -> torch.Tensor:
    """The elementwise sum of `local` over the group's ranks, the same bits on every rank (not
    differentiable). Default: an all_reduce, in place. in_rank_order: each element's sum is a
    function of the ranks' values at that element alone, added in rank order after an
    all_gather: an all_reduce may add an element's addends in an order that follows the
    tensor's size and the element's place in it (gloo on 3 and 4 ranks did: a row's merged
    statistics changed with the rows around it). Two addends are added alike in any order
    (a + b == b + a), so with 2 ranks the all_reduce is kept; with more, the gather holds one
    copy of `local` per rank."""
    world = dist.get_world_size(group)
    if not in_rank_order or world <= 2:
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
        return local
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous(), group=group)
    total = parts[0]
    for part in parts[1:]:
        total += part
    return total


def check_group(name: str, group) -> None:
    if group is None:
        return
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{name} was given but torch.distributed is not initialized: call "
                           "torch.distributed.init_process_group first")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name} must be a torch.distributed.ProcessGroup (e.g. from dist.new_group); "
                        f"got {type(group).__name__}")
