#!/usr/bin/env bash
# `check.sh first`: the first GPU truth in one run of at most 9 minutes. Each step runs
# under its own timeout, cut to what is left of the part's budget (FIRST_BUDGET, default 530 s),
# so a failing or slow step does not stop the rest; every step prints its command, its status and
# its time. On a machine without a GPU (a rehearsal) the GPU steps print SKIPPED; a step whose own
# output says SKIPPED (a missing input) is recorded as skipped, not ok. The run exits 1 when a
# step failed or timed out, 0 otherwise (skipped steps do not fail it). The summary
# (summary.json, summary.md) goes to $OUT; benchmarks/gpu/summarize.py --append adds summary.md
# to benchmarks/RESULTS.md with the date and the GPU.
#
#   on a GPU:    bash benchmarks/gpu/check.sh first      with .prebuilt/ and .whl/ beside the tree, ~570 s limit
#   rehearsal:   bash benchmarks/gpu/check.sh first      (here: the GPU steps are skipped)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$(mktemp -d)}"
PY="${PY:-python3}"
# The scripts under benchmarks/gpu import gspo_kernels from this tree; Triton compiles for the GPU
# (tests/conftest.py would otherwise turn its interpreter on and run the Triton tests on the CPU).
export OUT PY PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DEADLINE=$((SECONDS + ${FIRST_BUDGET:-530}))
STEPS="$OUT/first_steps.tsv"
: > "$STEPS"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then HAVE_GPU=1; else HAVE_GPU=0; fi
export HAVE_GPU

# run NAME GPU(0|1) TIMEOUT COMMAND: the command through bash -c, under min(TIMEOUT, what is left).
run() {
    local name="$1" gpu="$2" limit="$3" cmd="$4" left=$((DEADLINE - SECONDS)) start=$SECONDS rc
    [ "$limit" -gt "$left" ] && limit=$left
    printf '\n=== %s (%s, timeout %s s)\n$ %s\n' "$name" "$(date +%T)" "$limit" "$cmd"
    if [ "$gpu" = 1 ] && [ "$HAVE_GPU" = 0 ]; then
        echo "SKIPPED: no GPU here"; printf '%s\tskipped: no GPU\t0\n' "$name" >> "$STEPS"; return
    fi
    if [ "$limit" -lt 10 ]; then
        echo "SKIPPED: the part's budget is spent"; printf '%s\tskipped: budget\t0\n' "$name" >> "$STEPS"; return
    fi
    local log; log="$(mktemp)"
    timeout "$limit" bash -o pipefail -c "$cmd" 2>&1 | tee "$log"; rc=${PIPESTATUS[0]}
    local status="ok"; [ "$rc" = 124 ] && status="timed out"; [ "$rc" != 0 ] && [ "$rc" != 124 ] && status="failed (rc $rc)"
    # A step that said it skipped (a missing input) ran nothing: it is recorded as skipped, not ok.
    [ "$rc" = 0 ] && grep -q '^SKIPPED' "$log" && status="skipped: $(grep -m1 '^SKIPPED' "$log" | cut -c10- | tr '\t' ' ')"
    rm -f "$log"
    printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - start))" >> "$STEPS"
    echo "--- $name: $status in $((SECONDS - start)) s"
}

run "machine and versions" 0 20 'if [ "$HAVE_GPU" = 1 ]; then nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu_name.txt"; else echo "no GPU"; fi;
"$PY" -c "import torch, triton, sys; print(\"python\", sys.version.split()[0], \"| torch\", torch.__version__, \"| cuda\", torch.version.cuda, \"| triton\", triton.__version__)"'
run "extension: the prebuilt one where its stamp matches" 0 20 '"$PY" benchmarks/gpu/prebuilt.py install || true'
run "extension: built from source otherwise (sm_90)" 1 240 '"$PY" -c "import gspo_kernels.backends._C" 2>/dev/null && echo "extension present" || {
    MAX_JOBS=16 GSPO_CUDA_ARCHS=90 "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -n 30 "$OUT/build.log"; exit 1; }; }
"$PY" -c "import gspo_kernels.backends._C as c; print(\"extension with_cuda =\", c.with_cuda)"'
run "cuda and triton against the float64 reference, V = 1000 (fp32/bf16/fp16, padded/packed, fused linear)" 1 90 \
    '"$PY" -m gspo_kernels check --backends cuda,triton --vocab 1000 2>&1 | tee "$OUT/check_v1000.txt" | tail -n 4'
run "cuda and triton against the float64 reference, V = 151936" 1 90 \
    '"$PY" -m gspo_kernels check --backends cuda,triton --vocab 151936 --batch 2 2>&1 | tee "$OUT/check_v151936.txt" | tail -n 4'
run "the tile kernels (fused=True) against the float64 reference" 1 90 \
    '"$PY" -m pytest tests/linear/test_fused_linear_tiled.py -q -x -p no:cacheprovider 2>&1 | tail -n 3'
run "compute-sanitizer memcheck, each CUDA op once" 1 90 \
    'compute-sanitizer --tool memcheck --error-exitcode 9 "$PY" benchmarks/gpu/sanitizer_probe.py --once 2>&1 | tee "$OUT/memcheck.txt" | tail -n 4'
