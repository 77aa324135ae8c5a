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
this fused forward, is refused there. `+actor_rollout_ref.model.fused_kernel_options.sampling_aware_logprobs`
(a mapping of top_k, top_p, min_p, e.g. `{top_k: ${actor_rollout_ref.rollout.top_k}, top_p:
${actor_rollout_ref.rollout.top_p}}`) makes those log-probs and entropies the rollout sampler's:
the softmax renormalised over the tokens it kept (engine_hook.sampling_config).

verl's Megatron backend: the same impl_backend key routes its engine's logits processor
(use_fused_kernels=False) and its fused forward's linear_cross_entropy (use_fused_kernels=True)
through gspo_kernels (megatron_engine.py).

Importing it also mends verl 0.9.1's actor build next to trl >= 1.0 (`_trl_value_head_available`).

Tested against verl 0.9.1 (`tests/integrations/verl_tests/test_verl_drop_in.py`); in 0.9.0 verl's gspo forced
seq-mean-token-mean whatever loss_agg_mode said, and gk_gspo follows 0.9.1.
"""

# Importing the package registers the losses, installs the engine hook and amends verl's
# monkey patch, in this order (each module does its part when imported).
from .losses import POLICY_LOSSES, _warned  # noqa: F401  (_warned: the warn-once set, for tests)
from .fused_forward import BACKEND, LINEAR_ATTRIBUTE, forward_with_gspo_kernels
from .engine_hook import _with_linear_options, linear_config, sampling_config  # noqa: F401
from . import megatron_engine, patching  # noqa: F401

__all__ = ["BACKEND", "LINEAR_ATTRIBUTE", "POLICY_LOSSES", "forward_with_gspo_kernels", "linear_config",
           "sampling_config"]
