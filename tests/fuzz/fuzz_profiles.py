"""Hypothesis settings of the fuzz: a short, reproducible "ci" profile and a "long" one.

    .venv/bin/python -m pytest tests/fuzz -q                         # ci (the default)
    GSPO_FUZZ_PROFILE=mutants ...                                    # ci's draws, no shrinking (mutants.py)
    GSPO_FUZZ_PROFILE=long .venv/bin/python -m pytest tests/fuzz -q  # before calling a rewrite done

ci: derandomize=True, so every run draws the same examples (a function of each test's source),
with no example database to drift; the budget below keeps all fuzz tests within ~3-4 minutes on
a 2-core CPU, the Triton interpreter's share included. long: random draws, many more examples,
failures remembered in tests/fuzz/.hypothesis (git-ignored) so that a rerun replays them first.
Both print the reproduce_failure blob, and every failure message ends in a one-line repro
(FuzzCase.repro: tests/fuzz/replay.py with the case's repr).
"""

import os

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

PROFILE = os.environ.get("GSPO_FUZZ_PROFILE", "ci")
if PROFILE not in ("ci", "long", "mutants"):
    raise ValueError(f"GSPO_FUZZ_PROFILE must be 'ci', 'long' or 'mutants'; got {PROFILE!r}")

# Examples per test in the ci profile, by (entry point, backend); the long profile runs
# LONG_FACTOR times as many. Measured on this 2-core CPU: one example takes ~12 ms for gspo_loss
# on the torch and cpu backends, ~10-25 ms for fused_linear, selective_log_softmax and
# policy_loss, and 0.3-0.45 s through Triton's interpreter, hence its smaller share. All of
# tests/fuzz passes in ~2 minutes on an idle machine, ~3.5 with another test run beside it.
CI_EXAMPLES = {
    ("gspo_loss", "torch"): 1000, ("gspo_loss", "cpu"): 1000, ("gspo_loss", "triton"): 100,
    ("fused_linear", "torch"): 500, ("fused_linear", "cpu"): 500, ("fused_linear", "triton"): 70,
    ("selective_log_softmax", "torch"): 400, ("selective_log_softmax", "cpu"): 400,
    ("selective_log_softmax", "triton"): 50,
    ("policy_loss", "torch"): 600,
    ("invalid", "torch"): 200, ("invalid", "cpu"): 200, ("invalid", "triton"): 100,
}
LONG_FACTOR = 20

_COMMON = dict(
    deadline=None,  # the Triton interpreter's first call, and a loaded machine, vary a lot
    print_blob=True,
    # Problems are small but whole (reference loop included); the ones near a kink are discarded.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
# No "explain" phase in ci: it reruns a shrunk failure many times to say which parts of it
# vary freely, minutes through Triton's interpreter; the long profile keeps it.
settings.register_profile("ci", derandomize=True, database=None,
                          phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink), **_COMMON)
# mutants: the ci draws, stopped at the first failure (no shrinking: a planted defect needs to be
# found, not minimised); tests/fuzz/test_mutants.py runs a slice of the fuzz under it per mutant.
settings.register_profile("mutants", derandomize=True, database=None,
                          phases=(Phase.explicit, Phase.reuse, Phase.generate), **_COMMON)
settings.register_profile(
    "long", derandomize=False,
    database=DirectoryBasedExampleDatabase(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".hypothesis")),
    **_COMMON)


def fuzz_settings(entry: str, backend: str) -> settings:
    """The active profile with the example budget of (entry, backend); entry "invalid" is the
    bad-input test. A backend not listed gets the torch share."""
    n = CI_EXAMPLES.get((entry, backend), CI_EXAMPLES.get((entry, "torch"), 100))
    n *= LONG_FACTOR if PROFILE == "long" else 1
    return settings(settings.get_profile(PROFILE), max_examples=n)