run "forward + backward, N = 2048 and 16384, V = 151936, bf16: ours (plain, soft-capped, top-k, top-p, min-p) against eager and torch.compile" 1 200 \
    '"$PY" -m gspo_kernels bench --shapes 2x1024x151936,16x1024x151936 --providers eager,compile,triton,cuda,tx_softcap,tx_top_k,tx_top_p,tx_min_p --reps 5 --budget 8 --json "$OUT/gpu_bench.json" 2>&1 | grep -v "^\[" | tee "$OUT/gpu_bench.txt"'
run "CUDA-graph replay against eager, N = 2048 and 16384" 1 60 \
    '"$PY" benchmarks/gpu/cuda_graph.py --tokens 2048,16384 --vocab 151936 --backends cuda,triton --reps 10 --json "$OUT/gpu_cuda_graph.json" 2>&1 | tee "$OUT/gpu_cuda_graph.txt" | tail -n 8'
run "fused linear, N = 16384 in sequences of 1024, H = 4096, V = 151936, bf16: one and two passes, the tiles, Liger and CCE (with .whl) against the materialized path" 1 120 \
    'compgen -G ".whl/*.whl" >/dev/null && "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/peers .whl/liger_kernel-*.whl .whl/cut_cross_entropy-*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/peers";
"$PY" -m gspo_kernels bench --linear 16384x4096x151936/1024 --providers materialized,fused,fused_two_pass,fused_tiles,liger,cce --modes fwd+bwd --reps 3 --budget 10 --json "$OUT/gpu_bench_linear.json" 2>&1 | grep -v "^\[" | tee "$OUT/gpu_bench_linear.txt"'
run "batch invariance at N = 4096 (rows alone against in a batch)" 1 60 \
    '"$PY" benchmarks/gpu/batch_invariance_probe.py --device cuda --paths cuda,triton,tiles --sizes 4096 --hidden 4096 --vocab 151936 --dtype bf16 2>&1 | tee "$OUT/batch_invariance.txt" | tail -n 6'
# What the budget leaves after the headline goes to these, in this order; each is skipped once
# the budget is spent. The wheels (.whl, benchmarks/gpu/wheels.sh) are needed by Megatron-Core only.
run "distributed: the NCCL path in a group of one GPU" 1 60 \
    '"$PY" benchmarks/gpu/nccl_group_of_one.py 2>&1 | tee "$OUT/nccl_group_of_one.txt" | tail -n 9'
run "test suite on the GPU: the cuda and triton tests (one line a test)" 1 240 \
    '"$PY" -m pytest tests -v -p no:cacheprovider --maxfail 25 -k "(cuda or triton) and not compile" > "$OUT/pytest_gpu.txt" 2>&1; rc=$?;
grep -E "FAILED|ERROR" "$OUT/pytest_gpu.txt" | head -n 30; tail -n 2 "$OUT/pytest_gpu.txt"; exit $rc'
run "fused linear over the engine's kept sets (k = 64 and 512, PyTorch products) against the full vocabulary, N = 16384, H = 4096, V = 151936, bf16" 1 90 \
    '"$PY" -m gspo_kernels bench --linear 16384x4096x151936/1024 --providers fused,kept_64,kept_512 --modes fwd+bwd --reps 3 --budget 10 --json "$OUT/gpu_bench_kept.json" 2>&1 | grep -v "^\[" | tee "$OUT/gpu_bench_kept.txt"'
run "Megatron-Core against ours, N = 16384, V = 151936, bf16 (needs .whl)" 1 120 \
    'compgen -G ".whl/*.whl" >/dev/null || { echo "SKIPPED: no .whl carried"; exit 0; };
"$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site";
"$PY" benchmarks/gpu/megatron_group_of_one.py --json "$OUT/gpu_megatron.json" 2>&1 | tee "$OUT/gpu_megatron.txt" | tail -n 6'
"$PY" benchmarks/gpu/summarize.py "$OUT" > "$OUT/summary.md" && head -n 24 "$OUT/summary.md"  # every step's row
echo "first: done in $SECONDS s; steps:"
column -t -s "$(printf '\t')" "$STEPS" 2>/dev/null || cat "$STEPS"
# The run fails when a step failed or timed out; skipped steps (no GPU, no budget left) do not fail it.
FAILED_STEPS="$(awk -F'\t' '$2 ~ /^(failed|timed out)/ {print "  " $1 ": " $2}' "$STEPS")"
# A run brings back at most 8 files: everything but the summary travels in one archive.
# (The archive is written outside $OUT first: tar fails on an archive that grows inside the folder it reads.)
ARCHIVE="$(mktemp -d)/first_logs.tgz"
tar czf "$ARCHIVE" -C "$OUT" --exclude summary.md --exclude summary.json . \
    && mv "$ARCHIVE" "$OUT/" && find "$OUT" -maxdepth 1 -type f ! -name summary.md ! -name summary.json ! -name first_logs.tgz -delete
if [ -n "$FAILED_STEPS" ]; then
    printf 'first: FAILED steps:\n%s\n' "$FAILED_STEPS"
    exit 1
fi
