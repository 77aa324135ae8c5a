"""verl's Megatron backend through gspo_kernels, by the FSDP path's key,
`actor_rollout_ref.model.fused_kernel_options.impl_backend=gspo_kernels`:

- with `use_fused_kernels=True`, verl's fused forward (verl/models/mcore/model_forward_fused.py,
  which hands the output layer's hidden states and weight shard to `linear_cross_entropy`) runs
  gspo_kernels' fused-linear token stats on the shard (`linear_cross_entropy` below): no logits;
- with `use_fused_kernels=False`, the engine's logits processor
  (`MegatronEngineWithLMHead._lm_head_logits_processor`) takes the log-probs and entropies of
  its `[b, s, V/tp]` logits from gspo_kernels.integrations.megatron.token_logprobs: no copy of
  the shard for the entropy, and no float32 softmax kept for backward.

Without the key verl's own code runs. verl's engine module is wrapped when verl imports it
(engine_hook.after_import); the fused forward's `linear_cross_entropy` is swapped for a
dispatcher that runs ours only inside the forward of a model built with the key.
"""

from __future__ import annotations

import contextvars
import functools

from ...linear.api import fused_linear_selective_log_softmax
from ..announce import announce_fused
from ..megatron.logits import token_logprobs
from .engine_hook import after_import
from .fused_forward import BACKEND

_ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
_FUSED_FORWARD_MODULE = "verl.models.mcore.model_forward_fused"

# Set, to the model's sequence_parallel flag, while a model built with the key runs its forward.
_ROUTED = contextvars.ContextVar("gspo_kernels_verl_megatron", default=None)


def uses_gspo_kernels(model_config) -> bool:
    options = getattr(model_config, "fused_kernel_options", None) or {}
    return options.get("impl_backend") == BACKEND


def linear_cross_entropy(hidden, weight, labels, temperature: float = 1.0, reduction: str = "none",
                         dist_process_group=None, *, sequence_parallel: bool | None = None):
    """verl's `linear_cross_entropy` contract (verl/utils/kernel/linear_cross_entropy.py) on
    gspo_kernels' fused linear: the hidden states `(..., h)` and the labels flattened to rows,
    the weight this rank's `[V/tp, h]` shard of dist_process_group's vocabulary; returns
    (log-probs, entropies), `(rows,)` float32, with the backward to hidden and weight.

    The gradient of the hidden states: verl's kernel returns this rank's part, unreduced, which
    verl's sequence-parallel gather reduce-scatters. sequence_parallel=False (a model whose
    output layer would all-reduce it, as ColumnParallelLinear does without sequence
    parallelism) sums it over the group here; None (called outside a routed model) keeps verl's."""
    if reduction != "none":
        raise ValueError(f"linear_cross_entropy: only reduction='none' (per-token values) is supported; got "
                         f"{reduction!r}")
    if hidden.dim() == 3 and hidden.shape[1] != 1:
        raise ValueError("linear_cross_entropy reads verl's packed rows, [t, 1, h] against [1, t] labels; a "
                         f"[s, b, h] batch with b > 1 meets [b, s] labels in another order (got hidden "
                         f"{tuple(hidden.shape)})")
    rows, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if rows.shape[0] != targets.shape[0]:
        raise ValueError(f"linear_cross_entropy: {rows.shape[0]} hidden rows against {targets.shape[0]} labels")
    reduce_hidden_grad = sequence_parallel is False and dist_process_group is not None
    return fused_linear_selective_log_softmax(rows, weight, targets, temperature=float(temperature),
                                              return_entropy=True, tp_group=dist_process_group,
                                              reduce_hidden_grad=reduce_hidden_grad)


def _dispatch(verl_function):
    """The fused forward's linear_cross_entropy: ours inside a routed model's forward, else verl's."""
    @functools.wraps(verl_function)
    def dispatch(*args, **kwargs):
        sequence_parallel = _ROUTED.get()
        if sequence_parallel is None:
            return verl_function(*args, **kwargs)
        announce_fused("verl's Megatron fused forward runs gspo_kernels' fused-linear log-probs on the output "
                       "layer's weight shard (no logits)")
        return linear_cross_entropy(*args, sequence_parallel=sequence_parallel, **kwargs)

    dispatch.gspo_kernels = True
    return dispatch


