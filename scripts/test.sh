#!/usr/bin/env bash
# The test suite, after all set-up: ./scripts/test.sh [pytest args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$("$ROOT/scripts/setup_env.sh" | tail -n 1)"
cd "$ROOT"
# The Triton kernels run on CPU tensors through Triton's interpreter (no GPU needed).
export TRITON_INTERPRET=1
# Two worker processes, a test file each at a time (module fixtures run once): the interpreter's
# tests are single-threaded Python, 46% of the suite's time run serially (1986 s, 2-core AVX-512
# Xeon); a grid file of them took 142 s on two workers against 266 s on one.
# GSPO_TEST_WORKERS=0 runs the suite in this process.
"$PY" -m pytest tests -n "${GSPO_TEST_WORKERS:-2}" --dist loadfile "$@"
# The AReaL drop-in's tests run in their own environment (AReaL pins an older transformers):
# after the suite, when every argument is a flag (CI's -q), not a path or an option's value.
# GSPO_SKIP_AREAL=1 leaves them out.
for arg in "$@"; do
    case "$arg" in -*) ;; *) exit 0 ;; esac
done
if [ "${GSPO_SKIP_AREAL:-0}" != "1" ]; then
    # The extension setup_env.sh has just built (or found current) serves AReaL's environment too.
    built=("$ROOT"/gspo_kernels/backends/_C*.so)
    if [ ${#built[@]} -eq 1 ] && [ -f "${built[0]}" ]; then
        export GSPO_AREAL_EXTENSION="${built[0]}"
    fi
    "$ROOT/scripts/test_areal.sh" "$@"
fi
