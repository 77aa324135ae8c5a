import os
import zlib

# Before gspo_kernels is imported anywhere: the Triton kernels are defined at import time, and
# only then can they become interpreter functions that run on CPU tensors.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from gspo_kernels import backends  # noqa: E402


def import_installed(name: str):
    """pytest.importorskip(name), also skipping where `name` is only a namespace package (a folder of
    that name on sys.path without the package: a GPU machine's image had one for trl, and
    importorskip accepted it)."""
    module = pytest.importorskip(name)
    if getattr(module, "__file__", None) is None:
        pytest.skip(f"{name} is not installed (only a namespace package of that name: {list(module.__path__)})",
                    allow_module_level=True)
    return module


def available_backends() -> list[str]:
    """Backends that can run on this machine: Triton through its interpreter on a CPU."""
    names = ["torch"]
    triton = backends.triton_backend
    if triton is not None and (triton.INTERPRETED or torch.cuda.is_available()):
        names.append("triton")
    if backends.native_available():
        names.append("cpu")
        if torch.cuda.is_available():
            names.append("cuda")
    return names


def device_for(backend: str) -> str:
    if backend == "cuda" or (backend == "triton" and not backends.triton_backend.INTERPRETED):
        return "cuda"
    return "cpu"


BACKENDS = available_backends()
FUSED_BACKENDS = [b for b in BACKENDS if b != "torch"]


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # Different inputs for every case, the same ones on every run of that case.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def seed(request) -> int:
    return zlib.crc32(request.node.nodeid.encode())


@pytest.fixture
def small_blocks():
    """Forces several vocab blocks per row in the Triton kernels on a small vocab."""
    triton = backends.triton_backend
    if triton is None:
        yield
        return
    old = triton.block_v_override
    triton.block_v_override = 64
    yield
    triton.block_v_override = old
