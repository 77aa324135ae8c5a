#!/usr/bin/env bash
# The main job, after all set-up: the gradient check of every backend against the float64
# reference, then the benchmark suite on the default problem (B=8, T=512, V=32768, bf16 on a
# CPU; a grid up to N=65536, V=151936 on a GPU), then the fused-linear problem (N=2048, H=512,
# V=32768 on a CPU), then the tensor-, context- and data-parallel splits on 2 gloo processes
# (N=2048, V=32768), then the host cost of a tiny loss call. Results also go to results/*.json.
# Every table of the long suite is there; its timings take fewer repetitions: 2 rounds over the
# contenders in alternating order (A B C, then C B A), each contender warmed once and timed 3 times
# a round, so that the machine's drift lands on every contender alike
# (benchmarks/cpu/quick_vs_full.py compares the ratios with --full's); the float64 reference is
# timed forward + backward only (not each pass alone), by one warmed call in the first round,
# without its peak memory, and Triton through its CPU interpreter checks 4 of the 12 fused-linear
# cases (each level, dtype and layout; the tests run all 12), so that the job takes minutes on a
# 2-core CPU.
#   ./scripts/main.sh [--full] [extra bench args, e.g. --plot results/bench.png]
# --full: the bench's own repetitions (10, up to 20 s a measurement), every fused-linear mode,
# the reference's single passes and the whole check.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$("$ROOT/scripts/setup_env.sh" | tail -n 1)"
cd "$ROOT"
mkdir -p results
quick=(--reps 3 --rounds 2 --warmup 1 --quick)
# The fused-linear table's quick contenders: the trainer's own path (materialized), ours, plain
# eager and Liger's (where installed); --full adds torch.compile, the float32-product and two-pass
# variants, the batch-invariant path and eager in the model's dtype.
linear=(--modes fwd+bwd --reps 3 --rounds 2 --warmup 1 --providers eager,materialized,liger,fused)
check=(--quick)
if [ "${1:-}" = "--full" ]; then
    shift
    quick=()
    linear=()
    check=()
fi
start=$SECONDS
# THP_MEM_ALLOC_ENABLE=1 in the environment gives torch's CPU allocations huge pages (read once,
# before torch allocates; the tables say whether it was on). Off by default, as torch ships: then
# every contender's time holds its page faults, eager's most (on the 2-core EPYC of 2026-12-04
# eager's fwd+bwd took 640 ms off and 157 ms on, this package's cpu kernel 74 ms either way;
# benchmarks/RESULTS.md).
# Without a GPU the check runs the Triton kernels through Triton's CPU interpreter.
if [ -e /dev/nvidia0 ]; then interpret=0; else interpret=1; fi
TRITON_INTERPRET="${TRITON_INTERPRET:-$interpret}" "$PY" -m gspo_kernels check "${check[@]}"
"$PY" -m gspo_kernels bench "${quick[@]}" --json results/bench.json "$@"
# The fused-linear problem (hidden states and lm_head weight, no logits): forward + backward
# only unless --full.
"$PY" -m gspo_kernels bench --linear "${linear[@]}" --json results/bench_linear.json
# The distributed splits on 2 gloo processes: communication per split, and time against 1 process.
"$PY" -m gspo_kernels bench --distributed --json results/bench_distributed.json
# Ops dispatched and host time of one tiny loss call, per objective and layout.
"$PY" -m gspo_kernels bench --host --json results/bench_host.json
echo "main job: $((SECONDS - start)) s after set-up"
