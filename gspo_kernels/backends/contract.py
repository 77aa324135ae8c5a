"""What every backend agrees on besides the logits: the functions a backend module exposes
(Backend), the stage-3 inputs (GradInputs) and the log floor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..config.logit_map import LogitMap

# Log-probabilities below this are probability 0 even in float32; clamping there changes no
# value but keeps 0 * -inf (a -inf logit) out of the products. The one Python constant: the
# Triton kernels take it as a constexpr (triton/common.py), C++ has csrc/gspo_math.h kLogFloor.
LOG_FLOOR = -200.0


@dataclass(frozen=True)
class StatsInputs:
    """What stage 1 reads beside the logits: `targets` (contiguous int64, one a row: `[N]` or the
    token shape `(B, T)`, which the outputs then take), the logit map, and the sampler's kept set
    (kept_min, float32 per row, or None: GradInputs says what it keeps)."""

    targets: torch.Tensor
    logit_map: LogitMap
    kept_min: torch.Tensor | None = None

    def op_args(self) -> tuple:
        """The arguments after `logits`, in the order of the stats ops' schemas: STATS_OP_ARG_NAMES."""
        return (self.targets, *self.logit_map.op_args(), self.kept_min)


STATS_OP_ARG_NAMES = ("targets", *LogitMap.OP_ARG_NAMES, "kept_min")


@dataclass(frozen=True)
class GradInputs:
    """Per-row tensors (float32 unless noted), contiguous, one element per logits row: `[N]` or
    the token shape `(B, T)`, all alike; and the logit map of one backward pass (logit_map.py:
    the softmax is of z = map(x), and each logit's gradient is taken times dz/dx). kept_min
    (float32 per row, or None): the sampler's kept set, the raw logits x >= kept_min of the row (token_stats/kept_set.py); the others are -inf after the
    map (probability 0, no gradient), and a target outside it gets a -inf log-prob and no
    one-hot term.

    Row rule, the same on every backend (csrc/gspo_math.h, row_action): a row outside
    `row_mask` gets zeros whatever its logits hold, and is not read; a row in the loss with no
    finite softmax (a NaN or +inf logit, or all -inf) or a target outside [0, V) gets NaN
    throughout; a row whose upstream gradients are both 0 gets zeros, unread.
    """

    targets: torch.Tensor  # int64
    lse: torch.Tensor
    entropy: torch.Tensor
    grad_logp: torch.Tensor
    grad_entropy: torch.Tensor | None  # None: no entropy term
    row_mask: torch.Tensor | None  # bool; None: every row is in the loss
    logit_map: LogitMap
    kept_min: torch.Tensor | None = None  # the sampler's kept set per row; None: every token

    def as_rows(self) -> "GradInputs":
        """The same inputs as `[N]` rows (views)."""
        def flat(t):
            return None if t is None else t.reshape(-1)
        return GradInputs(flat(self.targets), flat(self.lse), flat(self.entropy), flat(self.grad_logp),
                          flat(self.grad_entropy), flat(self.row_mask), self.logit_map,
                          flat(self.kept_min))

    def nan_rows(self) -> torch.Tensor:
        """The rows the row rule fills with NaN: in the loss, with no finite softmax or a bad
        target (both make lse NaN), or a non-finite upstream gradient. O(rows), where scanning
        the gradient for them reads every logit. A row whose inputs are all finite but whose terms
        overflow float32 (an upstream gradient near its largest value) is not among them: its NaN
        may then reach the row beside it through a CPU's bf16 product
        (linear/products.py, _cpu_bf16_rows_product)."""
        bad = ~torch.isfinite(self.lse) | ~torch.isfinite(self.grad_logp)
        if self.grad_entropy is not None:
            bad |= ~torch.isfinite(self.grad_entropy)
        return bad if self.row_mask is None else bad & self.row_mask

    def rows(self, part: slice) -> "GradInputs":
        """The same inputs for a slice of the `[N]` rows (a chunk)."""
        return GradInputs(self.targets[part], self.lse[part], self.entropy[part], self.grad_logp[part],
                          None if self.grad_entropy is None else self.grad_entropy[part],
                          None if self.row_mask is None else self.row_mask[part], self.logit_map,
                          None if self.kept_min is None else self.kept_min[part])

    def op_args(self, kept_set: bool = True) -> tuple:
        """The arguments after `logits`, in the order of the ops' schemas (csrc/ops.cpp, the
        Triton launchers): OP_ARG_NAMES, which tests/kernels/test_contract.py holds against
        every schema. kept_set=False leaves out kept_min (the tile kernels take none)."""
        args = (self.targets, self.lse, self.entropy, self.grad_logp, self.grad_entropy, self.row_mask,
                *self.logit_map.op_args())
        return (*args, self.kept_min) if kept_set else args


# The names of op_args()' values, in order: the schemas' argument names after `logits`.
OP_ARG_NAMES = ("targets", "lse", "entropy", "grad_logp", "grad_entropy", "row_mask", *LogitMap.OP_ARG_NAMES,
                "kept_min")


class Backend(Protocol):
    """A backend module (backends.get(name)): stage 1 and stage 3 over logits `[B, T, V]` or
    `[N, V]` whose vocab dim has unit stride (leading dims may be strided views).
    tests/kernels/test_contract.py holds every backend module to these signatures."""

    def token_stats(self, logits: torch.Tensor, inputs: StatsInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logp, entropy, lse), float32, of the targets' shape; a target outside [0, V) gives
        logp = NaN for its row."""

    def logits_grad(self, logits: torch.Tensor, inputs: GradInputs) -> torch.Tensor:
        """dLoss/dlogits, a new tensor like logits, under GradInputs' row rule."""

    def logits_grad_(self, logits: torch.Tensor, inputs: GradInputs) -> torch.Tensor:
        """The same written into logits' storage (layout.writable_in_place logits only); returns logits."""
