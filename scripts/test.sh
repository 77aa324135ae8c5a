#!/usr/bin/env bash
# The test suite, after all set-up: ./scripts/test.sh [pytest args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$("$ROOT/scripts/setup_env.sh" | tail -n 1)"
cd "$ROOT"
# The Triton kernels run on CPU tensors through Triton's interpreter (no GPU needed).
export TRITON_INTERPRET=1
"$PY" -m pytest tests "$@"
# The AReaL drop-in's tests run in their own environment (AReaL pins an older transformers):
# after the suite, when every argument is a flag (CI's -q), not a path or an option's value.
# GSPO_SKIP_AREAL=1 leaves them out.
for arg in "$@"; do
    case "$arg" in -*) ;; *) exit 0 ;; esac
done
if [ "${GSPO_SKIP_AREAL:-0}" != "1" ]; then
    "$ROOT/scripts/test_areal.sh" "$@"
fi
