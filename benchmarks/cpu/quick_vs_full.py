"""Do the main job's short timings rank the contenders as the long ones do? Reads two
`python -m gspo_kernels bench --json` files of the same problems (the quick run and the full
one; the loss suite or `--linear`) and prints, for every contender and mode timed in both, its
time over the baseline's (eager for the loss, materialized for fused linear) in each, and the
quick ratio over the full one.

    python benchmarks/cpu/quick_vs_full.py QUICK.json FULL.json [--tolerance 0.15]

Exits 1 if a ratio differs by more than the tolerance (relative), else 0.
"""

from __future__ import annotations

import argparse
import json
import sys

BASELINES = ("materialized", "eager")  # fused linear is timed against materialized, the loss against eager


def ratios(path: str) -> dict[tuple, float]:
    """(shape, provider, mode) -> time over the baseline's, for every row timed in `path`."""
    with open(path) as f:
        rows = [r for r in json.load(f)["rows"] if r["status"] == "ok" and r["median_ms"]]
    times = {(r["tokens"], r.get("hidden"), r["vocab"], r["provider"], r["mode"]): r["median_ms"] for r in rows}
    out = {}
    for (tokens, hidden, vocab, provider, mode), ms in times.items():
        base = next((times[(tokens, hidden, vocab, b, mode)] for b in BASELINES
                     if (tokens, hidden, vocab, b, mode) in times), None)
        if base and provider not in BASELINES:
            out[((tokens, hidden, vocab), provider, mode)] = ms / base
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("quick")
    parser.add_argument("full")
    parser.add_argument("--tolerance", type=float, default=0.15)
    args = parser.parse_args()
    quick, full = ratios(args.quick), ratios(args.full)
    common = [key for key in full if key in quick]
    if not common:
        print("no contender timed in both files")
        return 1
    print("| problem (N, H, V) | contender | mode | quick / baseline | full / baseline | quick ratio / full ratio |")
    print("|---|---|---|---|---|---|")
    off = 0
    for key in common:
        agreement = quick[key] / full[key]
        flag = "" if abs(agreement - 1) <= args.tolerance else " **off**"
        off += bool(flag)
        shape, provider, mode = key
        print(f"| {shape} | {provider} | {mode} | {quick[key]:.2f} | {full[key]:.2f} | {agreement:.2f}{flag} |")
    print(f"\n{len(common) - off} of {len(common)} ratios agree within {args.tolerance:.0%}")
    return 1 if off else 0


if __name__ == "__main__":
    sys.exit(main())
