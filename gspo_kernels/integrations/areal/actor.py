"""FusedFSDPPPOActor: AReaL's FSDP2 PPO actor with the log-prob and loss passes on gspo_kernels.

A subclass of AReaL's FSDPPPOActor, the extension point AReaL's own engines use (each algorithm's
engine is an FSDPEngine subclass; its trainers build the class that `areal.engine.FSDPPPOActor`
names, and its single-controller mode hands workers the class's import path). Three of the
engine's methods change, and nothing else: the micro-batch loop runs the backbone and the
fused-linear token stats in place of the model's logits (fused_forward.py), the loss pass takes
those stats (losses.py), and the log-prob pass (compute_logp: the proximal, reference and
teacher log-probs) returns the fused log-probs. Everything around them is AReaL's: micro-batch
packing, loss weights over the data-parallel group, the optimizer step, weight updates.
"""

from __future__ import annotations

from collections import Counter

import torch
from areal.engine.fsdp_engine import FSDPPPOActor
from areal.utils.perf_tracer import trace_scope

from ..announce import announce_fused, env_flag
from .fused_forward import TokenStats, micro_batch_token_stats
from .losses import micro_batch_loss

VOCAB_RANGE_ENV = "GSPO_KERNELS_AREAL_VOCAB_RANGE"


def _unsupported(engine) -> str | None:
    """The engine setting the fused actor does not run, in AReaL's terms, or None."""
    config = engine.config
    if config.is_critic:
        return "a critic (is_critic=True): the fused actor computes log-probs, not values"
    if engine.enable_tree_training:
        return "enable_tree_training=True (tree-packed sequences)"
    if engine.is_vision_model:
        return f"a vision-language model ({engine.model_config.model_type})"
    helper = engine.parallel_helper
    if helper.sp_size > 1:
        return f"Ulysses sequence parallelism (sp size {helper.sp_size} in the allocation)"
    if helper.tp_size > 1:
        return f"tensor parallelism (tp size {helper.tp_size} in the allocation)"
    return None


class FusedFSDPPPOActor(FSDPPPOActor):
    """AReaL's FSDPPPOActor, its log-probs and loss from the hidden states and the lm_head.

    `gspo_kernels_calls` counts the passes: "fused_forward" (micro-batches through the fused
    forward), "gspo_loss" (micro-batch losses by gspo_kernels.policy_loss) and "areal_loss"
    (by AReaL's loss function on the fused log-probs, losses.py says when).

    `log_vocab_range` (default: GSPO_KERNELS_AREAL_VOCAB_RANGE=1 in the environment, else False):
    log AReaL's vocab_min_logits and vocab_max_logits in the training pass, at the price of one
    more forward product of the lm_head there (the fused path forms no logits, and without it
    those two statistics are not logged)."""

    log_vocab_range: bool = env_flag(VOCAB_RANGE_ENV)

    def __init__(self, config):
        super().__init__(config)
        self.gspo_kernels_calls: Counter = Counter()

    def forward_backward_batch(self, mb_list, process_output_fn, forward_only: bool = False) -> None:
        reason = _unsupported(self)
        if reason is not None:
            raise NotImplementedError(f"gspo_kernels' FusedFSDPPPOActor does not run {reason}; use AReaL's "
                                      "FSDPPPOActor for it")
        announce_fused("AReaL's FSDP actor runs gspo_kernels' fused-linear log-probs and entropies (no logits)")
        for mb_item in mb_list:
            inputs, ctx = self._prepare_mb_inputs(mb_item)
            with trace_scope("fsdp_engine.forward"):
                stats = micro_batch_token_stats(self.model, inputs, self.config.temperature,
                                                vocab_range=self.log_vocab_range and not forward_only)
            self.gspo_kernels_calls["fused_forward"] += 1
            loss = process_output_fn(stats, ctx.to_dict())
            if not forward_only and loss is not None:
                with trace_scope("fsdp_engine.backward"):
                    loss.backward()

    def _compute_logprobs_and_loss(self, logits: TokenStats, ctx, loss_fn, loss_weight_fn, total_loss_weight,
                                   loss_multiplier: float = 1.0) -> torch.Tensor:
        """AReaL's loss pass on the fused stats (`logits` is the TokenStats the loop passes)."""
        local_weight = loss_weight_fn(ctx.mb_input)
        if local_weight == 0:  # AReaL's zero loss, still joined to the graph for FSDP's backward
            return logits.logprobs.sum() * 0.0
        loss = micro_batch_loss(loss_fn, logits.trimmed(ctx.pad_length), ctx.mb_input, self.gspo_kernels_calls)
        return loss * (local_weight / total_loss_weight * loss_multiplier)

    def _compute_forward_result(self, logits: TokenStats, ctx) -> torch.Tensor:
        """AReaL's log-prob pass on the fused stats."""
        return logits.trimmed(ctx.pad_length).logprobs
