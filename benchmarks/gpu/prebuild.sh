#!/usr/bin/env bash
# Builds the _C extension here for the GPU machine's image (Python 3.12, torch 2.11 cu130, sm_90),
# so that a GPU run's minutes go to checks, not to nvcc. Writes .prebuilt/ (git-ignored; copy
# it beside the working tree on the GPU machine):
#
#   .prebuilt/_C.cpython-312-x86_64-linux-gnu.so    the extension (CPU part at AVX2: the GPU
#                                                    machine's CPU is not known here)
#   .prebuilt/STAMP                                  python, torch, CUDA, arch and the sources' hash
#
# check.sh copies it into gspo_kernels/backends/ when STAMP matches that machine's python3,
# torch and this tree's csrc/ (benchmarks/gpu/prebuilt.py), and builds from source otherwise.
#
#   bash benchmarks/gpu/prebuild.sh        # about 3 minutes of nvcc on 2 cores, after the set-up
#
# Set-up, once per machine: a Python 3.12 (PY312=..., else pyenv's 3.12, else python3.12 on PATH)
# and a venv in $GSPO_PY312_VENV (default /tmp/gspo-py312) with torch 2.11.0 and its CUDA 13
# libraries from the registry (about 3 GB), so that the built extension is also imported and
# its CPU ops run here (the check of the build).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT="$PWD"
VENV="${GSPO_PY312_VENV:-/tmp/gspo-py312}"
OUT="$ROOT/.prebuilt"
TORCH_VERSION="2.11.0"

find_py312() {
    if [ -n "${PY312:-}" ]; then echo "$PY312"; return; fi
    if command -v pyenv >/dev/null 2>&1; then
        for p in "$(pyenv root)"/versions/3.12*/bin/python3.12; do [ -x "$p" ] && { echo "$p"; return; }; done
    fi
    command -v python3.12 || { echo "prebuild: no Python 3.12 found (set PY312=/path/to/python3.12)" >&2; exit 1; }
}

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import torch, sys; assert torch.__version__.startswith('$TORCH_VERSION')" 2>/dev/null; then
    "$(find_py312)" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==$TORCH_VERSION" numpy setuptools wheel ninja
fi
PY="$VENV/bin/python"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" MAX_JOBS="${MAX_JOBS:-2}"
export GSPO_CUDA_ARCHS=90 GSPO_CPU_CAPABILITY=avx2 GSPO_REQUIRE_CUDA_BUILD=1
TMP="$(mktemp -d)"
"$PY" setup.py build_ext --build-temp "$TMP/build" --build-lib "$TMP/lib" >"$TMP/build.log" 2>&1 || {
    tail -n 30 "$TMP/build.log"; exit 1; }
mkdir -p "$OUT"
so="$(cd "$TMP/lib/gspo_kernels/backends" && ls _C.cpython-312-*.so)"
cp "$TMP/lib/gspo_kernels/backends/$so" "$OUT/$so.tmp" && mv "$OUT/$so.tmp" "$OUT/$so"  # only after the link
"$PY" benchmarks/gpu/prebuilt.py stamp > "$OUT/STAMP"
# The check of the build: the extension imports under Python 3.12 / torch 2.11 and its CPU ops run.
(cd "$TMP" && cp -r "$ROOT/gspo_kernels" pkg && cp "$OUT/$so" pkg/backends/ && mv pkg gspo_kernels &&
 "$PY" -c "
import torch, gspo_kernels.backends._C as C
x = torch.randn(4, 33); t = torch.randint(0, 33, (4,))
lp, ent, lse = torch.ops.gspo_kernels.token_stats(x, t, 1.0)
want = torch.log_softmax(x.double(), -1)[torch.arange(4), t]
assert torch.allclose(lp.double(), want, atol=1e-5), (lp, want)
print('prebuild: imported under', torch.__version__, '| with_cuda =', C.with_cuda, '| cpu', C.cpu_capability,
      '| token_stats on CPU matches log_softmax')
")
rm -rf "$TMP"
ls -la "$OUT"
cat "$OUT/STAMP"