def route_model(model) -> None:
    """Runs the forward of `model` (a module chunk verl's patch_fused_forward patched) with
    gspo_kernels' linear_cross_entropy."""
    from verl.models.mcore import model_forward_fused

    patched = model_forward_fused._get_patching_model(model)
    if patched is None or getattr(patched.forward, "gspo_kernels", False):
        return
    forward, sequence_parallel = patched.forward, bool(patched.config.sequence_parallel)

    @functools.wraps(forward)
    def routed(*args, **kwargs):
        token = _ROUTED.set(sequence_parallel)
        try:
            return forward(*args, **kwargs)
        finally:
            _ROUTED.reset(token)

    routed.gspo_kernels = True
    patched.forward = routed


def logits_token_stats(logits, label, temperature, *, calculate_sum_pi_squared: bool, calculate_entropy: bool,
                       distillation_use_topk: bool, distillation_only: bool, logits_processor_func, batch,
                       data_format: str) -> dict:
    """MegatronEngineWithLMHead._lm_head_logits_processor's contract (verl 0.9.1) on
    gspo_kernels.integrations.megatron.token_logprobs: the same temperature guard and in-place
    division, Σπ² and top-k distillation by verl's own functions, log-probs and entropies of the
    `[b, s, V/tp]` logits in one pass that neither modifies nor copies them."""
    from verl.utils.megatron.tensor_parallel import vocab_parallel_sum_pi_squared

    if logits.shape[:2] != label.shape[:2]:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(label.shape)} differ in [b, s]")
    temperature[temperature <= 0] = 1e-8  # verl's guard against padding's 0, on verl's tensor as verl does
    logits.div_(temperature.unsqueeze(dim=-1).to(logits.dtype))
    out = {}
    if calculate_sum_pi_squared:
        out["sum_pi_squared"] = vocab_parallel_sum_pi_squared(logits)
    if distillation_use_topk:
        out.update(logits_processor_func(student_logits=logits, data=batch, data_format=data_format))
    if calculate_entropy or not distillation_only:
        log_probs, entropy = token_logprobs(logits, label, sequence_first=False, return_entropy=True)
        if calculate_entropy:
            out["entropy"] = entropy
        if not distillation_only:
            out["log_probs"] = log_probs
    return out


def _hook_engine(engine_module) -> None:
    lm_head = getattr(engine_module, "MegatronEngineWithLMHead", None)
    engine = getattr(engine_module, "MegatronEngine", None)
    if lm_head is None or engine is None or getattr(lm_head._lm_head_logits_processor, "gspo_kernels", False):
        return
    process, enable = lm_head._lm_head_logits_processor, engine._maybe_enable_fused_kernels

    @functools.wraps(process)
    def _lm_head_logits_processor(self, logits, label, temperature, **flags):
        if not uses_gspo_kernels(self.model_config):
            return process(self, logits, label, temperature, **flags)
        announce_fused("verl's Megatron logits processor runs gspo_kernels' log-probs and entropies on the "
                       "vocab-parallel logits")
        return logits_token_stats(logits, label, temperature, **flags)

    @functools.wraps(enable)
    def _maybe_enable_fused_kernels(self):
        enable(self)
        if self.engine_config.use_fused_kernels and uses_gspo_kernels(self.model_config):
            for model in self.module:
                route_model(model)

    _lm_head_logits_processor.gspo_kernels = True
    lm_head._lm_head_logits_processor = _lm_head_logits_processor
    engine._maybe_enable_fused_kernels = _maybe_enable_fused_kernels


def _hook_fused_forward(module) -> None:
    if not getattr(module.linear_cross_entropy, "gspo_kernels", False):
        module.linear_cross_entropy = _dispatch(module.linear_cross_entropy)


after_import(_ENGINE_MODULE, _hook_engine)
after_import(_FUSED_FORWARD_MODULE, _hook_fused_forward)
