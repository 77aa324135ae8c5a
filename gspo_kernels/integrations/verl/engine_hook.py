"""`+actor_rollout_ref.model.fused_kernel_options.batch_invariant=true` and `...sampling_aware_logprobs`:
verl hands its model patch only `impl_backend`, so verl's FSDPEngine._build_module is wrapped to
hand the model it builds a LinearConfig (linear_config) and the rollout's kept set
(sampling_config); its prepare_model_inputs, to hand the fused forward the batch's own kept sets
(kept_sets.py). The engine module is wrapped when verl imports it, by a
one-shot import hook: importing it here would fix verl's device platform too early."""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
import warnings

from ...config import LinearConfig
from ...config.values import check_sampling
from ...token_stats.kept_set import SamplingFilter
from . import kept_sets
from .fused_forward import BACKEND, LINEAR_ATTRIBUTE, SAMPLING_ATTRIBUTE, forward_with_gspo_kernels

_ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"


def linear_config(model_config) -> LinearConfig | None:
    """The LinearConfig that verl's model config asks for through
    `fused_kernel_options.batch_invariant` (None when the key is absent). TypeError for a value
    that is not a bool; ValueError for batch_invariant=True without this fused forward
    (use_fused_kernels=True and impl_backend=gspo_kernels), which it would never reach."""
    options = getattr(model_config, "fused_kernel_options", None) or {}
    if "batch_invariant" not in options:
        return None
    value = options["batch_invariant"]
    if not isinstance(value, bool):
        raise TypeError(f"fused_kernel_options.batch_invariant must be true or false; got {value!r}")
    if value and not (getattr(model_config, "use_fused_kernels", False) and options.get("impl_backend") == BACKEND):
        raise ValueError("fused_kernel_options.batch_invariant=True is an option of gspo_kernels' fused forward: set "
                         f"use_fused_kernels=True and fused_kernel_options.impl_backend={BACKEND}")
    return LinearConfig(batch_invariant=value)


def sampling_config(model_config) -> SamplingFilter | None:
    """The kept set that verl's model config asks the fused forward's log-probs to follow through
    `fused_kernel_options.sampling_aware_logprobs`, a mapping of top_k, top_p and min_p (verl's
    rollout values, e.g. `top_k=${actor_rollout_ref.rollout.top_k}`; top_k <= 0, top_p = 1 and
    min_p = 0 apply nothing); None when the key is absent. TypeError for anything else; ValueError
    without this fused forward, which it would never reach."""
    options = getattr(model_config, "fused_kernel_options", None) or {}
    value = options.get("sampling_aware_logprobs")
    if value is None:
        return None
    keys = set(value.keys()) if hasattr(value, "keys") else None
    if keys is None or not keys <= {"top_k", "top_p", "min_p"}:
        raise TypeError("fused_kernel_options.sampling_aware_logprobs must map top_k, top_p and/or min_p to the "
                        f"rollout's values; got {value!r}")
    if not (getattr(model_config, "use_fused_kernels", False) and options.get("impl_backend") == BACKEND):
        raise ValueError("fused_kernel_options.sampling_aware_logprobs is an option of gspo_kernels' fused forward: "
                         f"set use_fused_kernels=True and fused_kernel_options.impl_backend={BACKEND}")
    top_k, top_p, min_p = value.get("top_k"), value.get("top_p"), value.get("min_p")
    sampling = SamplingFilter(int(top_k) if top_k is not None and int(top_k) > 0 else None,
                              float(top_p) if top_p is not None and float(top_p) < 1.0 else None,
                              float(min_p) if min_p else None)
    check_sampling(sampling.top_k, sampling.top_p, sampling.min_p)
    return sampling if sampling.active else None


def _with_linear_options(build):
    """verl's FSDPEngine._build_module, which reads fused_kernel_options and patches the model's
    forward, followed by handing linear_config's LinearConfig to the model it built: an instance
    attribute, which the forward reads off `self` (FSDP2's fully_shard wraps that instance in
    place, changing its class only)."""
    @functools.wraps(build)
    def _build_module(self):
        linear = linear_config(self.model_config)  # a bad value fails before the weights load
        sampling = sampling_config(self.model_config)
        module = build(self)
        if sampling is not None:
            if type(module).forward is not forward_with_gspo_kernels:
                raise ValueError(f"fused_kernel_options.sampling_aware_logprobs: {type(module).__name__} runs verl's "
                                 "own forward (see the warning above), which the option does not reach")
            setattr(module, SAMPLING_ATTRIBUTE, sampling)
        if linear is not None:
            if linear.batch_invariant and type(module).forward is not forward_with_gspo_kernels:
                raise ValueError(f"fused_kernel_options.batch_invariant=True: {type(module).__name__} runs verl's own "
                                 "forward (see the warning above), which the option does not reach")
            setattr(module, LINEAR_ATTRIBUTE, linear)
        return module

    _build_module.gspo_kernels = True
    return _build_module


def _runs_fused_forward(module) -> bool:
    """Whether the engine's model (under FSDP2 the model itself, its class swapped for a subclass;
    under FSDP1 inside the wrapper) runs forward_with_gspo_kernels."""
    inner = getattr(module, "_fsdp_wrapped_module", module)
    return type(inner).forward is forward_with_gspo_kernels


def _with_kept_sets(prepare, engine_module):
    """verl's FSDPEngine.prepare_model_inputs, followed by handing the fused forward the batch's
    kept sets (kept_sets.py) laid out as the rows the model sees. A model running another forward
    (verl's own, a critic's) does not read them: the key is left alone there, with a warning for
    an actor on verl's fused kernels."""
    @functools.wraps(prepare)
    def prepare_model_inputs(self, micro_batch):
        model_inputs, output_args = prepare(self, micro_batch)
        if kept_sets.KEY in micro_batch.keys():
            if _runs_fused_forward(self.module):
                model_inputs[kept_sets.KEY] = kept_sets.rows_for_model(self, engine_module, micro_batch)
            elif engine_module.tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False):
                warnings.warn(f"gspo_kernels: the batch holds the engine's kept sets ({kept_sets.KEY}) but the actor "
                              "runs another fused forward, which ignores them: set "
                              f"fused_kernel_options.impl_backend={BACKEND}", stacklevel=2)
        return model_inputs, output_args

    prepare_model_inputs.gspo_kernels = True
    return prepare_model_inputs


def _hook_engine(engine_module) -> None:
    engine = getattr(engine_module, "FSDPEngine", None)
    if engine is not None and not getattr(engine._build_module, "gspo_kernels", False):
        engine._build_module = _with_linear_options(engine._build_module)
    with_head = getattr(engine_module, "FSDPEngineWithLMHead", None)  # the actor's and the reference's engine
    if with_head is not None and not getattr(with_head.prepare_model_inputs, "gspo_kernels", False):
        with_head.prepare_model_inputs = _with_kept_sets(with_head.prepare_model_inputs, engine_module)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then(module)` once `name` has been imported, by whoever imports it. The engine is
    not imported here: this module runs inside `import verl` (VERL_USE_EXTERNAL_MODULES), and the
    engine's import picks verl's device platform, before a caller could register its own."""

    def __init__(self, name: str, then) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once; the search below then finds the module as it would have
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            exec_module = spec.loader.exec_module

            def exec_then(module):
                exec_module(module)
                self.then(module)

            spec.loader.exec_module = exec_then
        return spec


def after_import(name: str, then) -> None:
    """`then(module)` on the module `name`: now if it is imported, else once something imports it."""
    if name in sys.modules:
        then(sys.modules[name])
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, then))


after_import(_ENGINE_MODULE, _hook_engine)
