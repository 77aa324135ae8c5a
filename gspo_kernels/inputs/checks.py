"""Checks of each input tensor of a loss call on its own, against the call's TokenLayout: the
logits, the targets, a mask, per-token log-probs (inputs/batch.py gathers them into the call's
LossBatch).

Shapes, dtypes and devices are checked on the host, which costs no host-device sync. The
checks on values (an integer mask, a normalizer tensor) run on the host for CPU tensors
(ValueError) and as asynchronous device-side asserts for GPU tensors, so the loss path never
waits for the GPU: there a bad value stops the process with a CUDA device-side assert at the
next synchronisation, naming the check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INDEX_DTYPES = (torch.int64, torch.int32)
# bf16 log-probs carry ~3 significant digits: their rounding alone moves a sequence ratio by
# more than the 3e-4 clip range, so a 16-bit old/ref log-prob would silently flip clipping.
LOGPROB_DTYPES = (torch.float32, torch.float64)


def require_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
    return value


def require_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but logits are on {device}; move it to {device}")


def require_shape(name: str, t: torch.Tensor, shape, what: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} ({what}); got {tuple(t.shape)}")


@dataclass(frozen=True)
class TokenLayout:
    """Where a call's tokens are, as every per-token input must match them: padded `(B, T)` or
    packed `(N,)` (the logits' shape without V, or the log-probs' shape), on one device."""

    shape: torch.Size
    device: torch.device

    @property
    def packed(self) -> bool:
        return len(self.shape) == 1

    @property
    def rows(self) -> int:
        return self.shape.numel()

    @staticmethod
    def of_logits(logits) -> "TokenLayout":
        check_logits(logits)
        return TokenLayout(logits.shape[:-1], logits.device)


def check_logits(logits) -> None:
    require_tensor("logits", logits)
    if logits.dim() not in (2, 3):
        raise ValueError(
            f"logits must be (B, T, V) padded or (N, V) packed; got shape {tuple(logits.shape)}"
        )
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(f"logits must be float32, bfloat16 or float16 (float64 on the torch path); got {logits.dtype}")
    if logits.shape[-1] == 0:
        raise ValueError("logits have an empty vocab dimension (V = 0)")


def check_targets(target_ids, layout: TokenLayout) -> torch.Tensor:
    """Validates the targets against the layout; returns them as a contiguous int64 tensor of the
    token shape (the kernels read it as rows; no view to `[N]` to dispatch)."""
    require_tensor("target_ids", target_ids)
    require_shape("target_ids", target_ids, layout.shape, "the logits' shape without V")
    if target_ids.dtype not in INDEX_DTYPES:
        raise TypeError(f"target_ids must be int64 or int32; got {target_ids.dtype}")
    require_device("target_ids", target_ids, layout.device)
    return target_ids.to(torch.int64).contiguous()


def per_token_logprobs(name: str, value, token_shape, device) -> torch.Tensor | None:
    if value is None:
        return None
    t = require_tensor(name, value)
    require_shape(name, t, token_shape, "one value per token, like target_ids")
    if t.dtype not in LOGPROB_DTYPES:
        raise TypeError(
            f"{name} must be float32 or float64; got {t.dtype}. 16-bit log-probs are too coarse "
            "for GSPO's ~3e-4 clip range: compute them in float32 (logits.float().log_softmax)."
        )
    require_device(name, t, device)
    return t


def check_values(ok: torch.Tensor, message: str) -> None:
    """Raises ValueError(message) unless the 0-d bool tensor `ok` is true: on the host for a
    CPU tensor, as an asynchronous device-side assert on a GPU (and under torch.compile)."""
    if ok.device.type == "cpu" and not torch.compiler.is_compiling():
        if not bool(ok):
            raise ValueError(message)
        return
    torch._assert_async(ok, message)


def check_mask(value, layout: TokenLayout) -> torch.Tensor:
    """The response mask as a contiguous bool tensor of the token shape (all True when value is
    None): the kernels read it as `[N]` rows at stride 1, so a strided or expanded view
    (`m[::2]`, `flags[:, 0]`, `torch.tensor(True).expand(N)`) is copied once."""
    token_shape, device = layout.shape, layout.device
    if value is None:
        return torch.ones(token_shape, dtype=torch.bool, device=device)
    t = require_tensor("mask", value)
    require_shape("mask", t, token_shape, "one flag per token, like target_ids")
    if t.dtype.is_floating_point or t.dtype.is_complex:
        raise TypeError(
            f"mask must be bool or an integer 0/1 tensor; got {t.dtype}. Float masks are refused "
            "because a weight other than 0/1 would silently change the loss: pass mask.bool()."
        )
    require_device("mask", t, device)
    if t.dtype != torch.bool:
        check_values(((t == 0) | (t == 1)).all(), "an integer mask must hold only 0 and 1")
        t = t != 0  # keeps the input's strides: a 1-D view stays strided
    return t.contiguous()
