"""The compiled extension gspo_kernels.backends._C: CPU and CUDA kernels registered as torch ops
(schemas in csrc/ops.cpp), with fake implementations so torch.compile can trace them."""

from __future__ import annotations

import importlib

import torch

from .contract import GradInputs
from .layout import with_unit_vocab_stride

_load_error: str | None = None
try:  # loading it registers torch.ops.gspo_kernels.*; import_module names the missing module in its error
    _C = importlib.import_module("._C", __package__)
except ImportError as exc:  # not built: the Triton and torch backends still work
    _C = None
    _load_error = str(exc)


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

    @torch.library.register_fake("gspo_kernels::logits_grad_")
    def _(logits, targets, lse, entropy, grad_logp, grad_entropy, row_mask, inv_temperature, softcap=0.0,
          kept_min=None):
        return None


def token_stats(logits, targets, inv_temperature, softcap=0.0, kept_min=None):
    return torch.ops.gspo_kernels.token_stats(with_unit_vocab_stride(logits), targets, inv_temperature, softcap,
                                              kept_min)


def logits_grad(logits, inputs: GradInputs):
    return torch.ops.gspo_kernels.logits_grad(with_unit_vocab_stride(logits), *inputs.op_args())


def logits_grad_(logits, inputs: GradInputs):
    torch.ops.gspo_kernels.logits_grad_(logits, *inputs.op_args())
    return logits
