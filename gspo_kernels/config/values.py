"""Checks of one option value at a time (a float, a choice, a bool, the temperature, the logit
map's options, the sampler's truncation), shared by the option dataclasses (config.py) and the
functional entry points that take the same options as keywords."""

from __future__ import annotations

import math


def check_choice(name: str, value, allowed) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def check_optional_real(name: str, value) -> float | None:
    return None if value is None else check_real(name, value)


def check_real(name: str, value) -> float:
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
    value = check_real("temperature", value)
    if value <= 0.0:
        raise ValueError(f"temperature must be > 0; got {value}")
    return value


def check_logit_scale(value) -> float:
    """The model's logit multiplier as a float: finite and > 0 (the kernels take the softmax of
    z * logit_scale / temperature; a scale <= 0 is no model's)."""
    value = check_real("logit_scale", value)
    if value <= 0.0:
        raise ValueError(f"logit_scale must be > 0; got {value}")
    return value


def check_logit_softcap(value) -> float | None:
    """The model's soft-cap c (logits -> c * tanh(logits / c)) as a float, or None for none."""
    if value is None:
        return None
    value = check_real("logit_softcap", value)
    if value <= 0.0:
        raise ValueError(f"logit_softcap must be > 0 (or None for no soft-cap); got {value}")
    return value


def check_sampling(top_k, top_p, min_p) -> None:
    """The sampler's truncation as vLLM takes it: top_k an int >= 1, top_p in (0, 1], min_p in
    [0, 1] (each None for none)."""
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"sampling_top_k must be an int >= 1 or None; got {top_k!r}")
    if top_p is not None and not 0.0 < check_real("sampling_top_p", top_p) <= 1.0:
        raise ValueError(f"sampling_top_p must be in (0, 1] or None; got {top_p!r}")
    if min_p is not None and not 0.0 <= check_real("sampling_min_p", min_p) <= 1.0:
        raise ValueError(f"sampling_min_p must be in [0, 1] or None; got {min_p!r}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool; got {type(value).__name__}")
