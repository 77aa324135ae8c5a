"""verl's monkey patch, amended: with impl_backend=gspo_kernels a text model gets
forward_with_gspo_kernels (a vision-language model keeps verl's torch backend, with a warning),
and verl 0.9.1's actor build next to trl >= 1.0 no longer fails on TRL's value-head class."""

from __future__ import annotations

import functools
import importlib.util
import warnings

from verl.models.transformers import monkey_patch

from .fused_forward import BACKEND, forward_with_gspo_kernels

# verl's own fused forwards for these model types: not plain text models.
_VERL_SPECIFIC = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "qwen3_5", "qwen3_5_moe")

_verl_patch = monkey_patch.patch_forward_with_backends
_verl_is_trl_available = monkey_patch.is_trl_available


def _trl_value_head_available() -> bool:
    """verl's is_trl_available, as apply_monkey_patch uses it: to patch the state_dict of TRL's
    AutoModelForCausalLMWithValueHead. trl >= 1.0 has no such class (neither at the top level
    nor in trl.experimental.ppo), so verl 0.9.1 raised ImportError on every actor build when
    trl was installed; with no class there is nothing to patch, and the build goes on."""
    if not _verl_is_trl_available():
        return False
    import trl

    if hasattr(trl, "AutoModelForCausalLMWithValueHead"):
        return True
    with warnings.catch_warnings():  # trl warns on any import from trl.experimental
        warnings.simplefilter("ignore")
        try:
            return importlib.util.find_spec("trl.experimental.ppo") is not None
        except ImportError:
            return False


@functools.wraps(_verl_patch)
def _patch_forward_with_backends(model, use_fused_kernels: bool = False, fused_kernels_backend: str | None = None):
    if not (use_fused_kernels and fused_kernels_backend == BACKEND):
        return _verl_patch(model, use_fused_kernels, fused_kernels_backend)
    if model.config.model_type in _VERL_SPECIFIC:
        warnings.warn(f"gspo_kernels: the fused forward of {model.config.model_type} models is verl's own; using "
                      "verl's torch backend for it", stacklevel=2)
        return _verl_patch(model, use_fused_kernels, "torch")
    model.__class__.forward = forward_with_gspo_kernels


monkey_patch.patch_forward_with_backends = _patch_forward_with_backends
monkey_patch.is_trl_available = _trl_value_head_available
