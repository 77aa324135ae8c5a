"""verl drop-in: gspo_kernels' policy losses in verl's registry, and a fused log-prob +
entropy forward for verl's actor.

    VERL_USE_EXTERNAL_MODULES=gspo_kernels.integrations.verl   # every process importing verl
    actor_rollout_ref.model.external_lib=gspo_kernels.integrations.verl

Importing the module registers the losses and adds the fused backend, in the process that
imports it: verl's actors run in Ray workers, which import the modules that
VERL_USE_EXTERNAL_MODULES names when they import verl (and external_lib when they build the
model), so set it where the workers inherit it (the driver's environment, or Ray's runtime_env).

Policy losses: `actor_rollout_ref.actor.policy_loss.loss_mode=` one of
    gk_vanilla   verl's "vanilla" (token-level PPO clip with dual clip clip_ratio_c)
    gk_gspo      verl's "gspo" (the s_i,t ratio, log-ratio clamped at 10)
    gk_sapo      verl's "sapo" (soft gate, tau_pos / tau_neg, seq-mean-token-mean)
    gk_cispo     verl's "cispo"
Each takes verl's arguments (old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
config, rollout_is_weights), reads clip_ratio(_low/_high), clip_ratio_c, tau_pos/neg,
global_batch_info and loss_scale_factor from verl's ActorConfig, and computes the loss with
gspo_kernels.policy_loss: verl's numbers, metrics under verl's names.

Fused log-probs: `actor_rollout_ref.model.use_fused_kernels=True` with
`actor_rollout_ref.model.fused_kernel_options.impl_backend=gspo_kernels` makes verl's
monkey patch install `forward_with_gspo_kernels` on text models: the backbone, then
fused_linear_selective_log_softmax on the hidden states and the lm_head weight, returning
verl's CausalLMOutputForPPO (log_probs, entropy). A model verl patches with its own forward
(the vision-language ones) keeps verl's torch backend, with a warning.
`+actor_rollout_ref.model.fused_kernel_options.batch_invariant=True` runs that fused-linear call
with LinearConfig(batch_invariant=True): verl's FSDP engine, where it builds the model, hands the
option to the model (`_with_linear_options`); a value that is not a bool, or the option without
this fused forward, is refused there.

Importing it also mends verl 0.9.1's actor build next to trl >= 1.0 (`_trl_value_head_available`).

Tested against verl 0.9.1 (`tests/integrations/verl/test_verl_drop_in.py`); in 0.9.0 verl's gspo forced
seq-mean-token-mean whatever loss_agg_mode said, and gk_gspo follows 0.9.1.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
import warnings

import torch
from verl.models.transformers import monkey_patch
from verl.models.transformers.dense_common import CausalLMOutputForPPO, forward_base_model
from verl.trainer.ppo.core_algos import get_policy_loss_fn, register_policy_loss

from ..config import GSPOConfig, LinearConfig
from ..policy_loss import policy_loss
from .head import head_token_stats

BACKEND = "gspo_kernels"
# verl's own fused forwards for these model types: not plain text models.
_VERL_SPECIFIC = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "qwen3_5", "qwen3_5_moe")


# --- policy losses -------------------------------------------------------------------------

def _clip_range(config) -> tuple[float, float]:
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    return low, high


def _normalizer(loss_agg: str, info: dict):
    """verl's agg_loss denominators (global batch over dp_size) as our normalizer; None keeps
    ours, which is verl's local one."""
    dp_size = info.get("dp_size") or 1
    if loss_agg == "token-sum":
        return 1.0 / dp_size if dp_size != 1 else None
    total = info.get("batch_num_tokens") if loss_agg == "token-mean" else info.get("global_batch_size")
    if total is None:
        if dp_size > 1:
            raise ValueError(f"verl's loss_agg_mode={loss_agg!r} needs global_batch_info when dp_size > 1")
        return None
    return total / dp_size


def _mode_config(mode: str, config, loss_agg_mode: str, horizon: int) -> GSPOConfig:
    low, high = _clip_range(config)
    options = dict(eps_low=low, eps_high=high, loss_agg=loss_agg_mode)
    if mode == "vanilla":
        options.update(level="token", clip_ratio_c=config.get("clip_ratio_c", 3.0))
    elif mode == "gspo":  # verl's GSPO: s_i,t with a one-sided clamp (0.9.1 honours loss_agg_mode)
        options.update(level="sequence_token", log_ratio_clamp=(None, 10.0))
    elif mode == "sapo":
        options.update(level="token", objective="sapo", sapo_tau_pos=float(config.tau_pos),
                       sapo_tau_neg=float(config.tau_neg), eps_low=0.0, eps_high=0.0,
                       loss_agg="seq-mean-token-mean")
    elif mode == "cispo":
        options.update(level="token", objective="cispo")
    if options["loss_agg"] == "seq-mean-token-sum-norm":
        options["max_len"] = (config.global_batch_info.get("loss_scale_factor") or config.get("loss_scale_factor", None)
                              or horizon)
    return GSPOConfig(**options)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float((values * mask).sum() / (mask.sum() + 1e-8))


