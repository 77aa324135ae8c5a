"""The compiled extension gspo_kernels.backends._C: CPU and CUDA kernels registered as torch ops
(schemas in csrc/ops.cpp), with fake implementations so torch.compile can trace them."""

from __future__ import annotations

import torch

from .contract import GradInputs, StatsInputs
from .layout import with_unit_vocab_stride

_load_error: str | None = None
try:  # loading it registers torch.ops.gspo_kernels.*; an absolute import names the missing module in its error
    import gspo_kernels.backends._C as _C
except ImportError as exc:  # not built: the Triton and torch backends still work
    _C = None
    _load_error = str(exc)

# The ops the package calls: an extension built from older sources lacks some, and is refused
# whole (with the reason) rather than failing at a first call.
OPS = ("token_stats", "logits_grad", "logits_grad_", "kept_thresholds", "sampled_token_stats", "segment_sum",
       "segment_expand", "kept_group", "kept_dots", "kept_hidden_grad", "kept_weight_grad", "kept_target_positions",
       "kept_softmax_stats", "kept_softmax_grad")
if _C is not None:
    _missing = [op for op in OPS if not hasattr(torch.ops.gspo_kernels, op)]
    if _missing:
        _C = None
        _load_error = (f"gspo_kernels.backends._C is older than its Python code (no op {', '.join(_missing)}): "
                       "rebuild it (pip install --no-build-isolation -e .)")


def load_error() -> str | None:
    return _load_error


def with_cuda() -> bool:
    """Whether the extension was built with its CUDA kernels."""
    return _C is not None and bool(_C.with_cuda)


