"""Megatron-Core's model-parallel state on gloo processes (tensor parallel 2), for the
megatron tests: each worker joins the world (trainer_world), initialises
megatron.core.parallel_state as a Megatron trainer does, runs its checks and hands rank 0's
result back. megatron-core 0.16.1's parallel_state, tensor-parallel layers and cross entropy run on
CPU tensors as they are; its GPTModel needs cpu_megatron()."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from trainer_world import join, leave


def megatron_worker(rank, port, out, world, tp, body, cp=1):
    """`body(rank)` -> a JSON-able result, inside a world of `world` ranks with megatron's
    tensor-parallel size `tp` and context-parallel size `cp`."""
    join(rank, world, port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    try:
        result = body(rank)
    finally:
        parallel_state.destroy_model_parallel()
    leave(rank, out, result)


def cpu_megatron() -> None:
    """Replaces, in this test process only, the CUDA-only calls a tiny megatron-core 0.16.1
    GPTModel meets on a CPU (each raises "Found no NVIDIA driver" as it is): the causal mask
    that megatron/core/transformer/utils.py builds on device="cuda" (and fused_softmax.py's
    import of it), the CUDA RNG tracker's fork around dropout (the tests use no dropout), and
    torch.cuda.current_device, which megatron/core/utils.py's global buffer allocates on.
    model_parallel_cuda_manual_seed is not called: use_cpu_initialization initialises the
    weights from the CPU generator. gspo_kernels replaces none of these."""
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.utils as transformer_utils
    from megatron.core import tensor_parallel

    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    transformer_utils.get_default_causal_mask = fused_softmax.get_default_causal_mask = causal_mask
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"


def kept_sets_of(labels: torch.Tensor, vocab: int, size: int, seed: int):
    """Random kept sets of `size` ids for the labels' rows (their flattened order), each holding its
    label: the engine's sets as kept_tokens takes them."""
    from gspo_kernels import KeptTokens

    gen = torch.Generator().manual_seed(seed)
    sets = []
    for label in labels.reshape(-1).tolist():
        ids = torch.randperm(vocab, generator=gen)[:size].tolist()
        sets.append(ids if label in ids else ids[:-1] + [label])
    return KeptTokens.from_lists(sets, vocab)
