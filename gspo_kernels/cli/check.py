"""Every backend on this machine against the float64 reference, over a grid of cases."""

from __future__ import annotations

import argparse
import itertools
import time
import warnings
from dataclasses import dataclass

import torch

from .. import backends
from ..config import LEVELS, LOSS_AGGS
from ..bench.table import print_table
from ..testing.problems import ProblemSpec, make_problem
from ..testing.verify import STATS_LIMIT, linear_operands, run_case, run_linear_case, token_stats_errors
from .progress import Progress

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Case:
    dtype: str
    layout: str
    level: str
    temperature: float
    kl_estimator: str
    strided: bool

    @property
    def label(self) -> str:
        rows = "strided" if self.strided else "contig"
        return f"{self.dtype} {self.layout} {rows} {self.level} T={self.temperature:g} kl={self.kl_estimator}"


def cases() -> list[Case]:
    """dtype x layout x level; temperature, KL estimator and row stride rotate through them."""
    grid = itertools.product(DTYPES, ("padded", "packed"), LEVELS)
    return [
        Case(dtype, layout, level, temperature=(1.0, 0.7)[i % 2], kl_estimator=("k1", "k2", "k3")[i % 3],
             strided=bool(i % 4 == 3))
        for i, (dtype, layout, level) in enumerate(grid)
    ]


def runnable_backends() -> dict[str, str]:
    """backend -> device, for the backends this machine can run."""
    found = {"torch": "cuda" if torch.cuda.is_available() else "cpu"}
    triton = backends.triton_backend
    if triton is not None and torch.cuda.is_available() and not triton.INTERPRETED:
        found["triton"] = "cuda"
    elif triton is not None and triton.INTERPRETED and triton.INTERPRETER_PROBLEM is None:
        found["triton"] = "cpu"  # through Triton's interpreter: correct but slow
    if backends.native_available():
        found["cpu"] = "cpu"
        if torch.cuda.is_available():
            found["cuda"] = "cuda"
    return found


def skipped_backends(found: dict[str, str]) -> dict[str, str]:
    """backend -> why this machine does not run it, for those runnable_backends left out."""
    why = {}
    if "triton" not in found:
        triton = backends.triton_backend
        why["triton"] = (backends.TRITON_PROBLEM if triton is None else
                         triton.INTERPRETER_PROBLEM if triton.INTERPRETER_PROBLEM is not None else
                         "no GPU; TRITON_INTERPRET=1 runs it through Triton's CPU interpreter")
    if not backends.native_available():
        why["cpu"] = why["cuda"] = "the _C extension is not built (pip install --no-build-isolation -e .)"
    elif "cuda" not in found:
        why["cuda"] = "no GPU"
    return why


def run(args) -> int:
    # Triton's interpreter evaluates both sides of tl.where with numpy, which warns about the
    # 0 * inf branch the kernels then discard: noise, not a finding.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton")
    available = runnable_backends()
    chosen = args.backends.split(",") if args.backends else list(available)
    missing = [b for b in chosen if b not in available]
    if missing:
        print(f"not runnable here: {', '.join(missing)} (available: {', '.join(available)})")
        return 2
    skipped = {} if args.backends else skipped_backends(available)
    if skipped:
        print("skipped: " + "; ".join(f"{name} ({why})" for name, why in skipped.items()))
    header = ("backend", "device", "case", "loss err", "grad err", "logp err", "result")
    rows, failed = [], 0
    all_cases = cases()
    start = time.perf_counter()
    progress = Progress(len(chosen) * len(all_cases))
    for backend in chosen:
        for i, case in enumerate(all_cases):
            spec = ProblemSpec(batch=args.batch, seq_len=args.seq_len, vocab=args.vocab, dtype=DTYPES[case.dtype],
                               temperature=case.temperature, empty_sequence=True, strided=case.strided,
                               with_ref=True, device=available[backend], seed=i)
            problem = make_problem(spec)
            if case.layout == "packed":
                problem = problem.to_packed()
            result = run_case(problem, backend, level=case.level, beta=0.05, kl_estimator=case.kl_estimator,
                              entropy_coef=0.01, max_len=args.seq_len, loss_agg=args.loss_agg)
            failed += not result.passed
            e = result.errors
            rows.append((backend, available[backend], case.label, f"{e['loss']:.1e}", f"{e['grad']:.1e}",
                         f"{e['token_logprobs']:.1e}", "pass" if result.passed else "FAIL " + "; ".join(result.failures())))
            progress.step(f"{backend} {case.label}")
    progress.close()
    print_table(header, rows)
    print(f"\n{len(rows) - failed}/{len(rows)} cases pass "
          "(errors are ||out - ref|| / ||ref|| against the float64 reference)\n")
    failed += _print_stats_precision(chosen, available)
    print()
    failed += _print_fused_linear(chosen, available, args)
    elapsed = time.perf_counter() - start
    print(f"\ncheck took {elapsed:.0f} s")
    if "triton" in chosen and available["triton"] == "cpu":
        print("triton ran through Triton's CPU interpreter (TRITON_INTERPRET=1): same kernels, no GPU")
    return 1 if failed else 0


