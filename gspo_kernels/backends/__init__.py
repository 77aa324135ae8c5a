"""Stage 1 (token stats) and stage 3 (logits gradient), one module per backend.

Every backend module is a contract.Backend: token_stats(logits, inputs: StatsInputs),
logits_grad(logits, inputs: GradInputs) and logits_grad_(logits, inputs) over logits of shape
`[B, T, V]` or `[N, V]` (leading dims may be strided views; the vocab dim must be the
unit-stride one). The inputs objects (contract.py) carry the targets, the logit map
(config/logit_map.py), the sampler's kept set and stage 3's upstream gradients and row rule. The Triton tile kernels of the
fused-linear path (triton/tile_ops.py) take hidden states and the lm_head weight instead of
logits; `tiles_available` says where they run.
"""

from __future__ import annotations

import torch

from ..compat import triton_version_problem
from . import native_backend, torch_backend

# Why the Triton backend is not offered (None: it is): triton is optional where it has no wheels
# (macOS, Windows), and a Triton older than the kernels need is refused (compat.py).
try:
    import triton as _triton

    TRITON_PROBLEM = triton_version_problem(_triton.__version__)
except ImportError:
    TRITON_PROBLEM = "the triton package is not installed (pip install triton)"
triton_backend = triton_tiles = None
if TRITON_PROBLEM is None:
    from .triton import row_ops as triton_backend
    from .triton import tile_ops as triton_tiles

# Imported eagerly so that torch.compile traces a plain dict lookup. The Triton kernels are
# therefore defined when gspo_kernels is imported: set TRITON_INTERPRET=1 before that to run
# them on CPU tensors.
_MODULES = {"torch": torch_backend, "triton": triton_backend, "cpu": native_backend, "cuda": native_backend}


def get(name: str):
    """The backend module for a resolved name (no 'auto')."""
    return _MODULES[name]


def native_available() -> bool:
    return native_backend.load_error() is None


def tiles_available(device: torch.device) -> bool:
    """Whether the Triton tile kernels run on this device (CUDA, or the CPU interpreted)."""
    return triton_tiles is not None and triton_tiles.available(device)


def resolve(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """Turns the user's backend choice into a concrete backend for logits of this device and
    dtype, or says why it cannot run.

    'auto' picks Triton for CUDA tensors, the fused C++ kernel for CPU tensors when the
    extension is built, and the plain PyTorch path otherwise.
    """
    on_cuda = device.type == "cuda"
    if name == "auto":
        if dtype == torch.float64:
            return "torch"
        if on_cuda:
            if triton_backend is not None:
                return "triton"
            return "cuda" if native_available() else "torch"
        if device.type == "cpu" and native_available():
            return "cpu"
        return "torch"
    if dtype == torch.float64 and name != "torch":
        raise TypeError(
            f"backend={name!r} takes float32, bfloat16 or float16 logits; float64 logits run on "
            "backend='torch' (the gradcheck path) or 'auto'"
        )
    if name == "triton":
        if triton_backend is None:
            raise RuntimeError(f"backend='triton' is not available: {TRITON_PROBLEM}")
        if not on_cuda and triton_backend.INTERPRETER_PROBLEM is not None:
            raise RuntimeError(f"backend='triton' on CPU tensors: {triton_backend.INTERPRETER_PROBLEM}")
        if not on_cuda and not triton_backend.INTERPRETED:
            raise ValueError(
                f"backend='triton' got logits on {device}; Triton kernels run on CUDA "
                "tensors, or on CPU tensors through Triton's interpreter when TRITON_INTERPRET=1 "
                "is set before gspo_kernels is imported. On CPU use backend='cpu' or 'torch'."
            )
    if name in ("cpu", "cuda"):
        error = native_backend.load_error()
        if error is not None:
            raise RuntimeError(
                f"backend={name!r} needs the compiled extension gspo_kernels.backends._C, which failed "
                f"to load ({error}). Build it with `pip install --no-build-isolation -e .` after "
                "installing torch (see the README's Install section)."
            )
        if device.type != name:
            raise ValueError(f"backend={name!r} needs logits on a {name} device; got {device}")
    return name
