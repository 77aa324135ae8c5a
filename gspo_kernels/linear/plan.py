"""How one fused-linear call runs, resolved once against its tensors: everything the autograd
Functions need but the tensors themselves."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import backends
from ..config import LinearConfig
from ..config.logit_map import LogitMap
from ..distributed.collectives import all_reduce_max
from ..distributed.vocab_parallel import VocabSlice
from ..token_stats.kept_set import SamplingFilter
from ..inputs.batch import LossBatch
from ..inputs.sequence_groups import SequenceGroup, sequence_groups
from .invariant import ProductBlocks
from .products import Operands

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


# The one-pass schedule holds whole sequences per group: a sequence longer than the chunk's rows
# still goes in one group when it is at most this many times as long (its logits are then the
# larger buffer), else the call takes two passes.
ONE_PASS_STRETCH = 4


def default_chunk_rows(rows: int, vocab: int, device: torch.device, logit_bytes: int = 4) -> int:
    """Rows per chunk for a `[rows, V]` logits buffer (float32 unless logit_bytes says otherwise)
    within CHUNK_BUDGET_BYTES (32 MiB on a CPU, 256 MiB on a GPU, in multiples of PRODUCT_ALIGN
    there): 256 float32 rows (512 bf16) at V = 32768 on a CPU, 384 at V = 151936 on a GPU."""
    budget = CHUNK_BUDGET_BYTES.get(device.type, CHUNK_BUDGET_BYTES["cpu"])
    return max(1, min(rows, align_down(budget // (logit_bytes * vocab), device)))


@dataclass(frozen=True)
class LinearPlan:
    """One call's plan: the validated LinearConfig and what it resolved to for these tensors."""

    linear: LinearConfig
    logit_map: LogitMap
    backend_name: str  # resolved; "triton" whenever linear.fused
    chunk: int  # rows per chunk of the chunked path
    tp_slice: VocabSlice | None = None  # vocab-parallel: the weight holds this rank's vocab slice
    blocks: ProductBlocks | None = None  # batch_invariant (chunked path): the fixed product shape
    sampling: SamplingFilter | None = None  # the sampler's kept set (token_stats/kept_set.py), chunked path
    weight_grad_fp32: bool = True  # linear.weight_grad_fp32, None resolved for these tensors

    @property
    def reduce_hidden_grad(self) -> bool:
        """Whether backward sums `d hidden` over the tensor-parallel group."""
        return self.tp_slice is not None and self.linear.reduce_hidden_grad

    @staticmethod
    def of(linear: LinearConfig, logit_map: LogitMap, backend: str, hidden: torch.Tensor, weight: torch.Tensor,
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
        products = Operands(weight[:1], None)
        logit_bytes = products.logits_dtype.itemsize
        # None: float32 unless every product is rounded to bf16 anyway (a CPU's native bf16
        # products): there a float32 sum of rounded products measured no closer to the float64
        # gradient than the weight's dtype summed inside each product (docs/fused_linear.md).
        weight_grad_fp32 = linear.weight_grad_fp32 if linear.weight_grad_fp32 is not None else not products.cpu_bf16
        chunk = linear.chunk_size or default_chunk_rows(hidden.shape[0], weight.shape[0], hidden.device, logit_bytes)
        tp_slice = VocabSlice.of_rank(tp_group, vocab_start, weight.shape[0])
        if tp_slice is not None and linear.chunk_size is None:
            # Every rank cuts the same groups and chunks (the one-pass merge is a collective per
            # group): the smallest default over the ranks, whose vocab slices may differ.
            chunk = _smallest_over_ranks(chunk, tp_group, hidden.device)
        blocks = None
        if linear.batch_invariant and not linear.fused:  # the tile kernels' shapes are fixed already
            blocks = ProductBlocks.of(hidden.device, hidden.shape[-1])
            chunk = blocks.round_chunk(chunk)
        return LinearPlan(linear, logit_map, resolved, chunk, tp_slice, blocks, sampling, weight_grad_fp32)

    def schedule(self, config, batch: LossBatch) -> list[SequenceGroup] | None:
        """The loss's schedule: its groups of whole sequences for one pass, or None for two
        passes. config: the GSPOConfig. linear.schedule='one_pass' refuses a call that cannot
        take one, saying why."""
        why = self._two_pass_reason(config, batch)
        groups = None
        if why is None:
            groups = sequence_groups(batch, self.chunk, ONE_PASS_STRETCH * self.chunk)
            if groups is None:
                why = (f"a sequence is longer than {ONE_PASS_STRETCH} x {self.chunk} rows (the chunk: chunk_size or the "
                       "memory budget), so its logits are not at hand whole")
        if why is not None and self.linear.schedule == "one_pass":
            raise ValueError(f"schedule='one_pass' cannot run this call: {why}. Use schedule='auto' or 'two_pass'")
        return groups

    def _two_pass_reason(self, config, batch: LossBatch) -> str | None:
        if self.linear.schedule == "two_pass":
            return "schedule='two_pass'"
        if self.linear.fused:
            return "fused=True runs the tile kernels, which form the logits again in backward"
        if self.blocks is not None:
            return "batch_invariant=True keeps its fixed product shapes on two passes"
        if config.top_entropy_quantile < 1.0 and batch.entropy_threshold is None:
            return "top_entropy_quantile's threshold is a quantile over the whole batch's entropies"
        if batch.segments.group is not None:
            return "with cp_group a sequence's other parts are on other ranks"
        return None


def _smallest_over_ranks(value: int, group, device: torch.device) -> int:
    negated = torch.tensor([-value], dtype=torch.int64, device=device)
    return -int(all_reduce_max(negated, group).item())


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