def _print_stats_precision(chosen, available) -> int:
    """Worst absolute log-prob and entropy error of each backend, on rows that span several
    kernel blocks with the max anywhere (verify.stats_probe_logits). Returns the failures."""
    header = ("backend", "dtype", "worst |logp err|", "worst |entropy err|", "result")
    rows, failed = [], 0
    for backend in chosen:
        for name, dtype in DTYPES.items():
            logp_err, entropy_err = token_stats_errors(backend, dtype, available[backend])
            ok = logp_err <= STATS_LIMIT and entropy_err <= STATS_LIMIT
            failed += not ok
            rows.append((backend, name, f"{logp_err:.2e}", f"{entropy_err:.2e}",
                         "pass" if ok else f"FAIL (> {STATS_LIMIT:.0e})"))
    print_table(header, rows)
    print(f"token statistics against float64 on 64 rows of V = 12388 (Gaussian and peaked); "
          f"limit {STATS_LIMIT:.0e} absolute")
    return failed


def _interpreted(backend: str, available) -> bool:
    return backend == "triton" and available[backend] == "cpu"


def _quick_subset(i: int) -> bool:
    # 4 of the 12 cases: every level, both dtypes and both layouts.
    return (i + i // 3) % 3 == 0


def _print_fused_linear(chosen, available, args) -> int:
    """fused_linear_gspo_loss on every backend against the materialized float64 reference:
    3 levels x fp32/bf16 x padded/packed, chunks that do not divide N, KL and temperature
    rotating. With --quick, Triton through its interpreter (about 5 s a case on a 2-core CPU,
    the check's largest cost) runs 4 of the 12 cases; the test suite runs them all. Returns the
    failures."""
    header = ("backend", "case", "loss err", "d hidden", "d weight", "d bias", "result")
    rows, failed = [], 0
    grid = list(itertools.product(("fp32", "bf16"), ("padded", "packed"), LEVELS))
    subset = [backend for backend in chosen if args.quick and _interpreted(backend, available)]
    for backend in chosen:
        for i, (dtype, layout, level) in enumerate(grid):
            if backend in subset and not _quick_subset(i):
                continue
            spec = ProblemSpec(batch=args.batch, seq_len=args.seq_len, vocab=args.vocab, dtype=DTYPES[dtype],
                               empty_sequence=True, with_ref=True, device=available[backend], seed=100 + i)
            problem = make_problem(spec)
            if layout == "packed":
                problem = problem.to_packed()
            options = dict(level=level, beta=0.05 * (i % 2), temperature=(1.0, 0.7)[i % 2 == 0])
            result = run_linear_case(problem, backend, linear_operands(problem, seed=i), chunk_size=7, **options)
            failed += not result.passed
            e = result.errors
            rows.append((backend, f"{dtype} {layout} {level}", f"{e['loss']:.1e}", f"{e['grad_hidden']:.1e}",
                         f"{e['grad_weight']:.1e}", f"{e['grad_bias']:.1e}",
                         "pass" if result.passed else "FAIL " + "; ".join(result.failures())))
    print_table(header, rows)
    print(f"fused linear (hidden @ weight.T + bias, 7-row chunks) against the float64 reference: "
          f"{len(rows) - failed}/{len(rows)} pass")
    if subset:
        print(f"--quick: {', '.join(subset)} (interpreted) ran 4 of the {len(grid)} cases (each level, dtype and "
              "layout once); without --quick, all")
    return failed


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a positive integer; got {text!r}")
    return value


def add_parser(commands) -> None:
    p = commands.add_parser("check", help="gradient check of every backend against the float64 reference")
    p.add_argument("--backends", help="comma-separated subset (default: every backend runnable here)")
    p.add_argument("--batch", type=_positive, default=6, help="sequences in the check's problem (default 6)")
    p.add_argument("--seq-len", type=_positive, default=16, help="tokens per sequence (default 16)")
    p.add_argument("--vocab", type=_positive, default=1000, help="vocabulary size V (default 1000)")
    p.add_argument("--loss-agg", default="seq-mean-token-mean", choices=LOSS_AGGS, help="the loss aggregation (default seq-mean-token-mean)")
    p.add_argument("--quick", action="store_true",
                   help="Triton through its interpreter: 4 of the 12 fused-linear cases (the main job's default)")
    p.set_defaults(run=run)
