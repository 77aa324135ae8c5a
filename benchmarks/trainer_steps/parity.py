"""One TRL drop-in step and one verl actor update, each against the trainer's own path on the
same tiny random Llama and batch, with the peak device memory of each path; for
benchmarks/gpu/check.sh (bf16, the fused forward on) and runnable on a CPU.

    python benchmarks/trainer_steps/parity.py [--device cuda] [--dtype bf16|float32] [--only trl|verl]
        [--vocab V --hidden H --layers L --rows B --prompt P --completion C]

TRL: parity_trl.py (GRPOTrainer._compute_loss + backward, GSPO settings). verl:
parity_verl.py (ActorRolloutRefWorker's compute_log_prob and update_actor, verl's gspo
against gk_gspo with use_fused_kernels and impl_backend=gspo_kernels). Each runs in a process of
its own: verl's patch sets the forward of the model class for the whole process, and a missing
trainer skips only its own row. Tolerances and why: beside TOLERANCES in each file. Memory is
torch.cuda.max_memory_allocated over the step (peak) and its rise above what was allocated when
the step began (the step's own); on a CPU it is not taken.

Exit status: 0 when every check that ran passed (a trainer that cannot be imported is reported
SKIPPED and does not fail the run: carry .whl, see benchmarks/gpu/wheels.sh), 1 on a mismatch or
a crash."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

# Sizes: a Qwen-sized vocabulary on a GPU, where the logits dominate the memory; small on a CPU,
# where the run checks the logic.
GPU_SIZES = dict(vocab=151936, hidden=256, layers=2, rows=8, prompt=64, completion=1024)
CPU_SIZES = dict(vocab=512, hidden=64, layers=2, rows=4, prompt=8, completion=16)


def _args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=("bf16", "float32"), default="bf16")
    parser.add_argument("--only", choices=("trl", "verl"))
    for name in GPU_SIZES:
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--child", choices=("trl", "verl"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = CPU_SIZES if args.device.startswith("cpu") else GPU_SIZES
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def _child(args) -> None:
    """Runs one trainer's step in this process and prints its result line."""
    import torch

    from parity_common import report

    torch.manual_seed(0)
    if args.device.startswith("cpu"):
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    if args.child == "trl":
        from parity_trl import run
    else:
        from parity_verl import run
    report(run(args))
    # At once: a live trainer (accelerate's state, verl's gloo group, Ray's modules) has made a
    # clean interpreter exit hang or abort after the result was out (tests/integrations/trainer_world.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_child(kind: str, argv: list[str]) -> dict:
    from parity_common import RESULT

    proc = subprocess.run([sys.executable, __file__, "--child", kind, *argv], capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-25:]
        return {"trainer": kind, "status": "crashed", "reason": f"exit {proc.returncode}", "log": tail}
    result = json.loads(lines[-1][len(RESULT):])
    if result.get("status") != "skipped":
        bad = [c for c in result["checks"] if not (c["error"] <= c["tolerance"])]  # NaN fails too
        result["status"] = "mismatch" if bad else "ok"
    return result


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value) or value >= 1e-3 or value == 0):
        return f"{value:.4g}"
    return f"{value:.2e}" if isinstance(value, float) else str(value)


def _print(result: dict) -> None:
    print(f"\n=== {result['trainer']}: {result['status'].upper()}"
          + (f" ({result['setting']})" if "setting" in result else ""))
    if result["status"] in ("skipped", "crashed"):
        print(result["reason"])
        for line in result.get("log", []):
            print("  " + line)
        return
    print("| path | peak MiB | step's own MiB |\n|---|---|---|")
    for row in result["memory"]:
        print(f"| {row['path']} | {_fmt(row['peak_mib'])} | {_fmt(row['step_mib'])} |")
    print("| check | error | tolerance | |\n|---|---|---|---|")
    for c in result["checks"]:
        print(f"| {c['what']} | {_fmt(c['error'])} | {_fmt(c['tolerance'])} | {'ok' if c['error'] <= c['tolerance'] else 'FAIL'} |")
    for note in result.get("notes", []):
        print(f"- {note}")


def main(argv=None) -> int:
    args = _args(argv)
    if args.child:
        _child(args)
        return 0
    argv = [a for a in (argv if argv is not None else sys.argv[1:])]
    forwarded = argv + [f"--{n}={getattr(args, n)}" for n in GPU_SIZES if f"--{n}" not in " ".join(argv)]
    results = [_run_child(kind, forwarded) for kind in ("trl", "verl") if args.only in (None, kind)]
    for result in results:
        _print(result)
    failed = [r["trainer"] for r in results if r["status"] in ("mismatch", "crashed")]
    print(f"\ntrainer steps on {args.device}, {args.dtype}: "
          + ", ".join(f"{r['trainer']} {r['status']}" for r in results))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
