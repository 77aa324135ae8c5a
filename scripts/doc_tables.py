"""The measured tables that docs/performance.md quotes, made from the main job's JSON, so that a
page's figures are pasted from a run rather than typed; and a check of the figures that do not
depend on the machine (the distributed splits' collectives and payloads) against the pages.

    python scripts/doc_tables.py [--results results]   # print the tables of the last main job
    python scripts/doc_tables.py --check-docs          # exit 1 if a page's exact figures differ
                                                       # from results/bench_distributed.json, or
                                                       # README quotes a figure no holder holds

tests/cli/test_doc_tables.py runs the check on a fresh count, so those figures cannot drift.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = (ROOT / "docs" / "performance.md", ROOT / "docs" / "distributed.md")
# A row of performance.md's distributed table: '| tp | 2 / 0 | 393,216 B |' (split, collectives, payload).
DOCUMENTED_ROW = re.compile(r"^\| ([\w+-]+) \| \d+ / \d+ \| [\d,]+ B \|", re.MULTILINE)


def _load(path: pathlib.Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _machine(meta: dict) -> str:
    return f"{meta.get('device')}, {meta.get('cpu_threads')} threads, torch {meta.get('torch')}, {meta.get('date')}"


def loss_table(result: dict) -> str:
    rows = [r for r in result["rows"] if r["mode"] == "fwd+bwd" and r["status"] == "ok"]
    lines = [f"Loss on logits ({_machine(result['meta'])}); {result['meta'].get('timing', '')}", "",
             "| provider | problem (B x T x V) | fwd+bwd ms | peak MiB beyond the inputs |", "|---|---|---|---|"]
    lines += [f"| `{r['provider']}` | {r['batch']} x {r['seq_len']} x {r['vocab']} | {r['median_ms']:.1f} | "
              f"{r['peak_mem_mib']:.0f} |" for r in rows]
    return "\n".join(lines)


def linear_table(result: dict) -> str:
    rows = [r for r in result["rows"] if r["mode"] == "fwd+bwd" and r["status"] == "ok"]
    lines = [f"Fused linear ({_machine(result['meta'])}); {result['meta'].get('timing', '')}", "",
             "| contender | N x H x V | fwd+bwd ms | peak MiB beyond the inputs and returned gradients |",
             "|---|---|---|---|"]
    lines += [f"| `{r['provider']}` | {r['tokens']} x {r['hidden']} x {r['vocab']} | {r['median_ms']:.0f} | "
              f"{r['peak_mem_mib']:.0f} |" for r in rows]
    return "\n".join(lines)


def distributed_rows(result: dict) -> dict[str, str]:
    """split -> the exact part of its row: '| tp | 2 / 0 | 393,216 B |'."""
    out = {}
    for split, r in result["splits"].items():
        calls, nbytes = r["calls"], sum(r["bytes"].values())
        out[split] = f"| {split} | {calls.get('forward', 0)} / {calls.get('backward', 0)} | {nbytes:,} B |"
    return out


def distributed_table(result: dict) -> str:
    """The table `bench --distributed` prints (bench/distributed.py's format_result), under the machine."""
    from gspo_kernels.bench.distributed import format_result

    return f"Distributed ({_machine(result.get('meta', {}))})\n\n" + format_result(result)


def host_table(result: dict) -> str:
    """The table `bench --host` prints (bench/host.py's format_rows), under the machine."""
    from gspo_kernels.bench.host import HostRow, format_rows

    return f"Host cost of a tiny call ({_machine(result['meta'])})\n\n" + format_rows(
        [HostRow(**r) for r in result["rows"]])


def check_docs(distributed: dict, pages=PAGES) -> list[str]:
    """What the pages say of the splits' collectives and payloads that `distributed` (a
    `bench --distributed` result) contradicts: performance.md's table rows hold each split's
    exact row start, distributed.md each payload."""
    rows = distributed_rows(distributed)
    if not rows:
        return ["the distributed result holds no splits: nothing to check the pages against"]
    table_page, prose_page = (pathlib.Path(p) for p in pages)
    table_text, prose_text = table_page.read_text(), prose_page.read_text()
    # And the other way: every split the page's table documents must still be measured.
    problems = [f"{table_page.name}: documents a {split} row that the result no longer has"
                for split in DOCUMENTED_ROW.findall(table_text) if split not in rows]
    for split, row in rows.items():
        if row not in table_text:
            problems.append(f"{table_page.name}: no row starting {row!r}")
        payload = row.split("|")[3].strip()
        if payload not in prose_text:
            problems.append(f"{prose_page.name}: the {split} payload {payload!r} is not stated")
    return problems


# A measured figure as a page quotes it: a number and its unit (times, memory, ratios, shares).
FIGURE = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?) ?(ms|s|min|MiB|GiB|GB/s|GB|x|%)(?!\w)")
# The pages that hold measured figures; README quotes them and must quote them as they are held.
HOLDERS = (ROOT / "benchmarks" / "RESULTS.md", ROOT / "docs" / "performance.md")
QUOTING = (ROOT / "README.md",)


