"""The grid of multi-process cases that test_distributed.py runs: one Case per split (tp, cp,
tp x cp, dp, dp x cp), layout, level, loss aggregation, backend, dtype and entry point, and the
case ids the parent reports one pytest case each."""

from __future__ import annotations

from dataclasses import dataclass, field

import gspo_kernels as gk
from gspo_kernels.config import LEVELS, LOSS_AGGS


@dataclass(frozen=True)
class Case:
    split: str  # tp, cp, tpcp, dp
    layout: str = "padded"  # or packed
    level: str = "sequence"
    loss_agg: str = "seq-mean-token-mean"
    backend: str = "cpu"
    dtype: str = "float32"
    linear: bool = False  # fused linear from hidden states and the lm_head weight
    even_vocab: bool = False  # V divisible by the tp size, default vocab_start
    entry: str = "loss"  # or selective (selective_log_softmax with entropy)
    edges: bool = False  # rows that stress the vocab-parallel merge (selective, padded only)
    fused: bool = False  # fused linear through the Triton tile kernels (fused=True)
    sweep: str = "auto"  # fused linear's backward sweep (rows or vocab), forced; auto: choose_sweep's
    options: tuple = field(default_factory=tuple)  # extra GSPOConfig options, (key, value) pairs

    @property
    def id(self) -> str:
        parts = [self.split, self.layout, self.level, self.loss_agg, self.backend, self.dtype]
        if self.linear:
            parts.append("linear")
        if self.even_vocab:
            parts.append("even_vocab")
        if self.entry != "loss":
            parts.append(self.entry)
        if self.edges:
            parts.append("edges")
        if self.sweep != "auto":
            parts.append(f"sweep_{self.sweep}")
        if self.fused:
            parts.append("fused")
        parts += [f"{k}={v}" for k, v in self.options]
        return "-".join(parts)


def cpu_backends() -> tuple[str, ...]:
    """Backends that run on CPU tensors here: Triton only through its interpreter."""
    triton = gk.backends.triton_backend
    return ("torch", "triton") if triton is not None and triton.INTERPRETED else ("torch",)


def cases(world: int) -> list[Case]:
    """The grid for one world size (4 is the 2 x 2 tp x cp mesh)."""
    extra_backends = cpu_backends()
    if world == 4:
        grid = [Case("tpcp", layout, level, agg) for layout in ("padded", "packed") for level in LEVELS
                for agg in LOSS_AGGS]
        grid += [Case("tpcp", layout, linear=True) for layout in ("padded", "packed")]
        grid += [Case("tpcp", "packed", backend=b) for b in extra_backends]
        grid += [Case("tpcp", "padded", dtype="bfloat16"), Case("tpcp", "packed", options=EXTRA_OPTIONS[0]),
                 Case("tpcp", "packed", options=EXTRA_OPTIONS[5])]
        grid += [Case("dpcp", layout, level, agg) for layout in ("padded", "packed") for level in ("sequence", "token")
                 for agg in ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")]
        return grid
    grid = []
    for split in ("tp", "cp", "dp"):
        grid += [Case(split, layout, level, agg) for layout in ("padded", "packed") for level in LEVELS
                 for agg in LOSS_AGGS]
        grid += [Case(split, layout, level, backend=b, dtype="float64" if b == "torch" else "float32")
                 for layout in ("padded", "packed") for level in LEVELS for b in extra_backends]
        grid += [Case(split, layout, linear=True, loss_agg=agg) for layout in ("padded", "packed")
                 for agg in ("seq-mean-token-mean", "token-mean")]
        grid += [Case(split, "packed", options=opts) for opts in EXTRA_OPTIONS]
    grid += [Case("tp", "padded", even_vocab=True), Case("tp", "packed", even_vocab=True, linear=True),
             Case("tp", "padded", dtype="bfloat16"),
             *[Case("tp", "padded", backend=b, dtype="bfloat16") for b in extra_backends if b == "triton"],
             Case("tp", "padded", entry="selective"), Case("tp", "packed", entry="selective", linear=True),
             Case("tp", "padded", linear=True, options=(("reduce_hidden_grad", False),)),
             Case("tp", "padded", options=(("inplace", True),)), Case("tp", "packed", linear=True, dtype="bfloat16")]
    # The vocab sweep's blocks nested in a rank's vocab slice (tp alone picks rows at these sizes),
    # and the rows sweep where a cp rank's few rows would pick vocab.
    grid += [Case("tp", "packed", linear=True, sweep="vocab"),
             Case("tp", "padded", linear=True, entry="selective", sweep="vocab"),
             Case("tp", "padded", linear=True, options=(("reduce_hidden_grad", False),), sweep="vocab"),
             Case("cp", "packed", linear=True, sweep="rows")]
    grid += [Case("tp", "padded", backend=b, dtype="float64" if b == "torch" else "float32", entry="selective",
                  edges=True) for b in ("cpu",) + extra_backends]
    if "triton" in extra_backends:  # the tile kernels with vocab slices (and their one-hot rule)
        grid += [Case(split, "packed", linear=True, backend="triton", fused=True) for split in ("tp", "cp")]
        grid += [Case("tp", "padded", linear=True, backend="triton", fused=True, entry="selective")]
    return grid


EXTRA_OPTIONS = (
    (("objective", "gmpo"),),
    (("objective", "cispo"), ("level", "token")),
    (("objective", "sapo"),),
    (("beta", 0.1), ("kl_estimator", "k3")),
    (("entropy_coef", 0.01), ("temperature", 0.7)),
    (("rollout_correction", "sequence-truncate"), ("rollout_sequence_weight", "product")),
    (("off_policy_mask_threshold", 0.05),),
    (("logit_scale", 1.5), ("logit_softcap", 3.0)),
)


SETUP_CASE = "setup-helpers"  # the set-up helpers, checked once per world (dist_checks.check_setup_helpers)
