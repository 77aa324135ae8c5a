"""Tables, JSON and plots of a benchmark run."""

from __future__ import annotations

import json
from collections import defaultdict

from .table import format_table
from .providers import BASELINE
from .runner import BenchRow, SuiteResult
from .timing import MODES


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def timing_cells(cell: dict, name: str):
    """(each mode's formatted ms, fwd+bwd ms, fwd+bwd peak MiB, the fwd+bwd row) of one
    provider, from its rows keyed by (provider, mode)."""
    full = cell.get((name, "fwd+bwd"))
    modes = [_fmt(cell[(name, m)].median_ms if (name, m) in cell else None, ".1f") for m in MODES]
    return modes, (full.median_ms if full else None), (full.peak_mem_mib if full else None), full


def _by_shape(rows):
    groups = defaultdict(list)
    for r in rows:
        groups[(r.batch, r.seq_len, r.vocab)].append(r)
    return groups


def huge_pages(meta: dict) -> str:
    """The footer's note of whether torch's CPU allocations had huge pages (runner.machine_meta)."""
    if "thp_alloc" not in meta:
        return ""
    return f" | huge pages {'on' if meta['thp_alloc'] else 'off'} (THP_MEM_ALLOC_ENABLE)"


def format_suite(result: SuiteResult) -> str:
    out = []
    for (b, t, v), rows in _by_shape(result.rows).items():
        cell: dict[tuple[str, str], BenchRow] = {(r.provider, r.mode): r for r in rows}
        providers = list(dict.fromkeys(r.provider for r in rows))
        base = cell.get((BASELINE, "fwd+bwd"))
        base_ms = base.median_ms if base and base.status == "ok" else None
        base_mem = base.peak_mem_mib if base else None
        header = ["provider", *(f"{m} ms" for m in MODES), f"speed-up vs {BASELINE}", "peak MiB",
                  f"memory vs {BASELINE}", "% of byte floor"]
        table, skipped, failed = [], [], []
        for name in providers:
            first = next(r for r in rows if r.provider == name)
            if all(r.status == "skipped" for r in rows if r.provider == name):
                skipped.append(f"{name} ({first.note})")
                continue
            left = [r for r in rows if r.provider == name and r.status == "skipped"]
            if left:
                skipped.append(f"{name} {' and '.join(r.mode for r in left)} ({left[0].note})")
            if all(cell.get((name, m)) is None or cell[(name, m)].status != "ok" for m in MODES):
                table.append([name, *([first.status.upper()] * 3), "-", "-", "-", first.note[:60]])
                continue
            errors = [r for r in rows if r.provider == name and r.status == "error"]
            if errors:  # a mode that failed where others ran: its '-' cells say why below the table
                failed.append(f"{name} {' and '.join(r.mode for r in errors)} ({errors[0].note[:120]})")
            modes, ms, mem, full = timing_cells(cell, name)
            table.append([
                name,
                *modes,
                f"{base_ms / ms:.2f}x" if base_ms and ms else "-",
                _fmt(mem, ".0f"),
                f"{mem / base_mem:.2f}x" if mem is not None and base_mem else "-",
                _fmt(full.floor_fraction * 100 if full and full.floor_fraction else None, ".1f"),
            ])
        dtype = rows[0].dtype
        out.append(f"B={b} T={t} V={v} (N={b * t} tokens), {dtype}, {rows[0].device}")
        out.append(format_table(header, table))
        if skipped:
            out.append("skipped: " + "; ".join(skipped))
        if failed:
            out.append("failed: " + "; ".join(failed))
        out.append("")
    m = result.meta
    out.append(f"{m.get('device')} | torch {m.get('torch')} | triton {m.get('triton', '-')} | "
               f"{m.get('cpu_threads')} CPU threads | copy bandwidth {m.get('copy_bandwidth_gbs')} GB/s"
               f"{huge_pages(m)} | {m.get('date')}")
    out.append("peak MiB: memory beyond the inputs during one forward + backward (the gradient included). "
               "% of byte floor: (3*N*V*bytes / copy bandwidth) / fwd+bwd time.")
    if m.get("timing"):
        out.append(m["timing"] + ".")
    return "\n".join(out)


def format_sweep(result: SuiteResult) -> str:
    """One line per shape: forward + backward ms and peak MiB of each provider that ran."""
    rows = [r for r in result.rows if r.mode == "fwd+bwd" and r.status == "ok"]
    providers = list(dict.fromkeys(r.provider for r in rows))
    cell = {(r.batch, r.seq_len, r.vocab, r.provider): r for r in rows}
    table = []
    for b, t, v in dict.fromkeys((r.batch, r.seq_len, r.vocab) for r in rows):
        line = [f"{b}x{t}x{v}", str(b * t)]
        for name in providers:
            r = cell.get((b, t, v, name))
            line.append("-" if r is None else f"{r.median_ms:.1f} / {_fmt(r.peak_mem_mib, '.0f')}")
        table.append(line)
    return format_table(["BxTxV", "N", *(f"{p} ms / MiB" for p in providers)], table)


def write_json(result: SuiteResult, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result.to_json(), f, indent=1)


def plot_sweeps(vocab_sweep: SuiteResult, token_sweep: SuiteResult, path: str) -> None:
    """Time and memory of forward + backward against V (fixed N) and N (fixed V)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for col, (result, key, label) in enumerate([(vocab_sweep, "vocab", "vocab size V"),
                                                (token_sweep, "tokens", "tokens N")]):
        rows = [r for r in result.rows if r.mode == "fwd+bwd" and r.status == "ok"]
        for name in dict.fromkeys(r.provider for r in rows):
            pts = sorted((getattr(r, key), r.median_ms, r.peak_mem_mib) for r in rows if r.provider == name)
            style = dict(marker="o", linewidth=2.5 if name in ("cpu", "cuda", "triton") else 1.2, label=name)
            axes[0, col].plot([p[0] for p in pts], [p[1] for p in pts], **style)
            if all(p[2] is not None for p in pts):
                axes[1, col].plot([p[0] for p in pts], [p[2] for p in pts], **style)
        fixed = rows[0].tokens if key == "vocab" else rows[0].vocab if rows else None
        fixed_label = f"N = {fixed}" if key == "vocab" else f"V = {fixed}"
        axes[0, col].set(title=f"forward + backward time ({fixed_label})", xlabel=label, ylabel="ms")
        axes[1, col].set(title=f"peak memory beyond inputs ({fixed_label})", xlabel=label, ylabel="MiB")
        for ax in axes[:, col]:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    m = vocab_sweep.meta
    fig.suptitle(f"GSPO loss, {m.get('dtype')} logits, {m.get('device')} ({m.get('date', '')[:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
