"""The compiled ops gspo_kernels::{token_stats, logits_grad, logits_grad_, kept_thresholds,
sampled_token_stats}: opcheck (schema, fake tensors, autograd registration, AOT dispatch), argument
checks, and the build itself."""

import os
import pathlib
import shutil
import subprocess

import pytest
import torch

from gspo_kernels import backends

# Under CI=true conftest.py stops the run before this: there a missing extension is a failure.
pytestmark = pytest.mark.skipif(not backends.native_available(),
                                reason=f"gspo_kernels.backends._C does not import: {backends.native_backend.load_error()}")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and backends.native_backend.with_cuda() else [])


def _inputs(device, dtype, shape=(3, 5, 97), strided=False):
    full = torch.randn(shape[0], shape[1] + 1, shape[2]) if strided else torch.randn(shape)
    logits = (full[:, :-1] if strided else full).to(dtype).to(device)
    rows = shape[0] * shape[1]
    targets = torch.randint(0, shape[2], (rows,), device=device)
    return logits, targets


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_token_stats(device, dtype, strided):
    logits, targets = _inputs(device, dtype, strided=strided)
    torch.library.opcheck(torch.ops.gspo_kernels.token_stats.default, (logits, targets, 0.9))


@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_logits_grad(device, dtype, with_entropy, with_mask):
    logits, targets = _inputs(device, dtype, strided=True)
    _, entropy, lse = torch.ops.gspo_kernels.token_stats(logits, targets, 1.0)
    grad_logp = torch.randn_like(lse)
    grad_logp[::3] = 0  # padding rows
    grad_entropy = torch.randn_like(lse) if with_entropy else None
    row_mask = torch.rand(lse.shape, device=device) < 0.7 if with_mask else None
    args = (targets, lse, entropy, grad_logp, grad_entropy, row_mask, 1.0)
    torch.library.opcheck(torch.ops.gspo_kernels.logits_grad.default, (logits, *args))
    inplace = logits.clone()
    torch.library.opcheck(torch.ops.gspo_kernels.logits_grad_.default, (inplace, *args))
    expected = torch.ops.gspo_kernels.logits_grad(logits, *args)
    torch.ops.gspo_kernels.logits_grad_(inplace, *args)
    assert torch.equal(inplace, expected)


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_opcheck_kept_thresholds(dtype, strided):
    logits, _ = _inputs("cpu", dtype, strided=strided)
    for filters in ((5, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.1), (7, 0.9, 0.05)):
        torch.library.opcheck(torch.ops.gspo_kernels.kept_thresholds.default, (logits, 0.9, 0.0, *filters))


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_opcheck_sampled_token_stats(dtype, strided):
    logits, targets = _inputs("cpu", dtype, strided=strided)
    for filters in ((5, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.1), (7, 0.9, 0.05)):
        torch.library.opcheck(torch.ops.gspo_kernels.sampled_token_stats.default, (logits, targets, 0.9, 0.0, *filters))
    with pytest.raises(RuntimeError, match="top_p must be > 0"):
        torch.ops.gspo_kernels.sampled_token_stats(logits, targets, 1.0, 0.0, 0, 0.0, 0.0)
    with pytest.raises(RuntimeError, match="targets must be"):
        torch.ops.gspo_kernels.sampled_token_stats(logits, targets.int(), 1.0, 0.0, 5, 1.0, 0.0)


