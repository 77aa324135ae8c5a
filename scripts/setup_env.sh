#!/usr/bin/env bash
# Sets up everything on a fresh machine: a virtualenv, torch, and gspo_kernels (with its C++/CUDA
# extension) installed in editable mode. Safe to run again: it reinstalls only when the build
# inputs changed. Sourced by main.sh and test.sh; prints the venv's python on the last line.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GSPO_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
# torch first, from this spec; the extension then builds against it (no build isolation).
TORCH_SPEC="${GSPO_TORCH_SPEC:-torch==2.14.1}"
# verl's own requirements are a cluster's (vllm, ...) and pin an older transformers: it goes in
# alone, plus what the modules gspo_kernels.integrations.verl imports need.
VERL_SPEC="verl==0.9.1"
VERL_IMPORTS="ray==2.60.0 tensordict==0.15.3 omegaconf==2.4.0 codetiming==1.4.0 orjson==3.13.0"

if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
    export CUDA_HOME=/usr/local/cuda
fi
# Two cores and a few GB per nvcc job: more parallel jobs only swap.
export MAX_JOBS="${MAX_JOBS:-2}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

stamp_inputs() {
    {
        cat "$ROOT/pyproject.toml" "$ROOT/setup.py"
        echo "$TORCH_SPEC $VERL_SPEC $VERL_IMPORTS"
        if [ -d "$ROOT/csrc" ]; then
            find "$ROOT/csrc" -type f | LC_ALL=C sort | xargs cat
        fi
    } | sha256sum | cut -d' ' -f1
}
STAMP="$VENV/.gspo_kernels_build"
WANT="$(stamp_inputs)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && "$PY" -c "import gspo_kernels" 2>/dev/null; then
    echo "[setup] up to date ($VENV)" >&2
else
    echo "[setup] installing $TORCH_SPEC" >&2
    "$PY" -m pip install -q --disable-pip-version-check "$TORCH_SPEC"
    echo "[setup] building gspo_kernels (the C++/CUDA extension takes a few minutes), then the trainers" >&2
    "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation -e "$ROOT[dev,bench,integrations]"
    "$PY" -m pip install -q --disable-pip-version-check --no-deps "$VERL_SPEC"
    # shellcheck disable=SC2086  # a list of specs
    "$PY" -m pip install -q --disable-pip-version-check $VERL_IMPORTS
    echo "$WANT" > "$STAMP"
fi
echo "$PY"
