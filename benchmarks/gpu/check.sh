#!/usr/bin/env bash
# The one prepared GPU run, with that machine's own python3 (torch 2.11, triton 3.6, nvcc 13.0);
# its "first" part took 215 s on an H200 (2026-12-04, benchmarks/RESULTS.md), the other parts'
# run times are unmeasured (docs/performance.md, "Unmeasured"). Builds the extension from
# source, checks the cuda and triton backends against the float64 reference (fp32/bf16/fp16,
# padded and packed, V = 1000 and V = 151936), runs compute-sanitizer memcheck over every CUDA
# kernel variant, runs the test suite on the GPU, and benchmarks forward + backward at
# N = 16384, V = 151936, bf16 against the byte floor, and the fused-linear loss at N = 16384,
# H = 4096, V = 151936; runs the distributed code paths on NCCL in a group of one GPU. Logs and
# JSON go to $OUT (the run brings them back).
#
#   on a GPU:    bash benchmarks/gpu/check.sh [first|check|bench|invariant|all]   (default all)
# "first" (benchmarks/gpu/first.sh) is the one to run first on a GPU: the headline truth
# in at most 9 minutes, each step under its own timeout. The others are each meant to fit one run
# of at most 9 minutes with the prebuilt extension (.prebuilt/ beside the tree:
# benchmarks/gpu/prebuild.sh; without it the build takes minutes of the run); "all" takes over
# 600 s: run the parts one by one.
#   optional:    liger_kernel's wheel in .whl/ beside the tree, to benchmark Liger too (RESULTS.md)
#   trainers:    the "check" part's trainer step needs TRL, verl and what they import, which that
#                machine lacks: here, `bash benchmarks/gpu/wheels.sh` (fills the git-ignored .whl/,
#                about 30 MiB), then run with .whl/ beside the tree on the GPU machine; without
#                them the step prints SKIPPED and the rest still runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = first ]; then exec bash benchmarks/gpu/first.sh; fi
OUT="${OUT:-$(mktemp -d)}"
PY="${PY:-python3}"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export MAX_JOBS="${MAX_JOBS:-16}" GSPO_CUDA_ARCHS="${GSPO_CUDA_ARCHS:-90}"
status=0
PART="${1:-all}"
step() { printf '\n=== %s (%s)\n' "$1" "$(date +%T)"; }
want() { [ "$PART" = all ] || [ "$PART" = "$1" ]; }

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
"$PY" -c "import torch, triton, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| triton', triton.__version__)"
nvcc --version | tail -n 2 | head -n 1

step "extension: prebuilt where its stamp matches, else built (sm_${GSPO_CUDA_ARCHS})"
if ! "$PY" benchmarks/gpu/prebuilt.py install && ! "$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
    tail -n 40 "$OUT/build.log"; exit 1
fi
"$PY" -c "import gspo_kernels.backends._C as c; print('extension with_cuda =', c.with_cuda)"

if want check; then
step "check against the float64 reference"
"$PY" -m gspo_kernels check --backends cuda,triton,torch --vocab 1000 2>&1 | tee "$OUT/check_v1000.txt" | tail -n 3 || status=1
"$PY" -m gspo_kernels check --backends cuda,triton --vocab 151936 --batch 4 2>&1 | tee "$OUT/check_v151936.txt" | tail -n 3 || status=1
grep -h "FAIL" "$OUT"/check_v*.txt | head -n 20

step "compute-sanitizer memcheck"
compute-sanitizer --tool memcheck --error-exitcode 9 "$PY" benchmarks/gpu/sanitizer_probe.py 2>&1 | tee "$OUT/memcheck.txt" | tail -n 4 || status=1

step "distributed: the NCCL path in a group of one GPU"
timeout 120 "$PY" benchmarks/gpu/nccl_group_of_one.py 2>&1 | tee "$OUT/nccl_group_of_one.txt" | tail -n 9 || status=1

step "Megatron-Core: its own log-probs against ours, NCCL group of one, N = 16384, V = 151936, bf16"
# Needs megatron-core from .whl (benchmarks/gpu/wheels.sh); prints SKIPPED without it.
timeout 150 "$PY" benchmarks/gpu/megatron_group_of_one.py --json "$OUT/gpu_megatron.json" 2>&1 | tee "$OUT/gpu_megatron.txt" | tail -n 6 || status=1