# How a table's header names a column of each unit.
_HEADER_UNIT = {"ms": r"\bms\b", "s": r"\bs\b|seconds", "min": r"\bmin\b", "MiB": r"MiB", "GiB": r"GiB",
                "GB/s": r"GB/s", "GB": r"\bGB\b", "x": r"\bx\b|\bvs\b|speed-up|ratio", "%": r"%"}


def _table_cells(text: str):
    """(header line, cell text) of every body cell of every Markdown table in `text`."""
    header = None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
        elif header is None:
            header = line
        elif not re.fullmatch(r"[|\s:-]+", line):
            for cell in line.strip("|").split("|"):
                yield header, cell.strip()


def _held(value: str, unit: str, text: str) -> bool:
    """Whether `text` holds the figure: the same number (not the end or start of a longer one)
    with its unit, or alone in a table cell (with at most a parenthesised note) of a table whose
    header names the unit."""
    if re.search(rf"(?<![\w.]){re.escape(value)} ?{re.escape(unit)}(?!\w)", text):
        return True
    alone = re.compile(rf"\**{re.escape(value)}\**(?:\s*\([^)]*\))?")
    return any(alone.fullmatch(cell) and re.search(_HEADER_UNIT[unit], header) for header, cell in _table_cells(text))


def unheld_figures(quoting=QUOTING, holders=HOLDERS) -> list[str]:
    """The figures `quoting` pages state that no holder page holds: a rounded, stale or typed
    figure where the page should quote the measured one (or link to it). A figure written with
    "~" before it is an estimate (arithmetic, not a measurement) and is not checked."""
    held = "\n".join(pathlib.Path(p).read_text() for p in holders)
    problems = []
    for page in map(pathlib.Path, quoting):
        text = page.read_text()
        for match in FIGURE.finditer(text):
            if text[max(match.start() - 1, 0)] == "~":
                continue
            if not _held(*match.groups(), held):
                problems.append(f"{page.name}: {match.group(0)!r} is held by none of "
                                f"{', '.join(pathlib.Path(h).name for h in holders)}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=str(ROOT / "results"), help="the main job's JSON folder")
    parser.add_argument("--check-docs", action="store_true")
    args = parser.parse_args()
    folder = pathlib.Path(args.results)
    distributed = _load(folder / "bench_distributed.json")
    if args.check_docs:
        if distributed is None:
            print(f"no {folder / 'bench_distributed.json'}: run ./scripts/main.sh first")
            return 2
        problems = check_docs(distributed) + unheld_figures()
        print("\n".join(problems) if problems else "the pages' exact distributed figures match, and README "
                                                     "quotes only figures RESULTS.md or performance.md hold")
        return 1 if problems else 0
    makers = {"bench.json": loss_table, "bench_linear.json": linear_table, "bench_distributed.json": distributed_table,
              "bench_host.json": host_table}
    found = False
    for name, make in makers.items():
        result = _load(folder / name)
        if result is not None:
            found = True
            print(make(result) + "\n")
    if not found:
        print(f"no main-job JSON in {folder}: run ./scripts/main.sh first")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