@pytest.mark.parametrize("device", DEVICES)
def test_raw_op_argument_checks(device):
    logits, targets = _inputs(device, torch.float32)
    with pytest.raises(RuntimeError, match="targets must be"):
        torch.ops.gspo_kernels.token_stats(logits, targets.int(), 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.gspo_kernels.token_stats(logits, targets[:-1], 1.0)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        torch.ops.gspo_kernels.token_stats(logits.double(), targets, 1.0)
    with pytest.raises(RuntimeError, match="stride 1"):
        torch.ops.gspo_kernels.token_stats(logits.transpose(1, 2), targets, 1.0)
    _, entropy, lse = torch.ops.gspo_kernels.token_stats(logits, targets, 1.0)
    with pytest.raises(RuntimeError, match="grad_logp must be"):
        torch.ops.gspo_kernels.logits_grad(logits, targets, lse, entropy, lse[:-1], None, None, 1.0)
    with pytest.raises(RuntimeError, match="row_mask must be"):
        torch.ops.gspo_kernels.logits_grad(logits, targets, lse, entropy, lse, None, targets, 1.0)
    with pytest.raises(RuntimeError, match="do not share memory"):
        overlapping = logits.reshape(-1)[: 2 * 97 + 50].as_strided((3, 97), (50, 1))
        torch.ops.gspo_kernels.logits_grad_(overlapping, targets[:3], lse[:3], entropy[:3], lse[:3], None, None, 1.0)


def _cuobjdump():
    triton_bin = None
    try:
        import triton

        triton_bin = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    except ImportError:
        pass
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for candidate in (pathlib.Path(cuda_home) / "bin" / "cuobjdump", triton_bin):
        if candidate is not None and candidate.exists():
            return str(candidate)
    return shutil.which("cuobjdump")


def test_cuda_part_carries_sm90_machine_code():
    """CI sets GSPO_REQUIRE_CUDA_BUILD=1: there the CUDA kernels must have been built."""
    if not backends.native_backend.with_cuda():
        if os.environ.get("GSPO_REQUIRE_CUDA_BUILD") == "1":
            pytest.fail("the extension was built without its CUDA kernels")
        pytest.skip("extension built without CUDA")
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump")
    so = backends.native_backend._C.__file__
    listing = subprocess.run([tool, "--list-elf", so], capture_output=True, text=True, check=True).stdout
    assert "sm_90" in listing, listing
    sass = subprocess.run([tool, "-sass", "-arch", "sm_90", so], capture_output=True, text=True, check=True).stdout
    assert "token_stats_kernel" in sass and "logits_grad_kernel" in sass
    assert "LDG.E.128" in sass and "STG.E.128" in sass  # the 16-byte loads and stores are there


@pytest.mark.skipif(shutil.which("nm") is None, reason="no nm")
def test_cpu_kernels_inline_the_simd_exp():
    """An out-of-line at::vec exp (one call per SIMD vector) once cost stage 1 40% of its time,
    after an unrelated edit moved GCC's inlining budget; GSPO_HOT_LOOP (flatten) prevents it."""
    if backends.native_backend._C.cpu_capability == "DEFAULT":
        pytest.skip("scalar build: no SIMD exp")
    so = backends.native_backend._C.__file__
    symbols = subprocess.run(["nm", "-C", so], capture_output=True, text=True, check=True).stdout
    # The function itself, not the static constants inside it (torch 2.4's header has some, and
    # their guard variables stay whether or not the function is inlined).
    out_of_line = [line for line in symbols.splitlines() if "exp_u20" in line and "exp_u20() const::" not in line]
    assert not out_of_line


def test_cpu_kernels_split_rows_over_every_thread():
    """_C is built with OpenMP where torch's parallel backend is OpenMP (setup.py): the kernels'
    row split (at::parallel_for with their grain) then runs on as many threads as torch has, up
    to 64, on the default problem (N = 4096, V = 32768) and on few long rows (16 of 151936).
    Without -fopenmp the pragma inside at::parallel_for compiles to nothing: one thread."""
    C = backends.native_backend._C
    if not torch.backends.openmp.is_available():
        pytest.skip("torch's parallel backend is not OpenMP here")
    assert C.with_openmp
    threads = torch.get_num_threads()
    try:
        for n in (2, 3, 64):
            torch.set_num_threads(n)
            assert C.row_threads(4096, 32768) == n
            assert C.row_threads(16, 151936) == min(n, 16)
        torch.set_num_threads(1)
        assert C.row_threads(4096, 32768) == 1
    finally:
        torch.set_num_threads(threads)
