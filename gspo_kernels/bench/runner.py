"""Runs providers x shapes x modes and collects one row per measurement."""

from __future__ import annotations

import datetime
import gc
import os
import platform
import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch

from .memory import cpu_peak_bytes, gpu_peak_bytes
from .problem import DTYPES, Shape, floor_bytes, make_bench_problem
from .providers import PROVIDERS, Provider
from .timing import MODES, copy_bandwidth_gbs, time_mode


@dataclass(frozen=True)
class SuiteConfig:
    shapes: tuple[Shape, ...]
    dtype: str = "bf16"
    providers: tuple[str, ...] = tuple(PROVIDERS)
    modes: tuple[str, ...] = MODES
    reps: int = 10
    warmup: int = 1
    budget_s: float = 20.0  # per (provider, shape, mode): slow baselines stop after 3 repetitions
    measure_memory: bool = True
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    quick: bool = False  # leave each provider's full_only_modes untimed
    # Rounds over the contenders, each round in the reverse order of the last (A B C, C B A), each
    # contender built, warmed and timed `reps` times per round: a machine's drift over the run then
    # lands on every contender alike instead of on the ones timed last (measure_in_rounds).
    rounds: int = 1


@dataclass
class BenchRow:
    provider: str
    batch: int
    seq_len: int
    vocab: int
    tokens: int
    dtype: str
    mode: str
    device: str
    status: str  # ok | skipped | oom | error
    median_ms: float | None = None
    peak_mem_mib: float | None = None  # forward + backward, beyond the inputs
    floor_fraction: float | None = None  # (byte floor / copy bandwidth) / median time
    note: str = ""
    hidden: int | None = None  # fused-linear problems: H


@dataclass
class SuiteResult:
    meta: dict
    rows: list[BenchRow] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"meta": self.meta, "rows": [asdict(r) for r in self.rows]}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def timing_note(cfg: SuiteConfig) -> str:
    """How many repetitions stand behind each time of a table measured with cfg."""
    least = min(3, cfg.reps)
    reps = f"{cfg.reps}" if least == cfg.reps else f"{least} to {cfg.reps} (fewer than {cfg.reps} past {cfg.budget_s:g} s)"
    note = f"each time: the median of {reps} timed calls after {cfg.warmup} warm-up call(s)"
    if cfg.rounds > 1:
        note += f", in each of {cfg.rounds} rounds over the contenders in alternating order; the rounds' median"
    if _quick_once(cfg):
        note += (f" ({', '.join(_quick_once(cfg))}: one call after a warm-up, in the first round only; "
                 "peak memory without --quick)")
    return note


def _times_once(cfg: SuiteConfig, provider: Provider) -> bool:
    """Whether the suite times `provider` by one call (Provider.quick_once, in a quick suite)."""
    return cfg.quick and provider.quick_once


def _quick_once(cfg: SuiteConfig) -> tuple[str, ...]:
    """Providers a quick suite times once."""
    return tuple(p for p in cfg.providers if p in PROVIDERS and _times_once(cfg, PROVIDERS[p]))


def machine_meta(device: str, bandwidth_gbs: float) -> dict:
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device == "cuda" else _cpu_name(),
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "copy_bandwidth_gbs": round(bandwidth_gbs, 1),
    }
    if device == "cpu":  # huge pages for torch's CPU allocations, or page faults in every contender's time
        meta["thp_alloc"] = os.environ.get("THP_MEM_ALLOC_ENABLE", "0") == "1"
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    return meta


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in str(exc).lower()


@dataclass(frozen=True)
class Measurement:
    """One provider on one problem: what to build, how its rows are labelled, and how the
    peak memory of a step is taken (the byte floor only where one applies)."""

    provider: Provider
    problem: object
    base: dict  # BenchRow fields shared by its rows
    label: str  # progress text
    peak_bytes: Callable  # step -> bytes beyond the inputs
    floor_ms: Callable | None = None  # mode -> milliseconds at the byte floor


def _timed_modes(cfg: SuiteConfig, provider: Provider) -> tuple[str, ...]:
    """The modes the suite times for `provider`: all of cfg.modes but, when quick, its full_only_modes."""
    left = provider.full_only_modes if cfg.quick else ()
    return tuple(mode for mode in cfg.modes if mode not in left)


def _probes_memory(cfg: SuiteConfig, provider: Provider) -> bool:
    """Whether the suite takes `provider`'s peak memory: not for one it leaves out, nor, when quick,
    for one it times once (the float64 oracle's probe, a process of its own, took 24 s of a
    308 s main job on a 2-core AVX512-BF16 EPYC)."""
    return cfg.measure_memory and bool(_timed_modes(cfg, provider)) and not _times_once(cfg, provider)


