#!/usr/bin/env bash
# The test suite, after all set-up: ./scripts/test.sh [pytest args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$("$ROOT/scripts/setup_env.sh" | tail -n 1)"
cd "$ROOT"
# The Triton kernels run on CPU tensors through Triton's interpreter (no GPU needed).
export TRITON_INTERPRET=1
exec "$PY" -m pytest tests "$@"
