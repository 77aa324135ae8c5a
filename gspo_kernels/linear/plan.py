"""How one fused-linear call runs, resolved once against its tensors: everything the autograd
Functions need but the tensors themselves."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import backends
from ..config import LinearConfig
from ..distributed.vocab_parallel import VocabSlice
from ..token_stats.kept_set import SamplingFilter
from .invariant import ProductBlocks

# float32 logits per chunk when chunk_size is None: a budget in bytes, rows = budget / (4 V).
CHUNK_BUDGET_BYTES = {"cpu": 32 << 20, "cuda": 256 << 20}

# Product dimensions the chunked path chooses itself (rows per chunk, columns per vocab block)
# are multiples of this on a GPU. cuBLAS takes its sm_75 "align1" kernels for a 16-bit operand
# whose leading dimension is not a multiple of 8: on an H200 (torch 2.11, 2026-12-04) the
# default 441-row chunks at N = 16384, H = 4096, V = 151936 made vocab blocks of 4089 columns
# and the forward + backward took 552.8 ms (3 products at 134-153 TFLOP/s), against 135.0 ms
# with 1024-row chunks (blocks of 9496) and 88.7 ms for the materialized path
# (benchmarks/gpu/linear_profile.py).
PRODUCT_ALIGN = {"cuda": 128}


def align_down(size: int, device: torch.device) -> int:
    """`size` rounded down to the device's PRODUCT_ALIGN (unchanged below it, or on a CPU)."""
    align = PRODUCT_ALIGN.get(device.type, 1)
    return size if size < align else size - size % align


def default_chunk_rows(rows: int, vocab: int, device: torch.device) -> int:
    """Rows per chunk for a float32 `[rows, V]` logits buffer within CHUNK_BUDGET_BYTES
    (32 MiB on a CPU, 256 MiB on a GPU, in multiples of PRODUCT_ALIGN there): 256 rows at
    V = 32768 on a CPU, 384 at V = 151936 on a GPU."""
    budget = CHUNK_BUDGET_BYTES.get(device.type, CHUNK_BUDGET_BYTES["cpu"])
    return max(1, min(rows, align_down(budget // (4 * vocab), device)))


@dataclass(frozen=True)
class LinearPlan:
    """One call's plan: the validated LinearConfig and what it resolved to for these tensors."""

    linear: LinearConfig
    inv_temperature: float  # with softcap: the kernels' logit map (config.kernel_logit_map)
    softcap: float
    backend_name: str  # resolved; "triton" whenever linear.fused
    chunk: int  # rows per chunk of the chunked path
    tp_slice: VocabSlice | None = None  # vocab-parallel: the weight holds this rank's vocab slice
    blocks: ProductBlocks | None = None  # batch_invariant (chunked path): the fixed product shape
    sampling: SamplingFilter | None = None  # the sampler's kept set (token_stats/kept_set.py), chunked path

    @property
    def reduce_hidden_grad(self) -> bool:
        """Whether backward sums `d hidden` over the tensor-parallel group."""
        return self.tp_slice is not None and self.linear.reduce_hidden_grad

    @staticmethod
    def of(linear: LinearConfig, logit_map: tuple, backend: str, hidden: torch.Tensor, weight: torch.Tensor,
           tp_group=None, vocab_start=None, sampling: SamplingFilter | None = None) -> "LinearPlan":
        """hidden: the `[N, H]` rows; weight: `[V, H]` (this rank's slice with tp_group)."""
        sampling = sampling if sampling is not None and sampling.active else None
        if sampling is not None and (linear.fused or tp_group is not None):
            raise NotImplementedError("the sampler's kept set (sampling_top_k/_top_p/_min_p) runs on the chunked "
                                      "fused-linear path of one process: not with fused=True (the tile kernels) nor "
                                      "with tp_group (a selection across ranks)")
        # fused=True is the Triton tile kernels: 'auto' means them.
        name = "triton" if linear.fused and backend == "auto" else backend
        if linear.fused and name == "triton" and not backends.tiles_available(hidden.device):
            _no_tiles(hidden.device)  # before resolve, whose error would blame a backend the user never named
        resolved = backends.resolve(name, hidden.device, hidden.dtype)
        if linear.fused:
            _check_fused(resolved, hidden.device)
        chunk = linear.chunk_size or default_chunk_rows(hidden.shape[0], weight.shape[0], hidden.device)
        tp_slice = VocabSlice.of_rank(tp_group, vocab_start, weight.shape[0])
        blocks = None
        if linear.batch_invariant and not linear.fused:  # the tile kernels' shapes are fixed already
            blocks = ProductBlocks.of(hidden.device, hidden.shape[-1])
            chunk = blocks.round_chunk(chunk)
        return LinearPlan(linear, *logit_map, resolved, chunk, tp_slice, blocks, sampling)


def _check_fused(resolved_backend: str, device: torch.device) -> None:
    if resolved_backend != "triton":
        raise ValueError(f"fused=True runs the Triton kernels; got backend {resolved_backend!r} (use 'auto' or "
                         "'triton')")
    if not backends.tiles_available(device):
        _no_tiles(device)


def _no_tiles(device: torch.device) -> None:
    raise ValueError(f"fused=True runs the Triton tile kernels, which need CUDA tensors, or Triton's interpreter for "
                     f"CPU tensors (TRITON_INTERPRET=1 before gspo_kernels is imported); got {device}. Without it, "
                     "fused=False (the default) runs the chunked path on any backend")
