"""The host cost of one loss call, on a problem where the kernels cost nothing (B=4, T=16, V=256,
float32, the native CPU kernels): the ATen ops it dispatches, forward and backward, counted
exactly by a TorchDispatchMode (machine-independent: on a GPU each is about one launch or
one host round of the dispatcher), and the process CPU time of one forward + backward
(median; process time, so other load on the machine inflates it little)."""

from __future__ import annotations

import collections
import contextlib
import statistics
import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..config import GSPOConfig
from ..loss import gspo_loss

# One row per objective as a user would call it; "gspo+kl+entropy" is plain GSPO with the k3 KL and
# the entropy bonus on.
CASES = {
    "gspo": dict(level="sequence"),
    "gspo+kl+entropy": dict(level="sequence", beta=0.04, entropy_coef=0.01),
    "grpo (token)": dict(level="token"),
    "gspo-token": dict(level="sequence_token"),
    "cispo": dict(level="token", objective="cispo"),
    "sapo": dict(level="token", objective="sapo"),
    "gmpo": dict(level="sequence", objective="gmpo", eps_low=0.4, eps_high=0.4),
    "vespo": dict(level="sequence", objective="vespo"),
}
LAYOUTS = ("padded", "packed")


class OpCounter(TorchDispatchMode):
    """Counts every op that reaches the dispatcher, by phase and by overload
    ("aten.sum.dim_IntList", "gspo_kernels.token_stats.default")."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[(self.phase, str(func))] += 1
        return func(*args, **(kwargs or {}))

    def total(self, phase: str) -> int:
        return sum(n for (p, _), n in self.ops.items() if p == phase)

    def of(self, name: str, phase: str | None = None) -> int:
        """Calls of the op `name` (its overloads together: "gspo_kernels.token_stats"), in `phase` or in all."""
        return sum(n for (p, op), n in self.ops.items()
                   if (phase is None or p == phase) and op.rsplit(".", 1)[0] == name)


@dataclass(frozen=True)
class HostRow:
    case: str
    layout: str
    ops_forward: int
    ops_backward: int
    host_ms: float

    @property
    def ops(self) -> int:
        return self.ops_forward + self.ops_backward


def tiny_call(case: str, layout: str, batch: int = 4, seq_len: int = 16, vocab: int = 256, seed: int = 0):
    """A closure running one forward + backward of `case` in `layout` (fresh leaf logits each call),
    every token in the response."""
    gen = torch.Generator().manual_seed(seed)
    packed = layout == "packed"
    token_shape = (batch * seq_len,) if packed else (batch, seq_len)
    base = torch.randn(*token_shape, vocab, generator=gen)
    targets = torch.randint(0, vocab, token_shape, generator=gen)
    old = torch.randn(token_shape, generator=gen) * 0.1 - 5.5
    tensors = dict(cu_seqlens=torch.arange(0, batch * seq_len + 1, seq_len)) if packed else \
        dict(mask=torch.ones(token_shape, dtype=torch.bool))
    options = dict(CASES[case])
    if "beta" in options:
        tensors["ref_logprobs"] = old + 0.05
    config = GSPOConfig(backend="cpu", **options)
    advantages = torch.randn(batch, generator=gen)

    def call(counter: OpCounter | None = None):
        logits = base.clone().requires_grad_()  # outside the count: the caller's tensor
        with counter if counter is not None else contextlib.nullcontext():
            loss, _ = gspo_loss(logits, targets, old, advantages, config=config, **tensors)
            if counter is not None:
                counter.phase = "backward"
            loss.backward()

    return call


def measure(case: str, layout: str, reps: int = 50) -> HostRow:
    call = tiny_call(case, layout)
    for _ in range(3):
        call()
    counter = OpCounter()
    call(counter)
    times = []
    for _ in range(reps):
        start = time.process_time()
        call()
        times.append((time.process_time() - start) * 1e3)
    return HostRow(case, layout, counter.total("forward"), counter.total("backward"), statistics.median(times))


def run(reps: int = 50) -> list[HostRow]:
    return [measure(case, layout, reps) for case in CASES for layout in LAYOUTS]


def format_rows(rows: list[HostRow]) -> str:
    from .table import format_table

    header = ("case", "layout", "ops fwd", "ops bwd", "ops", "host ms (process time)")
    return format_table(header, [(r.case, r.layout, r.ops_forward, r.ops_backward, r.ops, f"{r.host_ms:.2f}")
                                 for r in rows])
