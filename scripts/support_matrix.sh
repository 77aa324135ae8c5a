#!/usr/bin/env bash
# The support range, one (Python, torch) pair a call: a fresh virtualenv with that torch (and the
# Triton it pins), this checkout's C++ extension built against it (CPU part), then the gradient
# check on every backend (Triton through its interpreter) and a fast subset of the tests. The full
# suite stays on the default torch (scripts/test.sh).
#
#   scripts/support_matrix.sh 3.10 2.6.0          # Python 3.10, torch 2.6.0
#   scripts/support_matrix.sh 3.12 2.11.0 --tests-only tests/loss/test_kept_tokens.py
#
# Python comes from pyenv (~/.pyenv/versions/<version>*) or python<version> on PATH. The venvs
# live in $GSPO_MATRIX_DIR (default /tmp/gspo-matrix) and are reused when their torch is right.
# A line `[matrix] PASS py<version> torch <version> triton <version>` ends a passing run.
# GSPO_MATRIX_PREPARE_ONLY=1 stops after the venv's installs (.ci/run prepares its row that way
# beside the main set-up: they wait on the disk more than on the cores).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY_VERSION="${1:?usage: support_matrix.sh PYTHON_VERSION TORCH_VERSION [pytest args]}"
TORCH_VERSION="${2:?usage: support_matrix.sh PYTHON_VERSION TORCH_VERSION [pytest args]}"
shift 2
# The fast subset: the kernels' contract and ops, the loss on logits and from hidden states, the
# kept sets, the import layers; what needs a trainer or several processes stays on the default.
TESTS=("$@")
if [ ${#TESTS[@]} -eq 0 ]; then
    TESTS=(tests/kernels/test_contract.py tests/kernels/test_native_ops.py tests/kernels/test_triton_ops.py
           tests/kernels/test_selective_log_softmax.py tests/loss/test_kept_tokens.py
           tests/loss/test_kept_target_positions.py tests/linear tests/package -x)
fi

PYBIN=""
for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$PY_VERSION"*/bin/python; do
    if [ -x "$candidate" ]; then PYBIN="$candidate"; break; fi
done
if [ -z "$PYBIN" ] && command -v "python$PY_VERSION" >/dev/null; then PYBIN="$(command -v "python$PY_VERSION")"; fi
if [ -z "$PYBIN" ]; then echo "[matrix] no Python $PY_VERSION (pyenv or python$PY_VERSION on PATH)" >&2; exit 2; fi

WORK="${GSPO_MATRIX_DIR:-/tmp/gspo-matrix}/py$PY_VERSION-torch$TORCH_VERSION"
VENV="$WORK/venv"
PY="$VENV/bin/python"
mkdir -p "$WORK"
if ! [ -x "$PY" ] || [ "$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)" != "$TORCH_VERSION" ]; then
    echo "[matrix] $VENV: torch==$TORCH_VERSION on $("$PYBIN" --version)" >&2
    rm -rf "$VENV"
    "$PYBIN" -m venv "$VENV"
    "$PY" -m pip install -q --disable-pip-version-check --no-compile "torch==$TORCH_VERSION"
fi
# What the build and the tests need beside torch (older torch releases do not bring numpy). The
# newest numpy pip finds for this Python, unless GSPO_MATRIX_NUMPY says otherwise (a spec). A quiet
# pip prints nothing, so grep's no-match status is forgiven inside the braces, pip's is not.
"$PY" -m pip install -q --disable-pip-version-check setuptools wheel ninja pybind11 "${GSPO_MATRIX_NUMPY:-numpy}" \
    "pytest>=8" "hypothesis>=6.100" 2>&1 | { grep -v "^WARNING: Location" || true; } >&2
if [ "${GSPO_MATRIX_PREPARE_ONLY:-0}" = "1" ]; then
    echo "[matrix] prepared $VENV" >&2
    exit 0
fi

# This checkout's files (committed or not, not ignored) in a folder of their own: the build and
# the tests never touch the checkout.
SRC="$WORK/src"
rm -rf "$SRC"
mkdir -p "$SRC"
(cd "$ROOT" && git ls-files -co --exclude-standard -z | xargs -0 tar cf -) | (cd "$SRC" && tar xf -)
cd "$SRC"
echo "[matrix] building the extension (CPU part) against torch $TORCH_VERSION" >&2
GSPO_SKIP_CUDA_BUILD=1 MAX_JOBS="${MAX_JOBS:-2}" "$PY" setup.py -q build_ext --inplace >"$WORK/build.log" 2>&1 ||
    { tail -30 "$WORK/build.log" >&2; echo "[matrix] FAIL: the extension did not build" >&2; exit 1; }

export TRITON_INTERPRET=1 PYTHONPATH="$SRC"
# The matrix builds the CPU part only: CI's demand for the CUDA kernels is the default build's.
unset GSPO_REQUIRE_CUDA_BUILD
TRITON="$("$PY" -c 'import importlib.metadata as m; print(m.version("triton"))' 2>/dev/null || echo none)"
echo "[matrix] gradient check, every backend (torch $TORCH_VERSION, triton $TRITON)" >&2
"$PY" -m gspo_kernels check --quick
echo "[matrix] tests: ${TESTS[*]}" >&2
"$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
echo "[matrix] PASS py$PY_VERSION torch $TORCH_VERSION triton $TRITON"
