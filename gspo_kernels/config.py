"""The loss options: one frozen dataclass, validated once when it is built."""

from __future__ import annotations

import math
from dataclasses import dataclass

LEVELS = ("sequence", "sequence_token", "token")
LOSS_AGGS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
BACKENDS = ("auto", "triton", "torch", "cpu", "cuda")


def _choice(name: str, value, allowed) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def _real(name: str, value) -> float:
    # bool is an int subclass; True as a clip range is a bug, not a number.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a Python float; got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite; got {value}")
    return value


def check_temperature(value) -> float:
    """The softmax temperature as a float: finite and > 0 (inf would flatten every row to
    uniform, and the backends would not even agree on how)."""
    value = _real("temperature", value)
    if value <= 0.0:
        raise ValueError(f"temperature must be > 0; got {value}")
    return value


@dataclass(frozen=True)
class GSPOConfig:
    """Options of the GSPO loss. See the README's semantics table for what each one does.

    Floats stay Python floats: the kernels take them as runtime arguments, so a new value
    never triggers a recompile.
    """

    level: str = "sequence"
    eps_low: float = 3e-4
    eps_high: float = 4e-4
    temperature: float = 1.0
    loss_agg: str = "seq-mean-token-mean"
    max_len: int | None = None
    beta: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    backend: str = "auto"
    inplace: bool = False

    def __post_init__(self) -> None:
        _choice("level", self.level, LEVELS)
        _choice("loss_agg", self.loss_agg, LOSS_AGGS)
        _choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _choice("backend", self.backend, BACKENDS)
        for name in ("eps_low", "eps_high", "beta", "entropy_coef"):
            object.__setattr__(self, name, _real(name, getattr(self, name)))
        object.__setattr__(self, "temperature", check_temperature(self.temperature))
        if not 0.0 <= self.eps_low < 1.0:
            raise ValueError(f"eps_low must be in [0, 1) so that 1 - eps_low > 0; got {self.eps_low}")
        if self.eps_high < 0.0:
            raise ValueError(f"eps_high must be >= 0; got {self.eps_high}")
        if self.beta < 0.0:
            raise ValueError(f"beta (KL coefficient) must be >= 0; got {self.beta}")
        if self.max_len is not None and (
            isinstance(self.max_len, bool) or not isinstance(self.max_len, int) or self.max_len <= 0
        ):
            raise ValueError(f"max_len must be a positive int or None; got {self.max_len!r}")
        if not isinstance(self.inplace, bool):
            raise TypeError(f"inplace must be a bool; got {type(self.inplace).__name__}")
