#!/usr/bin/env bash
# The support range's rows (README, "Supported versions"), one scripts/support_matrix.sh call
# each, numpy held below 2.4 where the Triton release's interpreter needs it (compat.py); the
# full suite runs on the default torch (scripts/test.sh). Prints each row's last line.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
run() {  # python torch [numpy spec]
    if GSPO_MATRIX_NUMPY="${3:-numpy}" bash scripts/support_matrix.sh "$1" "$2" > "/tmp/gspo-matrix-$1-$2.log" 2>&1; then
        tail -1 "/tmp/gspo-matrix-$1-$2.log"
    else
        status=1
        echo "[matrix] FAIL py$1 torch $2 (log: /tmp/gspo-matrix-$1-$2.log)"
    fi
}
run 3.10 2.4.1
run 3.11 2.6.0 "numpy<2.4"
run 3.11 2.9.1 "numpy<2.4"
run 3.12 2.11.0 "numpy<2.4"
exit $status