def _verl_metrics(mode: str, cfg: GSPOConfig, metrics: dict, old, log_prob, advantages, mask) -> dict:
    """verl's three policy metrics, by verl's formulas, from the detached inputs."""
    maskf = mask.float()
    log_ratio = (log_prob - old).detach()
    if mode != "gspo":
        log_ratio = log_ratio.clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    lower = 0.0
    if mode == "vanilla":
        clipped = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
        lower = _masked_mean(((torch.maximum(ratio, clipped) > cfg.clip_ratio_c) & (advantages < 0)).float(), maskf)
    clipfrac = 0.0 if mode == "sapo" else float(metrics["clip_frac"])
    return {"actor/pg_clipfrac": clipfrac, "actor/ppo_kl": _masked_mean(-log_ratio, maskf),
            "actor/pg_clipfrac_lower": lower}


_warned: set[str] = set()


def _make_loss(mode: str):
    def loss_fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                rollout_is_weights=None):
        assert config is not None, f"gk_{mode} needs verl's ActorConfig"
        try:
            cfg = _mode_config(mode, config, loss_agg_mode, response_mask.shape[-1])
        except ValueError as error:  # a setting verl takes that our options refuse (e.g. clip_ratio_low >= 1)
            reason = f"gk_{mode}: {error}"
            if reason not in _warned:
                _warned.add(reason)
                warnings.warn(f"gspo_kernels: {reason}; running verl's own {mode!r} loss for it", stacklevel=2)
            return get_policy_loss_fn(mode)(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                                            rollout_is_weights)
        mask = response_mask.bool()
        loss, metrics = policy_loss(log_prob.float(), old_log_prob.float(), advantages.float(), mask=mask,
                                    token_weights=rollout_is_weights,
                                    normalizer=_normalizer(cfg.loss_agg, dict(config.global_batch_info)),
                                    config=cfg)
        return loss, _verl_metrics(mode, cfg, metrics, old_log_prob, log_prob, advantages, mask)

    loss_fn.__name__ = f"compute_policy_loss_gk_{mode}"
    loss_fn.__doc__ = f"verl's {mode!r} policy loss, computed by gspo_kernels.policy_loss."
    return loss_fn


POLICY_LOSSES = {f"gk_{mode}": register_policy_loss(f"gk_{mode}")(_make_loss(mode))
                 for mode in ("vanilla", "gspo", "sapo", "cispo")}


# --- the actor's fused log-probs -------------------------------------------------------------

def forward_with_gspo_kernels(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                              inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                              output_hidden_states=None, return_dict=None, cache_position=None, logits_to_keep=0,
                              temperature: float = 1.0, shift_labels=None, **loss_kwargs):
    """verl's fused forward contract (the same arguments as its torch and triton backends):
    per-token log-probs of the next token and entropies, from the hidden states and the
    lm_head weight, with no logits."""
    outputs = forward_base_model(self, input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids, past_key_values=past_key_values,
                                 inputs_embeds=inputs_embeds, use_cache=use_cache,
                                 output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                                 cache_position=cache_position)
    if shift_labels is not None:
        targets = shift_labels
    elif labels is not None:
        targets = torch.roll(labels, shifts=-1, dims=-1)
    elif input_ids is not None:
        targets = torch.roll(input_ids, shifts=-1, dims=-1)
    else:
        raise RuntimeError("forward_with_gspo_kernels needs labels, shift_labels or input_ids")
    # Through the head's own call: under FSDP2 verl wraps an untied lm_head as its own unit.
    hidden = outputs[0]
    log_probs, entropy = head_token_stats(self.lm_head, hidden, targets, temperature=temperature, dtype=hidden.dtype,
                                          linear=getattr(self, LINEAR_ATTRIBUTE, None))
    return CausalLMOutputForPPO(log_probs=log_probs, entropy=entropy, past_key_values=outputs.past_key_values,
                                hidden_states=outputs.hidden_states, attentions=outputs.attentions)


# --- fused-linear options from verl's config: fused_kernel_options.batch_invariant -----------

LINEAR_ATTRIBUTE = "gspo_kernels_linear"  # the LinearConfig a built model's fused forward runs with
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


def _with_linear_options(build):
    """verl's FSDPEngine._build_module, which reads fused_kernel_options and patches the model's
    forward, followed by handing linear_config's LinearConfig to the model it built: an instance
    attribute, which the forward reads off `self` (FSDP2's fully_shard wraps that instance in
    place, changing its class only)."""
    @functools.wraps(build)
    def _build_module(self):
        linear = linear_config(self.model_config)  # a bad value fails before the weights load
        module = build(self)
        if linear is not None:
            if linear.batch_invariant and type(module).forward is not forward_with_gspo_kernels:
                raise ValueError(f"fused_kernel_options.batch_invariant=True: {type(module).__name__} runs verl's own "
                                 "forward (see the warning above), which the option does not reach")
            setattr(module, LINEAR_ATTRIBUTE, linear)
        return module

    _build_module.gspo_kernels = True
    return _build_module


def _hook_engine(engine_module) -> None:
    engine = getattr(engine_module, "FSDPEngine", None)
    if engine is not None and not getattr(engine._build_module, "gspo_kernels", False):
        engine._build_module = _with_linear_options(engine._build_module)


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


if _ENGINE_MODULE in sys.modules:
    _hook_engine(sys.modules[_ENGINE_MODULE])
elif not any(isinstance(f, _AfterImport) and f.name == _ENGINE_MODULE for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterImport(_ENGINE_MODULE, _hook_engine))


# --- verl's monkey patch ---------------------------------------------------------------------

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