def measure(cfg: SuiteConfig, m: Measurement, progress) -> list[BenchRow]:
    timed = _timed_modes(cfg, m.provider)
    reason = m.provider.unavailable(cfg.device)
    if reason is not None:
        for _ in range(len(timed) + int(_probes_memory(cfg, m.provider))):
            progress.step(f"{m.label}: skipped")
        return [BenchRow(**m.base, mode=mode, status="skipped", note=reason) for mode in cfg.modes]
    rows = [BenchRow(**m.base, mode=mode, status="skipped", note="timed without --quick")
            for mode in cfg.modes if mode not in timed]
    step = None
    try:
        step = m.provider.build(m.problem)
        reps, warmup = (1, 1) if _times_once(cfg, m.provider) else (cfg.reps, cfg.warmup)
        for mode in timed:
            progress.step(f"{m.label} {mode}")
            ms = time_mode(step, mode, cfg.device, reps, warmup, cfg.budget_s)
            floor = None if m.floor_ms is None else m.floor_ms(mode) / ms
            rows.append(BenchRow(**m.base, mode=mode, status="ok", median_ms=ms, floor_fraction=floor))
        if _probes_memory(cfg, m.provider):
            progress.step(f"{m.label} peak memory")
            peak = m.peak_bytes(step)
            for r in rows:
                r.peak_mem_mib = peak / 2**20
    except Exception as exc:  # one provider failing (OOM, missing op) must not end the suite
        status = "oom" if _is_oom(exc) else "error"
        done = {r.mode for r in rows}
        rows += [BenchRow(**m.base, mode=mode, status=status, note=f"{type(exc).__name__}: {str(exc)[:200]}")
                 for mode in cfg.modes if mode not in done]
    finally:
        del step
        gc.collect()
        if cfg.device == "cuda":
            torch.cuda.empty_cache()
    return rows


def measure_in_rounds(cfg: SuiteConfig, names, measure_one: Callable, once=()) -> list[BenchRow]:
    """Rows of every contender in `names` (measure_one(cfg, name) -> its rows), measured in
    cfg.rounds rounds of alternating order (those in `once`: in the first round only). A row's
    time is the median of its rounds' medians (the mean of two); its peak memory is taken in the
    first round only."""
    names = list(names)
    if cfg.rounds <= 1:
        return [row for name in names for row in measure_one(cfg, name)]
    per_round: dict[str, list[list[BenchRow]]] = {name: [] for name in names}
    for index in range(cfg.rounds):
        round_cfg = replace(cfg, measure_memory=cfg.measure_memory and index == 0)
        for name in names if index % 2 == 0 else names[::-1]:
            if index == 0 or name not in once:
                per_round[name].append(measure_one(round_cfg, name))
    merged = []
    for name in names:
        first, *later = per_round[name]
        later_by_mode = [{r.mode: r for r in rows} for rows in later]
        for row in first:
            same = [row, *(rows[row.mode] for rows in later_by_mode if row.mode in rows)]
            failed = next((r for r in same if r.status != "ok"), None)
            if failed is not None:
                merged.append(failed if row.status == "ok" else row)
                continue
            ms = statistics.median(r.median_ms for r in same)
            if row.floor_fraction is not None:
                row.floor_fraction *= row.median_ms / ms
            row.median_ms = ms
            merged.append(row)
    return merged


def _measure(cfg: SuiteConfig, name: str, problem, shape: Shape, bandwidth: float, progress) -> list[BenchRow]:
    base = dict(provider=name, batch=shape.batch, seq_len=shape.seq_len, vocab=shape.vocab, tokens=shape.tokens,
                dtype=cfg.dtype, device=cfg.device)

    def peak_bytes(step):
        return gpu_peak_bytes(step) if cfg.device == "cuda" else cpu_peak_bytes(name, shape, cfg.dtype)

    def floor_ms(mode):
        return floor_bytes(shape, DTYPES[cfg.dtype], mode) / (bandwidth * 1e9) * 1e3

    return measure(cfg, Measurement(PROVIDERS[name], problem, base, f"{name} {shape}", peak_bytes, floor_ms), progress)


def run_suite(cfg: SuiteConfig, progress) -> SuiteResult:
    bandwidth = copy_bandwidth_gbs(cfg.device)
    result = SuiteResult(meta=machine_meta(cfg.device, bandwidth) | {"dtype": cfg.dtype, "timing": timing_note(cfg)})
    for shape in cfg.shapes:
        problem = make_bench_problem(shape, DTYPES[cfg.dtype], cfg.device)
        result.rows += measure_in_rounds(
            cfg, cfg.providers, lambda round_cfg, name: _measure(round_cfg, name, problem, shape, bandwidth, progress),
            once=_quick_once(cfg))
        del problem
        gc.collect()
    return result


def steps_in(cfg: SuiteConfig) -> int:
    """Progress steps the suite will report (modes, plus a memory step per provider)."""
    per_shape = sum((1 if p in _quick_once(cfg) else max(cfg.rounds, 1)) * len(_timed_modes(cfg, PROVIDERS[p]))
                    + int(_probes_memory(cfg, PROVIDERS[p])) for p in cfg.providers)
    return len(cfg.shapes) * per_shape
