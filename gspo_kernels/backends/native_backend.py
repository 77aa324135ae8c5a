"""The compiled extension gspo_kernels._C (CPU and CUDA kernels), when it is built."""

from __future__ import annotations

name = "native"

_load_error: str | None = None
try:
    from gspo_kernels import _C  # noqa: F401  (registers the torch.ops.gspo_kernels ops)
except ImportError as exc:  # not built: the Triton and torch backends still work
    _load_error = str(exc)


def load_error() -> str | None:
    return _load_error
