"""The Triton backend over materialised logits: launchers for row_kernels.py, registered as
torch custom ops so torch.compile sees them as single opaque calls (with fake implementations
for shape propagation). It is the module `backends.get("triton")` returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...compat import custom_op
from ..contract import GradInputs, StatsInputs
from ..layout import RowLayout, elements_disjoint, next_power_of_2, with_unit_vocab_stride
from . import row_kernels as kernels
from .common import INTERPRETED, INTERPRETER_PROBLEM  # noqa: F401  (read as backends.triton_backend.*)


# 16 KiB of logits per block keeps every thread on several 16-byte loads per iteration at
# 8 warps; not tuned on a GPU (docs/performance.md, "Unmeasured").
_BLOCK_BYTES = 16384
_NUM_WARPS = 8


@dataclass(frozen=True)
class LaunchConfig:
    block_v: int
    num_warps: int

    @staticmethod
    def for_row(vocab: int, element_size: int, block_v: int | None = None) -> "LaunchConfig":
        if block_v is None:
            block_v = min(next_power_of_2(vocab), _BLOCK_BYTES // element_size)
        if block_v & (block_v - 1):
            raise ValueError(f"block_v must be a power of two; got {block_v}")
        return LaunchConfig(block_v=block_v, num_warps=_NUM_WARPS)


# Tests set this to force several vocab blocks on a small vocab; None picks the default.
block_v_override: int | None = None


def _launch_config(logits: torch.Tensor) -> LaunchConfig:
    return LaunchConfig.for_row(logits.shape[-1], logits.element_size(), block_v_override)


@custom_op("gspo_kernels::triton_token_stats", mutates_args=())
def _token_stats_op(
    logits: torch.Tensor, targets: torch.Tensor, inv_temperature: float, softcap: float = 0.0,
    kept_min: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    layout = RowLayout.of(logits)
    logp, entropy, lse = (
        torch.empty(targets.shape, dtype=torch.float32, device=logits.device) for _ in range(3)
    )
    if layout.rows and layout.vocab:
        cfg = _launch_config(logits)
        kernels.token_stats_kernel[(layout.rows,)](
            logits, targets, logp, entropy, lse, lse if kept_min is None else kept_min,
            layout.rows_per_batch, layout.stride_b, layout.stride_t, layout.vocab,
            inv_temperature, softcap,
            HAS_SOFTCAP=softcap > 0.0, HAS_KEPT=kept_min is not None, BLOCK_V=cfg.block_v, num_warps=cfg.num_warps,
        )
    return logp, entropy, lse


@_token_stats_op.register_fake
def _(logits, targets, inv_temperature, softcap=0.0, kept_min=None):
    return tuple(logits.new_empty(targets.shape, dtype=torch.float32) for _ in range(3))


def _launch_grad(logits, grad, targets, lse, entropy, grad_logp, grad_entropy, row_mask, inv_temperature, softcap,
                 kept_min):
    layout = RowLayout.of(logits)
    out_layout = RowLayout.of(grad)
    if not (layout.rows and layout.vocab):
        return
    cfg = _launch_config(logits)
    kernels.logits_grad_kernel[(layout.rows,)](
        logits, grad, targets, lse, entropy, grad_logp,
        # Never read when the matching flag is False: any row vector stands in.
        grad_logp if grad_entropy is None else grad_entropy,
        targets if row_mask is None else row_mask,
        lse if kept_min is None else kept_min,
        layout.rows_per_batch, layout.stride_b, layout.stride_t,
        out_layout.stride_b, out_layout.stride_t, layout.vocab, inv_temperature, softcap,
        HAS_ENTROPY_GRAD=grad_entropy is not None, HAS_ROW_MASK=row_mask is not None, HAS_SOFTCAP=softcap > 0.0,
        HAS_KEPT=kept_min is not None, BLOCK_V=cfg.block_v, num_warps=cfg.num_warps,
    )


@custom_op("gspo_kernels::triton_logits_grad", mutates_args=())
def _logits_grad_op(
    logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
    grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None, row_mask: torch.Tensor | None,
    inv_temperature: float, softcap: float = 0.0, kept_min: torch.Tensor | None = None,
) -> torch.Tensor:
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    _launch_grad(logits, grad, targets, lse, entropy, grad_logp, grad_entropy, row_mask, inv_temperature, softcap, kept_min)
    return grad


@_logits_grad_op.register_fake
def _(logits, targets, lse, entropy, grad_logp, grad_entropy, row_mask, inv_temperature, softcap=0.0, kept_min=None):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@custom_op("gspo_kernels::triton_logits_grad_", mutates_args=("logits",))
def _logits_grad_inplace_op(
    logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
    grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None, row_mask: torch.Tensor | None,
    inv_temperature: float, softcap: float = 0.0, kept_min: torch.Tensor | None = None,
) -> None:
    # Each program reads a block of its row before writing the same block: in place is safe,
    # as long as no two rows share memory.
    if not elements_disjoint(logits):
        raise ValueError("logits_grad_ needs logits whose rows do not share memory; use logits_grad")
    _launch_grad(logits, logits, targets, lse, entropy, grad_logp, grad_entropy, row_mask, inv_temperature, softcap, kept_min)


def token_stats(logits, inputs: StatsInputs):
    return _token_stats_op(with_unit_vocab_stride(logits), *inputs.op_args())


def logits_grad(logits, inputs: GradInputs):
    return _logits_grad_op(with_unit_vocab_stride(logits), *inputs.op_args())


def logits_grad_(logits, inputs: GradInputs):
    _logits_grad_inplace_op(logits, *inputs.op_args())
    return logits
