"""`python -m gspo_kernels bench`: time and memory of every provider available here."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import replace

import torch

from ..bench.linear import LINEAR_PROVIDERS, LinearShape, format_linear, make_linear_problem, measure_linear
from ..bench.problem import DTYPES, Shape
from ..bench.providers import PROVIDERS
from ..bench.report import format_suite, format_sweep, plot_sweeps, write_json
from ..bench.runner import (SuiteConfig, SuiteResult, machine_meta, measure_in_rounds, run_suite, steps_in,
                            timing_note)
from ..bench.timing import MODES
from .progress import Progress

# The CPU default is B = 8, T = 512, V = 32768 (benchmarks/RESULTS.md's CPU runs); GPU shapes cover
# the common vocabularies.
CPU_SHAPES = ("8x512x32768",)
GPU_SHAPES = tuple(f"{n // 1024}x1024x{v}" for v in (32000, 128256, 151936) for n in (4096, 16384, 65536))
CPU_SWEEPS = (("2x512x{}", (8192, 16384, 32768, 65536)), ("{}x512x32768", (1, 2, 4, 8)))
GPU_SWEEPS = (("16x1024x{}", (32000, 65536, 128256, 151936)), ("{}x1024x151936", (4, 8, 16, 32)))
# Fused linear (NxHxV): N = 2048, H = 512, V = 32768 on a CPU (pass 8192x512x32768 too to see memory
# flat in N).
LINEAR_CPU_SHAPES = "2048x512x32768"
LINEAR_GPU_SHAPES = "16384x4096x151936/1024"


def _csv(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def _checked(parse):
    """An argparse type: the text when each comma-separated item parses, else argparse's
    one-line usage error with the parser's message (not a traceback)."""
    def check(text: str) -> str:
        try:
            for item in _csv(text):
                parse(item)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    return check


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def _linear_shape(text: str) -> None:
    if text != "default":
        LinearShape.parse(text)


def _distributed_shape(text: str) -> None:
    if text != "default" and not re.fullmatch(r"\s*\d+\s*x\s*\d+\s*", text):
        raise ValueError(f"a distributed problem is NxV, e.g. 2048x32768; got {text!r}")


def _run_linear(args, device: str) -> int:
    """The fused-linear problems: the loss from hidden states and the lm_head weight."""
    default = LINEAR_GPU_SHAPES if device == "cuda" else LINEAR_CPU_SHAPES
    shapes = tuple(LinearShape.parse(s) for s in _csv(args.linear if args.linear != "default" else default))
    providers = _csv(args.providers) if args.providers else tuple(LINEAR_PROVIDERS)
    modes = _csv(args.modes) if args.modes else MODES
    if any(p not in LINEAR_PROVIDERS for p in providers) or any(m not in MODES for m in modes) or \
            args.dtype not in DTYPES:
        print(f"fused-linear providers are {', '.join(LINEAR_PROVIDERS)}; modes {', '.join(MODES)}")
        return 2
    cfg = SuiteConfig(shapes=(), dtype=args.dtype, providers=providers, modes=modes, reps=args.reps,
                      warmup=args.warmup, budget_s=args.budget, measure_memory=not args.no_memory, device=device,
                      rounds=args.rounds)
    progress = Progress(len(shapes) * len(providers) * (args.rounds * len(modes) + int(cfg.measure_memory)))
    rows = []
    for shape in shapes:
        problem = make_linear_problem(shape, DTYPES[args.dtype], device)
        rows += measure_in_rounds(cfg, providers,
                                  lambda round_cfg, name: measure_linear(round_cfg, name, problem, progress))
        del problem
    progress.close()
    result = SuiteResult(meta=machine_meta(device, float("nan")) | {"dtype": args.dtype, "kind": "fused linear",
                                                                   "timing": timing_note(cfg)}, rows=rows)
    print(format_linear(rows, result.meta))
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    failed = [r for r in rows if r.status == "error" and LINEAR_PROVIDERS[r.provider].ours]
    for r in failed:
        print(f"ERROR {r.provider} {r.mode}: {r.note}")
    return 1 if failed else 0


