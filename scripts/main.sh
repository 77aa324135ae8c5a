#!/usr/bin/env bash
# The main job, after all set-up: the gradient check of every backend against the float64
# reference, then the benchmark suite on the default problem (B=8, T=512, V=32768, bf16 on a
# CPU; a grid up to N=65536, V=151936 on a GPU), then the fused-linear problem (N=2048, H=512,
# V=32768 on a CPU), then the tensor-, context- and data-parallel splits on 2 gloo processes
# (N=2048, V=32768). Results also go to results/bench*.json.
#   ./scripts/main.sh [extra bench args, e.g. --plot results/bench.png]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$("$ROOT/scripts/setup_env.sh" | tail -n 1)"
cd "$ROOT"
mkdir -p results
# Without a GPU the check runs the Triton kernels through Triton's CPU interpreter.
if [ -e /dev/nvidia0 ]; then interpret=0; else interpret=1; fi
TRITON_INTERPRET="${TRITON_INTERPRET:-$interpret}" "$PY" -m gspo_kernels check
"$PY" -m gspo_kernels bench --json results/bench.json "$@"
# The fused-linear problem (hidden states and lm_head weight, no logits), forward + backward only
# to keep the main job a few minutes: `bench --linear` alone times forward and backward too.
"$PY" -m gspo_kernels bench --linear --modes fwd+bwd --reps 3 --json results/bench_linear.json
# The distributed splits on 2 gloo processes: communication per split, and time against 1 process.
"$PY" -m gspo_kernels bench --distributed --json results/bench_distributed.json
