"""GSPO for Megatron-Core trainers (docs/trainers.md, "Megatron-Core"): the loss and the token
log-probs on the output layer's vocab-parallel logits, in Megatron's layouts, with the groups of
megatron.core.parallel_state (logits.py); slime's custom loss on them (slime.py). megatron-core
itself is imported only to read those groups."""

from .logits import gspo_loss, megatron_groups, token_logprobs

__all__ = ["gspo_loss", "megatron_groups", "token_logprobs"]
