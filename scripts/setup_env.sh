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
# alone; what its modules and ours import comes with the [verl] extra (pyproject.toml).
VERL_SPEC="verl==0.9.1"

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
        echo "$TORCH_SPEC $VERL_SPEC"
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
    # --no-compile: no bytecode for every file at install (torch alone took about 20 s of its
    # 57 s on the 2-core machine); modules compile when first imported.
    "$PY" -m pip install -q --disable-pip-version-check --no-compile "$TORCH_SPEC"
    echo "[setup] building gspo_kernels (the C++/CUDA extension takes a few minutes), then the trainers" >&2
    # wheel: deepspeed is an sdist, built (without isolation) against this torch.
    "$PY" -m pip install -q --disable-pip-version-check wheel setuptools
    "$PY" -m pip install -q --disable-pip-version-check --no-compile --no-build-isolation -e "$ROOT[dev,bench,trl,verl,deepspeed,megatron]"
    "$PY" -m pip install -q --disable-pip-version-check --no-compile --no-deps "$VERL_SPEC"
    echo "$WANT" > "$STAMP"
fi
echo "$PY"