def _run_megatron(args) -> int:
    """GSPO on Megatron-Core's vocab-parallel logits against megatron-core's own log-probs."""
    import importlib.util

    from ..bench import megatron

    if importlib.util.find_spec("megatron.core") is None:
        print("bench --megatron needs megatron-core: pip install 'gspo_kernels[megatron]'")
        return 2
    rows, vocab = (int(x) for x in args.megatron.split("x")) if args.megatron != "default" else (4096, 151936)
    try:
        cfg = megatron.MegatronBench(rows=rows, vocab=vocab, reps=args.reps,
                                     contenders=_csv(args.providers) if args.providers else megatron.CONTENDERS)
    except ValueError as exc:
        print(exc)
        return 2
    progress = Progress(len(cfg.contenders))
    result = megatron.run(cfg, progress)
    progress.close()
    print(megatron.format_rows(cfg, result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {"rows": cfg.rows, "vocab": cfg.vocab, "reps": cfg.reps}, "rows": result}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _run_distributed(args) -> int:
    """Two (or more) gloo processes on this CPU, for each split: communication and time."""
    from ..bench import distributed

    rows, vocab = (int(x) for x in args.distributed.split("x")) if args.distributed != "default" else (2048, 32768)
    if args.dtype not in DTYPES:
        print(f"dtypes are {', '.join(DTYPES)}")
        return 2
    cfg = distributed.DistributedBench(rows=rows, vocab=vocab, dtype=str(DTYPES[args.dtype]).removeprefix("torch."),
                                       reps=args.reps)
    result = distributed.run(cfg)
    print(distributed.format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result | {"meta": machine_meta("cpu", float("nan"))}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _run_host(args) -> int:
    """Ops dispatched and host time of one tiny loss call, per objective and layout."""
    from ..bench import host

    rows = host.run(reps=max(args.reps, 20))
    print("host cost of one gspo_loss forward + backward, B=4 T=16 V=256 float32, backend cpu "
          "(ops counted by a TorchDispatchMode)")
    print(host.format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": machine_meta("cpu", float("nan")), "rows": [r.__dict__ for r in rows]}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def run(args) -> int:
    if args.distributed:
        return _run_distributed(args)
    if args.megatron:
        return _run_megatron(args)
    if args.host:
        return _run_host(args)
    on_gpu = torch.cuda.is_available() and not args.cpu
    device = "cuda" if on_gpu else "cpu"
    if args.linear:
        return _run_linear(args, device)
    shapes = tuple(Shape.parse(s) for s in (_csv(args.shapes) if args.shapes else GPU_SHAPES if on_gpu else CPU_SHAPES))
    providers = _csv(args.providers) if args.providers else tuple(PROVIDERS)
    unknown = [p for p in providers if p not in PROVIDERS]
    modes = _csv(args.modes) if args.modes else MODES
    if unknown or any(m not in MODES for m in modes) or args.dtype not in DTYPES:
        print(f"providers are {', '.join(PROVIDERS)}; modes {', '.join(MODES)}; dtypes {', '.join(DTYPES)}")
        return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (checked now, not after minutes of sweeps)
        except ImportError:
            print("--plot needs matplotlib: pip install matplotlib (or the [bench] extra)")
            return 2
    cfg = SuiteConfig(shapes=shapes, dtype=args.dtype, providers=providers, modes=modes, reps=args.reps,
                      warmup=args.warmup, budget_s=args.budget, measure_memory=not args.no_memory, device=device,
                      quick=args.quick, rounds=args.rounds)
    progress = Progress(steps_in(cfg))
    result = run_suite(cfg, progress)
    progress.close()
    print(format_suite(result))
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        sweeps = []
        for pattern, values in GPU_SWEEPS if on_gpu else CPU_SWEEPS:
            sweep_cfg = replace(cfg, shapes=tuple(Shape.parse(pattern.format(x)) for x in values), modes=("fwd+bwd",),
                                providers=tuple(p for p in providers if p != "reference"))
            sweep_progress = Progress(steps_in(sweep_cfg))
            sweeps.append(run_suite(sweep_cfg, sweep_progress))
            sweep_progress.close()
            print(format_sweep(sweeps[-1]) + "\n")
        if args.json:
            sweep_path = args.json.removesuffix(".json") + "_sweeps.json"
            write_json(SuiteResult(meta=sweeps[0].meta, rows=sweeps[0].rows + sweeps[1].rows), sweep_path)
            print(f"wrote {sweep_path}")
        plot_sweeps(sweeps[0], sweeps[1], args.plot)
        print(f"wrote {args.plot}")
    failed = [r for r in result.rows if r.status == "error" and PROVIDERS[r.provider].ours]
    for r in failed:
        print(f"ERROR {r.provider} {r.mode}: {r.note}")
    return 1 if failed else 0


def add_parser(commands) -> None:
    p = commands.add_parser("bench", help="time and memory of every provider available on this machine")
    p.add_argument("--shapes", type=_checked(Shape.parse), help="comma-separated BxTxV (default: 8x512x32768 on CPU, a grid up to N=65536 on GPU)")
    p.add_argument("--dtype", default="bf16", choices=tuple(DTYPES), help="logits dtype (default bf16)")
    p.add_argument("--providers", help=f"comma-separated subset of: {', '.join(PROVIDERS)}")
    p.add_argument("--modes", help=f"comma-separated subset of: {', '.join(MODES)}")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions (median reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--budget", type=float, default=20.0, help="seconds per measurement before stopping at 3 reps")
    p.add_argument("--rounds", type=_positive_int, default=1,
                   help="time the contenders in this many rounds, each in the reverse order of the last, each "
                        "contender warmed and timed --reps times a round (the median of the rounds is reported): "
                        "a machine's drift then lands on every contender alike (default 1)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    p.add_argument("--quick", action="store_true",
                   help="leave the float64 reference's forward and backward alone untimed (its fwd+bwd and "
                        "memory stay) and time its fwd+bwd by one call after a warm-up, in the first round only: the main "
                        "job's default")
    p.add_argument("--cpu", action="store_true", help="benchmark on the CPU even when a GPU is present")
    p.add_argument("--json", help="write one row per (provider, shape, mode) to this file")
    p.add_argument("--plot", help="also sweep V and N and draw time and memory to this PNG")
    p.add_argument("--linear", nargs="?", const="default", type=_checked(_linear_shape),
                   help="fused-linear problems instead (comma-separated NxHxV or NxHxV/T, T rows a sequence, 512 by default; default: "
                        f"{LINEAR_CPU_SHAPES} on CPU, {LINEAR_GPU_SHAPES} on GPU); providers: "
                        f"{', '.join(LINEAR_PROVIDERS)}")
    p.add_argument("--distributed", nargs="?", const="default", type=_checked(_distributed_shape),
                   help="tensor-, context- and data-parallel GSPO on 2 gloo processes against one process "
                        "(NxV, default 2048x32768), with the communication each split needs")
    p.add_argument("--megatron", nargs="?", const="default", type=_checked(_distributed_shape),
                   help="GSPO on Megatron-Core's vocab-parallel logits (TP=2 on gloo) against megatron-core's own "
                        "log-probs: peak memory and time per rank (NxV, default 4096x151936; --providers picks "
                        "contenders; needs megatron-core)")
    p.add_argument("--host", action="store_true",
                   help="the host cost of a tiny loss call instead: ops dispatched and host ms, per objective and layout")
    p.set_defaults(run=run)
