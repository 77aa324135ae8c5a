import os
import zlib

# Before gspo_kernels is imported anywhere: the Triton kernels are defined at import time, and
# only then can they become interpreter functions that run on CPU tensors.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Fused linear's products in float32 whatever the CPU: a CPU with native bf16 would otherwise
# round the logits to bf16 (as a trainer's lm_head does), and the grid tests, which hold the path
# to the float64 reference at float32 precision, would test a different thing on each CPU kind.
# The bf16 product path has its own tests, which turn it on (tests/linear/test_cpu_bf16_products.py).
os.environ.setdefault("GSPO_CPU_BF16_PRODUCTS", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

from gspo_kernels import backends  # noqa: E402


def _under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def pytest_configure(config):
    """Under CI the suite refuses to run without the native extension: without it the cpu and cuda
    backends leave every parametrisation below (and test_native_ops.py skips), so a broken build
    would pass as fewer tests. On a developer's machine the run goes on, and says so in its header."""
    if _under_ci() and not backends.native_available():
        raise pytest.UsageError("CI=true, and the native extension gspo_kernels.backends._C does not import: "
                                f"{backends.native_backend.load_error()} (build it: pip install --no-build-isolation -e .)")
    config.addinivalue_line("markers", "triton_pairwise: the interpreted triton cases run over a pairwise covering "
                            "subset of the other parameters (conftest.pytest_collection_modifyitems)")


def _interpreted_triton() -> bool:
    triton = backends.triton_backend
    return triton is not None and triton.INTERPRETED


def pytest_collection_modifyitems(config, items):
    """A test marked `triton_pairwise` runs its triton cases, under Triton's interpreter, over a
    pairwise covering subset of its other parameters (tests/pairwise.py): its grid's other axes
    change only stage 2 (PyTorch, shared by every backend), which the cpu and torch cases run in
    full; the interpreter took 0.65-2.4 s a case, 326 s of the suite's 1927 (serial, 2-core
    AVX-512 Xeon) in the two grids marked. The cases left out are reported as deselected.
    GSPO_TRITON_FULL_GRID=1, or Triton on a GPU, runs every case."""
    if not _interpreted_triton() or os.environ.get("GSPO_TRITON_FULL_GRID", "") == "1":
        return
    from pairwise import covering_subset

    groups: dict[str, list] = {}
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.get_closest_marker("triton_pairwise") is not None and params.get("backend") == "triton":
            groups.setdefault(item.nodeid.split("[")[0], []).append(item)
    dropped = []
    for group in groups.values():
        cases = [{k: repr(v) for k, v in item.callspec.params.items() if k != "backend"} for item in group]
        keep = set(covering_subset(cases))
        dropped += [item for i, item in enumerate(group) if i not in keep]
    if dropped:
        ids = {id(item) for item in dropped}
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if id(item) not in ids]


def pytest_report_header(config):
    dropped = "" if backends.native_available() else (
        f" (cpu and cuda left out: gspo_kernels.backends._C does not import: {backends.native_backend.load_error()})")
    triton = backends.triton_backend
    if triton is None:
        dropped += f" (triton left out: {backends.TRITON_PROBLEM})"
    elif triton.INTERPRETER_PROBLEM is not None:
        dropped += f" (triton left out: {triton.INTERPRETER_PROBLEM})"
    return f"gspo_kernels backends under test: {', '.join(BACKENDS)}{dropped}"


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
    # On a CPU the interpreter runs them, unless the installed numpy breaks it (compat.py): then
    # Triton is left out here, as backends.resolve refuses it.
    if triton is not None and ((triton.INTERPRETED and triton.INTERPRETER_PROBLEM is None) or
                               (torch.cuda.is_available() and not triton.INTERPRETED)):
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


@pytest.fixture
def row_count_products(monkeypatch):
    """The fused-linear logits product summed over H in two parts split where the row count says,
    as a BLAS picks its split-K by a product's shape: the default path then gives a row other
    bits in a batch of another size on every machine, so an invariance test's control can show
    that its check fails without batch_invariant. The batch-invariant path multiplies row blocks
    of one fixed size, so the split it gets never changes."""
    from gspo_kernels.linear import products

    plain = products.Operands._block_logits

    def split_by_rows(self, h, cols, out=None):
        hidden = h.shape[1]
        if hidden < 2:
            return plain(self, h, cols, out)
        at = 1 + h.shape[0] % (hidden - 1)
        weight, bias = self._weight(cols), self._bias(cols)
        mm = products._mm_fp32 if self.native else torch.mm
        z = mm(h[:, :at], weight[:, :at].t()) + mm(h[:, at:], weight[:, at:].t())
        z = z if bias is None else z + bias
        return z if out is None else out.copy_(z)

    monkeypatch.setattr(products.Operands, "_block_logits", split_by_rows)
