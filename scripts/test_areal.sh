#!/usr/bin/env bash
# The AReaL drop-in's tests, in an environment of their own: AReaL 1.0.4 pins transformers <= 5.3,
# which the [trl] and [verl] extras do not admit. A virtualenv with torch, this checkout (copied,
# so that neither tree's build touches the other) installed editable with its [areal] extra and the
# extension's CPU part, AReaL itself with --no-deps, then tests/integrations/areal_tests.
#
#   ./scripts/test_areal.sh [pytest args]
#
# The venv is $GSPO_AREAL_VENV (default .venv-areal); it is reinstalled when the build inputs change,
# and the copy's Python files are refreshed from the checkout on every run. $GSPO_AREAL_EXTENSION,
# when set, is an extension already built from these sources against the same torch spec
# (./scripts/test.sh passes the main environment's): copied in on every run in place of a build
# of the CPU part (2-3 min on 2 cores). GSPO_AREAL_PREPARE_ONLY=1 installs the environment for
# such an extension, to come (none is copied or built), and runs no test: .ci/run does so beside
# the main set-up, and a later run waits for it (a lock on the venv) and finds it up to date.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GSPO_AREAL_VENV:-$ROOT/.venv-areal}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${GSPO_TORCH_SPEC:-torch==2.14.1}"
AREAL_SPEC="areal==1.0.4"
SRC="$VENV/src"
PY="$VENV/bin/python"
PREPARE_ONLY="${GSPO_AREAL_PREPARE_ONLY:-0}"

mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
if [ ! -x "$PY" ]; then
    echo "[areal] creating $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi
# The checkout's files (committed or not, not ignored) in place of the copy's; its build outputs
# (the extension, build/, the egg-info) stay.
mkdir -p "$SRC"
find "$SRC" -type f ! -name '*.so' ! -path "$SRC/build/*" ! -path '*.egg-info/*' -delete
(cd "$ROOT" && git ls-files -co --exclude-standard -z | xargs -0 tar cf -) | (cd "$SRC" && tar xf -)
PREBUILT="${GSPO_AREAL_EXTENSION:-}"
if [ -n "$PREBUILT" ]; then
    rm -f "$SRC"/gspo_kernels/backends/_C*.so
    cp "$PREBUILT" "$SRC/gspo_kernels/backends/"
fi
# Whether the environment takes a prebuilt extension (given now, or to come after a preparation).
TAKES_PREBUILT=""
[ -z "$PREBUILT" ] && [ "$PREPARE_ONLY" != "1" ] || TAKES_PREBUILT=yes

WANT="$({ cat "$SRC/pyproject.toml" "$SRC/setup.py"; echo "$TORCH_SPEC $AREAL_SPEC";
          echo "prebuilt extension: $TAKES_PREBUILT";
          find "$SRC/csrc" -type f | LC_ALL=C sort | xargs cat; } | sha256sum | cut -d' ' -f1)"
STAMP="$VENV/.gspo_kernels_areal"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && "$PY" -c "import gspo_kernels, areal" 2>/dev/null; then
    echo "[areal] up to date ($VENV)" >&2
else
    what="the extension's CPU part"
    [ -z "$TAKES_PREBUILT" ] || what="the extension from ${PREBUILT:-a later run}"
    echo "[areal] installing $TORCH_SPEC, gspo_kernels[areal] ($what) and $AREAL_SPEC" >&2
    pip_install() {  # pip's exit status kept; the local index's "Location ... is ignored" lines dropped
        # --no-compile: no bytecode for every file of torch (about 20 s); modules compile as imported.
        "$PY" -m pip install -q --disable-pip-version-check --no-compile "$@" 2> >(grep -v "^WARNING: Location" >&2)
    }
    pip_install "$TORCH_SPEC" wheel setuptools
    if [ -n "$TAKES_PREBUILT" ]; then
        GSPO_PREBUILT_EXTENSION=1 pip_install --no-build-isolation -e "$SRC[dev,areal]"
    else
        GSPO_SKIP_CUDA_BUILD=1 MAX_JOBS="${MAX_JOBS:-2}" pip_install --no-build-isolation -e "$SRC[dev,areal]"
    fi
    pip_install --no-deps "$AREAL_SPEC"
    echo "$WANT" > "$STAMP"
fi
if [ "$PREPARE_ONLY" = "1" ]; then
    echo "[areal] prepared $VENV for a prebuilt extension" >&2
    exit 0
fi
flock -u 9

cd "$SRC"
# This environment's extension is the CPU part or the main one: CI's demand for the CUDA kernels is
# the main environment's.
unset GSPO_REQUIRE_CUDA_BUILD
export TRITON_INTERPRET=1
exec "$PY" -m pytest tests/integrations/areal_tests "$@"
