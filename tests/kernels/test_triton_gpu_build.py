"""The Triton kernels compile for a Hopper GPU with no GPU here: the row kernels use 16-byte
loads, the fused-linear kernels spill no registers."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
SCRIPT = pathlib.Path(__file__).with_name("triton_sm90_compile.py")


def _has_ptxas() -> bool:
    bundled = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return bundled.exists() or shutil.which("ptxas") is not None


@pytest.mark.skipif(not _has_ptxas(), reason="no ptxas to compile for sm_90")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("16-byte loads: True, 16-byte stores: True") == 9
    # The fused-linear kernels at their GPU tiles (5 kernels, 2 of them the batch-invariant
    # backward) x 3 dtypes, none spilling registers but the two batch-invariant ones in float32
    # (ptxas, triton 3.8: 128 registers and 56 spill bytes each; their speed is unmeasured).
    assert out.stdout.count("spill bytes: 0") == 16, out.stdout
    assert out.stdout.count("(invariant)") == 6, out.stdout
