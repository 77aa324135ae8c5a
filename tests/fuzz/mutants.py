"""Shows that the fuzz can fail: each mutant puts one known defect back into a copy of the
package, and the ci profile of the fuzz must fail on it (docs/testing.md, "The fuzz catches").

    .venv/bin/python tests/fuzz/mutants.py              # every mutant, one at a time
    .venv/bin/python tests/fuzz/mutants.py tie_full     # one
    .venv/bin/python tests/fuzz/mutants.py --fast       # each against its slice (what CI runs)

Each mutant is (file, the text of today's code, the defect's text): five are issue 24's defects
as they shipped, two more are defects of the kind a rewrite makes. The copy is a temporary
directory holding the package (the built extension included) and the tests; the fuzz runs
there with -x, so a mutant stops at its first failure, whose test and message are printed. The
unchanged copy runs first: a mutant counts as caught only against a fuzz that passes without it.
Exit status 1 if any mutant survives, 2 if the control fails.

--fast runs, for each mutant, only the fuzz test named in its `slice` under the "mutants" profile
(ci's draws, stopped at the first failure, no shrinking); tests/fuzz/test_mutants.py is that run
in CI, so that a fuzz that could no longer catch a defect fails the suite.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    today: str
    defect: str
    what: str
    # The fuzz test (a node id under tests/fuzz) that catches it fastest.
    slice: str = "test_differential_fuzz.py::test_gspo_loss_matches_the_reference[torch]"


MUTANTS = [
    Mutant("strided_mask", "gspo_kernels/inputs/checks.py",
           "    return t.contiguous()\n", "    return t\n",
           "a strided bool mask reaches the kernels as passed",
           "test_differential_fuzz.py::test_gspo_loss_matches_the_reference[cpu]"),
    Mutant("on_policy_zero_ratio", "gspo_kernels/sequence/gspo_objective.py",
           "        log_ratio = old - old\n", "        log_ratio = torch.zeros_like(old)\n",
           "on-policy log-ratio 0 even for a non-finite log-prob (finite loss, NaN gradient)"),
    Mutant("clip_flags_count_nan", "gspo_kernels/sequence/objectives.py",
           "    clipped = by_clipped > by_unclipped\n", "    clipped = ~(by_unclipped >= by_clipped)\n",
           "a NaN ratio (and a padding row of its sequence) counted as clipped"),
    Mutant("padding_times_weight", "gspo_kernels/sequence/gspo_objective.py",
           "    return response_only(w_row * per_token), g, h, metrics\n",
           "    return (batch.mask * w_row) * per_token, g, h, metrics\n",
           "padding kept out of the loss by W = 0 only (0 * NaN from an overflowed ratio)",
           "test_differential_fuzz.py::test_policy_loss_matches_the_reference"),
    Mutant("tie_full", "gspo_kernels/sequence/objectives.py",
           "    d_ratio = torch.addcmul(d_ratio, d_ratio, at_either(ratio, lo, hi), value=-0.5)\n",
           "    d_ratio = d_ratio\n",
           "a tie on a clip bound gets the unclipped branch's whole slope (2x autograd's)"),
    Mutant("vespo_sequence_only", "gspo_kernels/integrations/trl/options.py",
           "        options.update(objective=\"vespo\", ", "        options.update(objective=\"vespo\", level=\"sequence\", ",
           "TRL's vespo mapped to level='sequence' whatever importance_sampling_level says",
           "test_trl_mapping_fuzz.py"),
    Mutant("empty_sequences_counted", "gspo_kernels/sequence/gspo_objective.py",
           "    n_seqs = torch.count_nonzero(tokens_per_seq).clamp(min=1)\n",
           "    n_seqs = torch.full_like(tokens_per_seq.sum(), tokens_per_seq.numel()).clamp(min=1)\n",
           "a mean over sequences that counts the empty ones (the sequence-mean denominator)"),
    Mutant("cu_seqlens_last_row_dropped", "gspo_kernels/inputs/batch.py",
           "    return Segments.packed(cu.to(device=layout.device, dtype=torch.int64), layout.rows, cp_group, valid)\n",
           "    return Segments.packed(cu.to(device=layout.device, dtype=torch.int64).clamp(max=max(layout.rows - 1, 0)),"
           " layout.rows, cp_group, valid)\n",
           "an off-by-one in cu_seqlens: the last packed row belongs to no sequence"),
]


def _copy_tree(dest: str) -> None:
    ignore = shutil.ignore_patterns(".venv", ".git", "__pycache__", ".hypothesis", "results", "*.egg-info")
    for name in ("gspo_kernels", "tests"):
        shutil.copytree(os.path.join(ROOT, name), os.path.join(dest, name), ignore=ignore)
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), dest)


def run(mutant: Mutant | None, tests: tuple[str, ...] = ("tests/fuzz",), profile: str = "ci") -> tuple[bool, float, str]:
    """(the fuzz failed, seconds, its first failure line and the test it was in) for one mutant;
    None runs the unchanged copy, the control every mutant is read against. `tests`: what pytest
    runs in the copy; `profile`: the fuzz's hypothesis profile."""
    name = "control" if mutant is None else mutant.name
    with tempfile.TemporaryDirectory(prefix=f"gspo-mutant-{name}-") as dest:
        _copy_tree(dest)
        if mutant is not None:
            target = os.path.join(dest, mutant.path)
            with open(target) as f:
                text = f.read()
            if text.count(mutant.today) != 1:
                raise SystemExit(f"{mutant.name}: today's text is not found exactly once in {mutant.path}; "
                                 "update the mutant to the code")
            with open(target, "w") as f:
                f.write(text.replace(mutant.today, mutant.defect))
        env = dict(os.environ, PYTHONPATH=dest, TRITON_INTERPRET="1", GSPO_FUZZ_PROFILE=profile)
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pytest", *tests, "-x", "-q", "-p", "no:cacheprovider",
                               "--ignore", "tests/fuzz/test_mutants.py"],
                              cwd=dest, env=env, capture_output=True, text=True)
        elapsed = time.monotonic() - start
        lines = (proc.stdout + proc.stderr).splitlines()
        first = next((ln.strip() for ln in lines if ln.startswith("E ") and ("Error" in ln or "repro" in ln)), "")
        failed = next((ln.split(" ")[1] for ln in lines if ln.startswith("FAILED ")), "")
        # Caught means a test failed (exit 1), not that the copy could not be collected or run.
        if proc.returncode not in (0, 1):
            raise RuntimeError(f"{name}: pytest exited {proc.returncode}:\n" + "\n".join(lines[-15:]))
        return proc.returncode == 1, elapsed, f"{failed} {first[:240]}".strip()


def fast_run(mutant: Mutant | None) -> tuple[bool, float, str]:
    """run() on the mutant's slice under the "mutants" profile; None runs every slice unchanged."""
    slices = sorted({m.slice for m in MUTANTS}) if mutant is None else [mutant.slice]
    return run(mutant, tuple(f"tests/fuzz/{s}" for s in slices), profile="mutants")


def main(args: list[str]) -> int:
    fast = "--fast" in args
    names = [a for a in args if a != "--fast"]
    runner = fast_run if fast else run
    failed, seconds, detail = runner(None)
    print(f"{'control (no mutant)':30s} {'FAILED' if failed else 'passed':8s} {seconds:6.0f} s  {detail}", flush=True)
    if failed:
        return 2  # a mutant is caught only against a fuzz that passes without it
    chosen = [m for m in MUTANTS if not names or m.name in names]
    survived = []
    for mutant in chosen:
        caught, seconds, detail = runner(mutant)
        print(f"{mutant.name:30s} {'caught' if caught else 'SURVIVED':8s} {seconds:6.0f} s  {mutant.what}", flush=True)
        print(f"{'':30s} {detail}", flush=True)
        if not caught:
            survived.append(mutant.name)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
