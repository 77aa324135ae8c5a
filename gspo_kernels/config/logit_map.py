"""The logit map: what the kernels take the softmax of, built once from a call's options and
passed whole through the config, the linear plan, the selection and the backends' inputs.

The C++ kernels hold the same map as `LogitMap` in csrc/gspo_math.h and the Triton ones as
`map_logits` / `logit_slope` in backends/triton/common.py; the float64 reference
(testing/reference.py) keeps its own, in the model's terms (scale, soft-cap, temperature), so
that it checks this one rather than repeating it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def _in_range(name: str, value: float) -> float:
    if not 0.0 < value < math.inf:
        raise ValueError(f"{name} = {value} is outside float range")
    return value


@dataclass(frozen=True)
class LogitMap:
    """z = inv_temperature * x, or z = softcap * tanh(inv_temperature * x) when softcap > 0.

    That is softcap_c(x * logit_scale) / temperature with softcap_c(y) = c * tanh(y / c): the
    model's scale, then its soft-cap, then the trainer's temperature, as the models and
    trainers apply them (`LogitMap.of`). The map is increasing, so it keeps the raw logits'
    order (the sampler's kept set is a threshold on the raw logits, token_stats/kept_set.py)."""

    inv_temperature: float = 1.0
    softcap: float = 0.0  # 0: no soft-cap

    # The names op_args' values take in the ops' schemas.
    OP_ARG_NAMES = ("inv_temperature", "softcap")

    @staticmethod
    def of(temperature: float, logit_scale: float = 1.0, logit_softcap: float | None = None) -> "LogitMap":
        """The kernels' map of a call's (checked) temperature, logit_scale and logit_softcap."""
        if logit_softcap is None:
            return LogitMap(1.0 / _in_range("temperature / logit_scale", temperature / logit_scale), 0.0)
        return LogitMap(_in_range("logit_scale / logit_softcap", logit_scale / logit_softcap),
                        _in_range("logit_softcap / temperature", logit_softcap / temperature))

    @property
    def capped(self) -> bool:
        return self.softcap > 0.0

    def op_args(self) -> tuple[float, float]:
        """(inv_temperature, softcap): the ops' two float arguments, in their schemas' order
        (csrc/ops.cpp and the Triton launchers)."""
        return self.inv_temperature, self.softcap

    def apply_(self, x: torch.Tensor) -> torch.Tensor:
        """z of a float tensor x, in place."""
        x.mul_(self.inv_temperature)
        return x.tanh_().mul_(self.softcap) if self.capped else x

    def slope(self, z: torch.Tensor):
        """dz/dx from z: inv_temperature * softcap * (1 - t^2), t = z / softcap, with a soft-cap
        (exactly 0 where z saturates at +-softcap, as in float64: an infinite input times it
        stays NaN), else the float inv_temperature."""
        if self.capped:
            t = z / self.softcap
            return (1.0 - t * t) * (self.inv_temperature * self.softcap)
        return self.inv_temperature
