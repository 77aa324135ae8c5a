"""GSPO for Megatron-Core trainers (docs/trainers.md, "Megatron-Core"), with the groups of
megatron.core.parallel_state: the loss and the token log-probs on the output layer's
vocab-parallel logits in Megatron's layouts (logits.py), or from the hidden states and the
output layer's weight shard without any logits (output_layer.py); slime's custom loss (slime.py).
megatron-core itself is imported only to read those groups."""

from .logits import gspo_loss, megatron_groups, token_logprobs
from .output_layer import fused_output_gspo_loss, fused_output_logprobs

__all__ = ["fused_output_gspo_loss", "fused_output_logprobs", "gspo_loss", "megatron_groups", "token_logprobs"]
