"""The sampler's kept set as a per-row threshold on the raw logits.

An engine that samples with top-k, top-p or min-p draws from the softmax renormalised over the
tokens it keeps; the log-probs of that distribution (vLLM's `logprobs_mode="processed_logprobs"`)
are what a ratio against its sampling must use. vLLM's order (v1 sampler): temperature, then
min-p (keep p >= min_p * max p), then top-k (keep the k largest; ties with the k-th all kept),
then top-p over what is left (sorted, keep the largest tokens until the mass strictly above a
token reaches top_p). "Largest" is by the raw logits, which the monotone map (scale, soft-cap,
temperature) keeps in order and which still tell apart logits a soft-cap rounds to one z. Every one of these keeps the tokens whose logit is at least some value, so
the kept set of a row is {x >= t} on the raw logits, with t halfway between the smallest kept
logit and the largest dropped one; the kernels compare each raw logit with it, exactly, so no
rounding of the map can move the boundary, and logits formed again in backward (fused linear)
have half the gap as a margin. Ties at a
top-p boundary are all kept (vLLM's sort keeps an arbitrary subset of them). A row that keeps
every token gets -inf, and the kernels give it bitwise the plain result.

The cpu and Triton backends select in kernels of their own (`kept_thresholds` below says which
takes which). The reference, and the torch backend's selection, is a pre-pass over the logits in
PyTorch, a chunk of rows at a time, in
float32 through the same logit map as the kernels (logit_map.LogitMap): it reads each logit
once more (2 bytes per logit for 16-bit logits) and, for top-p, sorts a float32 copy of the
chunk (about 20 bytes of scratch per logit of the chunk: the copy, its map, the sorted values
and their int64 indices); top-k alone takes torch.topk, min-p alone one max and one compare.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..backends import native_backend
from ..backends.contract import StatsInputs
from ..config.logit_map import LogitMap

try:
    from ..backends.triton import kept_set_ops as triton_kept_set
except ImportError:  # triton is optional where it has no wheels (macOS, Windows)
    triton_kept_set = None

# Float32 scratch per chunk of rows (the pre-pass holds about five row-sized buffers).
_CHUNK_BYTES = {"cpu": 32 << 20, "cuda": 512 << 20}


@dataclass(frozen=True)
class SamplingFilter:
    """The sampler's truncation: top_k (int), top_p (float in (0, 1]), min_p (float in [0, 1]);
    None for each one the sampler did not apply."""

    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    @property
    def active(self) -> bool:
        return (self.top_k is not None or (self.top_p is not None and self.top_p < 1.0)
                or (self.min_p is not None and self.min_p > 0.0))

    @staticmethod
    def of(config) -> "SamplingFilter":
        return SamplingFilter(config.sampling_top_k, config.sampling_top_p, config.sampling_min_p)

    def op_args(self) -> tuple[int, float, float]:
        """(top_k, top_p, min_p) as the selecting ops take them: 0, 1.0 and 0.0 for a filter not
        applied."""
        return self.top_k or 0, 1.0 if self.top_p is None else self.top_p, self.min_p or 0.0


def _chunk_thresholds(x: torch.Tensor, logit_map: LogitMap, sampling: SamplingFilter) -> torch.Tensor:
    """Thresholds of rows x `[C, V]` (float32, a copy this function may overwrite)."""
    z = logit_map.apply_(x.clone())
    keep = torch.ones_like(z, dtype=torch.bool)
    if sampling.min_p is not None and sampling.min_p > 0.0:
        keep &= z >= z.amax(-1, keepdim=True) + math.log(sampling.min_p)
    # Order by the raw logits (the map keeps their order; a soft-cap can round several of them to
    # the same z, which the raw values still tell apart), masses by z.
    if sampling.top_k is not None and sampling.top_k < z.shape[-1]:
        kth = torch.where(keep, x, torch.full_like(x, -math.inf)).topk(sampling.top_k, dim=-1).values[:, -1:]
        keep &= x >= kth
    if sampling.top_p is not None and sampling.top_p < 1.0:
        ordered, order = torch.where(keep, x, torch.full_like(x, -math.inf)).sort(-1, descending=True)
        probs = torch.softmax(torch.where(keep, z, torch.full_like(z, -math.inf)).gather(-1, order), -1)
        above = torch.cumsum(probs, -1) - probs  # the mass strictly above each token
        kept = (above < sampling.top_p).sum(-1, keepdim=True).clamp(min=1)  # the largest is always kept
        keep &= x >= ordered.gather(-1, kept - 1)
    smallest = torch.where(keep, x, torch.full_like(x, math.inf)).amin(-1)
    largest_out = torch.where(keep, torch.full_like(x, -math.inf), x).amax(-1)
    # Halfway between the smallest kept logit and the largest dropped one (in float64, then
    # float32, and never at or below the dropped one): a margin for logits formed again in
    # backward by products of other shapes (the fused-linear vocab sweep), which may round
    # differently from forward's.
    middle = ((smallest.double() + largest_out.double()) / 2).float()
    threshold = torch.where(middle > largest_out, middle, smallest)
    # A row that keeps every token gets -inf: the kernels then take their plain path, bitwise.
    return torch.where(keep.all(-1), torch.full_like(smallest, -math.inf), threshold)


def kept_set_stats(backend, logits: torch.Tensor, inputs: StatsInputs, sampling: SamplingFilter,
                   backend_name: str):
    """Stage 1 over the sampler's kept set (inputs.kept_min None): (logp, entropy, lse, the
    thresholds). On the cpu backend with top-p and no soft-cap, the forward selects as it reads
    each row (native_backend.sampled_token_stats) and the kept set's stats are the selection's
    own float64 sums of its masses, with no stats pass: top-p 0.9 at N = 4096, V = 32768 bf16,
    2 threads, 62.4 -> 47.0 ms for selection and stats (AVX-512 Xeon without BF16); the same
    thresholds. Elsewhere kept_thresholds, then the backend's token_stats over them: the op
    selecting row by row gained nothing without those sums (top-k 50 and min-p 0.1: 44.5 and
    41.5 ms as two passes, 47.7 and 45.0 in one)."""
    summed = sampling.top_p is not None and sampling.top_p < 1.0 and not inputs.logit_map.capped
    if backend_name == "cpu" and logits.device.type == "cpu" and summed:
        return native_backend.sampled_token_stats(logits, inputs, *sampling.op_args())
    kept_min = kept_thresholds(logits, inputs.logit_map, sampling, backend_name)
    kept_min = kept_min.reshape(inputs.targets.shape)
    logp, entropy, lse = backend.token_stats(logits, StatsInputs(inputs.targets, inputs.logit_map, kept_min))
    return logp, entropy, lse, kept_min


def _row_blocks(logits: torch.Tensor, chunk: int):
    """(first row, a `[C, V]` view of the next rows) over logits `(B, T, V)` or `(N, V)`, without
    a copy of strided leading dims (logits[:, :-1])."""
    if logits.dim() == 2:
        for start in range(0, logits.shape[0], chunk):
            yield start, logits[start:start + chunk]
        return
    seq = logits.shape[1]
    for b in range(logits.shape[0]):
        for t in range(0, seq, chunk):
            yield b * seq + t, logits[b, t:t + chunk]


def kept_thresholds(logits: torch.Tensor, logit_map: LogitMap, sampling: SamplingFilter,
                    backend_name: str = "torch") -> torch.Tensor:
    """Per row of logits `(B, T, V)` or `(N, V)`: the threshold on the raw logits of the tokens
    the sampler keeps, float32, of the rows' shape (contiguous); -inf for a row that keeps every
    token (among them a row with a NaN logit, or a +inf one without a soft-cap, whose results
    are NaN as for any such row); a row with fewer finite logits than top_k keeps them all.
    The cpu backend selects in its own kernel (csrc/cpu/kept_set.cpp), the triton backend and
    the cuda one on CUDA tensors in a Triton kernel (backends/triton/kept_set_kernels.py): no
    sort, no float32 copy of the logits. The torch backend takes the PyTorch pre-pass below,
    the reference (and so does the cuda backend where Triton is not installed)."""
    filters = sampling.op_args()
    # A threshold is a selection, not a function to differentiate: no autograd node (the native
    # op has no autograd kernel, and torch warns when a backward meets one).
    logits = logits.detach()
    if backend_name == "cpu" and logits.device.type == "cpu":
        return native_backend.kept_thresholds(logits, logit_map, *filters)
    if triton_kept_set is not None and (backend_name == "triton" or (backend_name == "cuda" and logits.is_cuda)):
        return triton_kept_set.kept_thresholds(logits, logit_map, *filters)
    vocab = max(logits.shape[-1], 1)
    chunk = max(1, _CHUNK_BYTES.get(logits.device.type, _CHUNK_BYTES["cuda"]) // (20 * vocab))
    out = torch.empty(logits.shape[:-1].numel(), dtype=torch.float32, device=logits.device)
    for start, block in _row_blocks(logits, chunk):
        part = block.float()
        thresholds = _chunk_thresholds(part, logit_map, sampling)
        # A row without a finite softmax keeps every token (-inf), so it stays NaN as documented
        # (a +inf logit only without a soft-cap: a soft-capped one is finite).
        no_softmax = torch.isnan(part).any(-1) | ((part == math.inf).any(-1) & (not logit_map.capped))
        out[start:start + block.shape[0]] = torch.where(no_softmax, torch.full_like(thresholds, -math.inf), thresholds)
    return out.reshape(logits.shape[:-1])
