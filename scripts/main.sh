#!/usr/bin/env bash
# The main job, after all set-up: gradient check of every backend against the float64
# reference, then the benchmark suite on the default problem. ./scripts/main.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$("$ROOT/scripts/setup_env.sh" | tail -n 1)"
cd "$ROOT"
# The check covers the Triton kernels on a CPU through Triton's interpreter.
TRITON_INTERPRET="${TRITON_INTERPRET:-$([ -e /dev/nvidia0 ] && echo 0 || echo 1)}" "$PY" -m gspo_kernels check
