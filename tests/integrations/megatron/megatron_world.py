"""Megatron-Core's model-parallel state on gloo processes (tensor parallel 2), for the
megatron tests: each worker joins the world (trainer_world), initialises
megatron.core.parallel_state as a Megatron trainer does, runs its checks and hands rank 0's
result back. megatron-core 0.16.1 runs this on CPU tensors as it is: nothing is replaced."""

from __future__ import annotations

import torch.distributed as dist

from trainer_world import join, leave


def megatron_worker(rank, port, out, world, tp, body):
    """`body(rank)` -> a JSON-able result, inside a world of `world` ranks with megatron's
    tensor-parallel size `tp`."""
    join(rank, world, port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        result = body(rank)
    finally:
        parallel_state.destroy_model_parallel()
    leave(rank, out, result)
