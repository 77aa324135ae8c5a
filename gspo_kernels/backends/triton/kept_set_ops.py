"""The launcher of kept_set_kernels.py, registered as a torch custom op (one opaque call for
torch.compile). The cuda and triton backends take it on CUDA tensors, and the triton backend on
CPU tensors under the interpreter (token_stats/kept_set.py decides)."""

from __future__ import annotations

import math
import struct

import torch

from ...compat import custom_op
from ..layout import RowLayout, next_power_of_2, with_unit_vocab_stride
from . import kept_set_kernels as kernels

# A search pass compares a [PIVOTS, BLOCK_V] tile of keys; 16 pivots cut the interval 17-fold a
# pass. Not tuned on a GPU (docs/performance.md, "Unmeasured").
_PIVOTS = 16
_BLOCK_V = 1024
_NUM_WARPS = 8
# The low bits of a float32 key that a dtype's values leave zero (bf16: 16, fp16: 13, fp16's
# subnormals included, as their float32 forms are normal with at most 10 mantissa bits).
_KEY_SHIFT = {torch.bfloat16: 16, torch.float16: 13, torch.float32: 0}


@custom_op("gspo_kernels::triton_kept_thresholds", mutates_args=())
def _kept_thresholds_op(
    logits: torch.Tensor, inv_temperature: float, softcap: float, top_k: int, top_p: float, min_p: float,
) -> torch.Tensor:
    layout = RowLayout.of(logits)
    if layout.vocab == 0:
        raise ValueError("kept_thresholds: empty vocab dimension (a row with no logit has no kept set)")
    out = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    if layout.rows:
        has_top_k = 0 < top_k < layout.vocab
        kernels.kept_threshold_kernel[(layout.rows,)](
            logits, out, layout.rows_per_batch, layout.stride_b, layout.stride_t, layout.vocab,
            inv_temperature, softcap, top_k if has_top_k else 1,
            # top_p's float64 bits as an integer argument: a Python float reaches a kernel as
            # float32, and a float64 tensor would be a host-to-device copy (no CUDA graph).
            struct.unpack("<q", struct.pack("<d", top_p))[0],
            math.log(min_p) if min_p > 0.0 else 0.0,
            HAS_SOFTCAP=softcap > 0.0, HAS_MIN_P=min_p > 0.0, HAS_TOP_K=has_top_k, HAS_TOP_P=top_p < 1.0,
            KEY_SHIFT=_KEY_SHIFT[logits.dtype], PIVOTS=_PIVOTS,
            BLOCK_V=min(_BLOCK_V, next_power_of_2(layout.vocab)), num_warps=_NUM_WARPS,
        )
    return out


@_kept_thresholds_op.register_fake
def _(logits, inv_temperature, softcap, top_k, top_p, min_p):
    return logits.new_empty(logits.shape[:-1], dtype=torch.float32)


def kept_thresholds(logits, logit_map, top_k, top_p, min_p):
    """Thresholds of logits `(B, T, V)` or `(N, V)` (float32, of the rows' shape): top_k 0 for
    none, top_p 1 for none, min_p 0 for none; kept_set.kept_thresholds' rules."""
    if not (top_p > 0.0 and min_p <= 1.0):
        raise ValueError(f"top_p must be > 0 and min_p <= 1; got {top_p} and {min_p}")
    inv_temperature, softcap = logit_map.op_args()
    return _kept_thresholds_op(with_unit_vocab_stride(logits), float(inv_temperature), float(softcap), int(top_k),
                               float(top_p), float(min_p))
