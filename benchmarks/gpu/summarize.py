"""The summary of a GPU part's run: its steps (name, status, seconds), the GPU, the versions and
the benchmark tables the part wrote to its output folder, as summary.json and a markdown block.

    python benchmarks/gpu/summarize.py OUT                  # prints the markdown, writes OUT/summary.json
    python benchmarks/gpu/summarize.py --append SUMMARY_MD  # adds it to benchmarks/RESULTS.md (here,
                                                            # with the files the device run brought back)
"""

from __future__ import annotations

import datetime
import json
import pathlib
import sys

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "RESULTS.md"
TABLES = ("check_v1000.txt", "check_v151936.txt", "memcheck.txt", "gpu_bench.txt", "gpu_cuda_graph.txt",
          "gpu_bench_linear.txt", "batch_invariance.txt", "nccl_group_of_one.txt", "gpu_megatron.txt")


def _steps(out: pathlib.Path) -> list[dict]:
    path = out / "first_steps.tsv"
    if not path.exists():
        return []
    rows = [line.split("\t") for line in path.read_text().splitlines() if line.strip()]
    return [{"step": r[0], "status": r[1], "seconds": int(r[2])} for r in rows if len(r) == 3]


def summarize(out: pathlib.Path) -> str:
    gpu = (out / "gpu_name.txt").read_text().strip() if (out / "gpu_name.txt").exists() else "no GPU"
    steps = _steps(out)
    today = datetime.date.today().isoformat()
    (out / "summary.json").write_text(json.dumps({"date": today, "gpu": gpu, "steps": steps,
                                                  "files": sorted(p.name for p in out.iterdir())}, indent=1))
    lines = [f"## GPU, `check.sh first`: {gpu} — {today}", "",
             "| step | status | seconds |", "|---|---|---|"]
    lines += [f"| {s['step']} | {s['status']} | {s['seconds']} |" for s in steps]
    for name in TABLES:
        path = out / name
        if path.exists() and path.read_text().strip():
            lines += ["", f"`{name}`:", "", "```", path.read_text().strip()[-4000:], "```"]
    return "\n".join(lines) + "\n"


def append(summary: pathlib.Path) -> None:
    text = summary.read_text()
    if "no GPU" in text.splitlines()[0]:
        raise SystemExit("summarize: this summary is a rehearsal without a GPU; not added to RESULTS.md")
    with RESULTS.open("a") as f:
        f.write("\n" + text)
    print(f"summarize: added {summary} to {RESULTS}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--append":
        append(pathlib.Path(sys.argv[2]))
    elif len(sys.argv) == 2:
        print(summarize(pathlib.Path(sys.argv[1])), end="")
    else:
        sys.exit(__doc__)