if _C is not None:

    @torch.library.register_fake("gspo_kernels::token_stats")
    def _(logits, targets, inv_temperature, softcap=0.0, kept_min=None):
        return tuple(logits.new_empty(targets.shape, dtype=torch.float32) for _ in range(3))

    @torch.library.register_fake("gspo_kernels::logits_grad")
    def _(logits, targets, lse, entropy, grad_logp, grad_entropy, row_mask, inv_temperature, softcap=0.0,
          kept_min=None):
        return torch.empty_like(logits, memory_format=torch.contiguous_format)

    @torch.library.register_fake("gspo_kernels::kept_thresholds")
    def _(logits, inv_temperature, softcap, top_k, top_p, min_p):
        return logits.new_empty(logits.shape[:-1], dtype=torch.float32)

    @torch.library.register_fake("gspo_kernels::sampled_token_stats")
    def _(logits, targets, inv_temperature, softcap, top_k, top_p, min_p):
        return tuple(logits.new_empty(targets.shape, dtype=torch.float32) for _ in range(4))

    @torch.library.register_fake("gspo_kernels::kept_target_positions")
    def _(offsets, ids, targets):
        return torch.empty_like(targets)

    @torch.library.register_fake("gspo_kernels::kept_softmax_stats")
    def _(z, offsets, target_pos):
        return tuple(z.new_empty(target_pos.shape) for _ in range(3))

    @torch.library.register_fake("gspo_kernels::kept_softmax_grad")
    def _(z, offsets, target_pos, lse, entropy, grad_logp, grad_entropy, row_mask, inv_temperature, softcap):
        return torch.empty_like(z)

    @torch.library.register_fake("gspo_kernels::kept_group")
    def _(row_offsets, ids, dx, vocab, block_rows):
        blocks = max(1, -(-(row_offsets.shape[0] - 1) // block_rows))
        return torch.empty_like(dx), ids.new_empty((blocks * vocab + 1,)), torch.empty_like(ids)

    @torch.library.register_fake("gspo_kernels::kept_dots")
    def _(hidden, weight, row_offsets, ids, tile_rows, block_ids):
        return hidden.new_empty(ids.shape, dtype=torch.float32)

    @torch.library.register_fake("gspo_kernels::kept_hidden_grad")
    def _(dx, weight, row_offsets, ids, tile_rows, block_ids, round):
        return weight.new_empty((row_offsets.shape[0] - 1, weight.shape[1]),
                                dtype=weight.dtype if round else torch.float32)

    @torch.library.register_fake("gspo_kernels::kept_weight_grad")
    def _(dx, hidden, offsets, rows, vocab, block_rows):
        return hidden.new_empty((vocab, hidden.shape[1])), hidden.new_empty((vocab,), dtype=torch.float32)

    @torch.library.register_fake("gspo_kernels::logits_grad_")
    def _(logits, targets, lse, entropy, grad_logp, grad_entropy, row_mask, inv_temperature, softcap=0.0,
          kept_min=None):
        return None


def token_stats(logits, inputs: StatsInputs):
    return torch.ops.gspo_kernels.token_stats(with_unit_vocab_stride(logits), *inputs.op_args())


def kept_thresholds(logits, logit_map, top_k, top_p, min_p):
    """The sampler's kept set as per-row thresholds on the raw logits (CPU tensors; top_k 0,
    top_p 1.0 and min_p 0.0 for a filter not applied): csrc/cpu/kept_set.cpp."""
    return torch.ops.gspo_kernels.kept_thresholds(with_unit_vocab_stride(logits), *logit_map.op_args(), top_k,
                                                  top_p, min_p)


def sampled_token_stats(logits, inputs: StatsInputs, top_k, top_p, min_p):
    """token_stats over the sampler's kept set, selected as each row is read (CPU tensors;
    inputs.kept_min None): (logp, entropy, lse, the thresholds kept_thresholds gives)."""
    targets, inv_temperature, softcap, _ = inputs.op_args()
    return torch.ops.gspo_kernels.sampled_token_stats(with_unit_vocab_stride(logits), targets, inv_temperature, softcap,
                                                      top_k, top_p, min_p)


def logits_grad(logits, inputs: GradInputs):
    return torch.ops.gspo_kernels.logits_grad(with_unit_vocab_stride(logits), *inputs.op_args())


def logits_grad_(logits, inputs: GradInputs):
    torch.ops.gspo_kernels.logits_grad_(logits, *inputs.op_args())
    return logits


# The kept-rows products of fused linear (csrc/cpu/kept_products.cpp; linear/kept_products.py).
def kept_group(row_offsets, ids, dx, vocab: int, block_rows: int):
    return torch.ops.gspo_kernels.kept_group(row_offsets, ids, dx, vocab, block_rows)


def kept_dots(hidden, weight, row_offsets, ids, tile_rows: int, block_ids: int):
    return torch.ops.gspo_kernels.kept_dots(hidden, weight, row_offsets, ids, tile_rows, block_ids)


def kept_hidden_grad(dx, weight, row_offsets, ids, tile_rows: int, block_ids: int, round_: bool):
    return torch.ops.gspo_kernels.kept_hidden_grad(dx, weight, row_offsets, ids, tile_rows, block_ids, round_)


def kept_weight_grad(dx, hidden, offsets, rows, vocab: int, block_rows: int):
    return torch.ops.gspo_kernels.kept_weight_grad(dx, hidden, offsets, rows, vocab, block_rows)


# The softmax over the kept entries (csrc/cpu/kept_softmax.cpp; token_stats/kept_softmax.py).
def kept_target_positions(offsets, ids, targets):
    return torch.ops.gspo_kernels.kept_target_positions(offsets, ids, targets)


def kept_softmax_stats(z, offsets, target_pos):
    return torch.ops.gspo_kernels.kept_softmax_stats(z, offsets, target_pos)


def kept_softmax_grad(z, offsets, target_pos, lse, entropy, grad_logp, grad_entropy, row_mask, logit_map):
    return torch.ops.gspo_kernels.kept_softmax_grad(z, offsets, target_pos, lse, entropy, grad_logp, grad_entropy,
                                                    row_mask, *logit_map.op_args())
