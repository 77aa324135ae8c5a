"""A one-off set-up check of a tensor-parallel vocab split (it costs a host sync)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import check_group


def check_vocab_split(tp_group, local_vocab: int, vocab_start: int | None = None,
                      vocab_size: int | None = None) -> int:
    """Checks that the ranks' slices tile [0, vocab_size) with no gap and no overlap, and
    returns the global vocab size. Call it once at set-up: the loss itself does not check this
    (it would cost a host sync every step); a split with a gap or an overlap makes the
    softmax of every row wrong, and only rows whose target falls there turn NaN."""
    check_group("tp_group", tp_group)
    if vocab_start is None:
        vocab_start = dist.get_rank(tp_group) * local_vocab
    backend = dist.get_backend(tp_group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    mine = torch.tensor([vocab_start, local_vocab], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(every, mine, group=tp_group)
    slices = sorted(tuple(int(v) for v in t.tolist()) for t in every)
    end = 0
    for start, size in slices:
        if size <= 0:
            raise ValueError(f"a rank holds an empty vocab slice (start {start}, size {size})")
        if start != end:
            what = "a gap" if start > end else "an overlap"
            raise ValueError(f"the vocab slices {slices} (start, size) leave {what} at id {min(start, end)}")
        end = start + size
    if vocab_size is not None and end != vocab_size:
        raise ValueError(f"the vocab slices cover [0, {end}) but vocab_size is {vocab_size}")
    return end