step "fused-linear tile kernels on the GPU against the float64 reference"
timeout 150 "$PY" -m pytest tests/linear/test_fused_linear_tiled.py tests/linear/test_tile_ops.py -q -x -p no:cacheprovider 2>&1 | tee "$OUT/pytest_tiles.txt" | tail -n 4 || status=1

step "test suite on the GPU"
# The GPU backends only (the cpu and torch ones ran in CI): the row rule, packed isolation,
# precision probes and the objective grid included.
timeout 240 "$PY" -m pytest tests -q -x -p no:cacheprovider -k "(cuda or triton) and not compile" 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -n 6 || status=1

step "trainers: one TRL drop-in step and one verl actor update against their own paths (bf16)"
# benchmarks/trainer_steps/parity.py: loss, gradients and log-probs against TRL's and verl's own
# code on one batch, with each path's peak memory; needs .whl (benchmarks/gpu/wheels.sh): a
# trainer it cannot import is reported SKIPPED and does not fail the run.
timeout 300 "$PY" benchmarks/trainer_steps/parity.py --device cuda --dtype bf16 2>&1 | tee "$OUT/trainer_steps.txt" || status=1
fi

if want bench; then
step "benchmark: N = 16384, V = 151936, bf16"
"$PY" -m gspo_kernels bench --shapes 16x1024x151936 --providers eager,eager_trl,compile,liger,triton,cuda,obj_cispo,obj_sapo,obj_gmpo,obj_clip_corrected \
    --reps 10 --budget 10 --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/gpu_bench.txt" | grep -v '^\[' || status=1

step "benchmark: fused linear, N = 16384, H = 4096, V = 151936, bf16"
"$PY" -m gspo_kernels bench --linear 16384x4096x151936 --providers materialized,liger,cce,fused,fused_tiles --modes fwd+bwd \
    --reps 3 --budget 10 --json "$OUT/gpu_bench_linear.json" 2>&1 | tee "$OUT/gpu_bench_linear.txt" | grep -v '^\[' || status=1

# --- small micro-batches: eager against one CUDA-graph capture replayed, and the
# capture's loss and gradient against the eager call's, bitwise (fails the step otherwise).
step "small micro-batches: eager vs CUDA graph, N = 1024 ... 16384, V = 151936, bf16"
timeout 240 "$PY" benchmarks/gpu/cuda_graph.py --tokens 1024,2048,4096,16384 --vocab 151936 --backends cuda,triton \
    --json "$OUT/gpu_cuda_graph.json" 2>&1 | tee "$OUT/gpu_cuda_graph.txt" || status=1
"$PY" -m gspo_kernels bench --host 2>&1 | tee "$OUT/gpu_host.txt" | tail -n 20 || status=1
# --- end of small micro-batches

fi

# --- batch invariance: its own part, `bash benchmarks/gpu/check.sh invariant` (timeouts of
# 300 + 240 s; also part of "all"). Probe rows alone against the same rows in batches of 1k, 4k
# and 16k, for the cuda and triton backends of the chunked path and the tile kernels
# (fused=True), then two runs of the loss bitwise; then fused_invariant (and
# fused_tiles_invariant) timed against the default at N = 16384, H = 4096, V = 151936.
if want invariant; then
step "batch invariance: rows alone vs in batches of 1k-16k, H = 4096, V = 151936, bf16"
timeout 300 "$PY" benchmarks/gpu/batch_invariance_probe.py --device cuda --paths cuda,triton,tiles \
    --sizes 1024,4096,16384 --hidden 4096 --vocab 151936 --dtype bf16 2>&1 | tee "$OUT/batch_invariance.txt" || status=1

step "benchmark: fused_invariant against fused, N = 16384, H = 4096, V = 151936, bf16"
timeout 240 "$PY" -m gspo_kernels bench --linear 16384x4096x151936 \
    --providers fused,fused_invariant,fused_tiles,fused_tiles_invariant --modes fwd+bwd --reps 3 --budget 10 \
    --json "$OUT/gpu_bench_invariant.json" 2>&1 | tee "$OUT/gpu_bench_invariant.txt" | grep -v '^\[' || status=1
fi
# --- end of batch invariance

step "done: status $status"
exit $status
