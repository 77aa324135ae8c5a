"""The fused log-prob + entropy forward verl's actor runs with `use_fused_kernels=True` and
`fused_kernel_options.impl_backend=gspo_kernels`: the backbone, then the fused-linear token stats
on the hidden states and the lm_head weight (through the head's own call), returned as verl's
CausalLMOutputForPPO. No logits."""

from __future__ import annotations

import torch
from verl.models.transformers.dense_common import CausalLMOutputForPPO, forward_base_model

from ...inputs.kept_tokens import KeptTokens
from ..announce import announce_fused
from ..head import head_token_stats
from ..model_logits import logit_scale_of, logit_softcap_of, unsupported_logit_transform


def kept_rows(kept_token_ids: torch.Tensor, shape: torch.Size, vocab: int) -> tuple:
    """(KeptTokens of the rows, the rows that have a set) from `(..., k)` ids, -1 padded."""
    if tuple(kept_token_ids.shape[:-1]) != tuple(shape):
        raise ValueError(f"kept_token_ids has shape {tuple(kept_token_ids.shape)}; the targets have {tuple(shape)} "
                         "(one set of ids per target, -1 padded)")
    return KeptTokens.from_padded_sets(kept_token_ids, vocab)


def _vocab_of(head: torch.nn.Module, config) -> int:
    """The head's rows, read without its (possibly sharded) weight."""
    return int(getattr(head, "out_features", None) or config.vocab_size)


BACKEND = "gspo_kernels"
LINEAR_ATTRIBUTE = "gspo_kernels_linear"  # the LinearConfig a built model's fused forward runs with
SAMPLING_ATTRIBUTE = "gspo_kernels_sampling"  # the rollout's kept set its log-probs follow (engine_hook)


def forward_with_gspo_kernels(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                              inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                              output_hidden_states=None, return_dict=None, cache_position=None, logits_to_keep=0,
                              temperature: float = 1.0, shift_labels=None, kept_token_ids=None, **loss_kwargs):
    """verl's fused forward contract (the same arguments as its torch and triton backends):
    per-token log-probs of the next token and entropies, from the hidden states and the
    lm_head weight, with no logits. kept_token_ids: the engine's kept set of each row's target,
    `(..., k)` in the targets' shape, -1 padded (kept_sets.py puts the batch's there): the
    log-probs and entropies over each set; rows without one get 0 and no gradient."""
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
    # verl's own fused kernels take neither the model's logit scale nor its soft-cap: ours take
    # both (model_logits.py), and refuse what they cannot apply rather than drop it.
    transform = unsupported_logit_transform(self.config)
    if transform is not None:
        raise NotImplementedError(f"gspo_kernels' fused forward does not apply this model's {transform}; set "
                                  "actor_rollout_ref.model.use_fused_kernels=False for it")
    announce_fused("verl's fused forward runs gspo_kernels' fused-linear log-probs and entropies (no logits)")
    # Through the head's own call: under FSDP2 verl wraps an untied lm_head as its own unit.
    hidden = outputs[0]
    sampling = getattr(self, SAMPLING_ATTRIBUTE, None)
    kept, has_set = None, None
    if kept_token_ids is not None:
        if sampling is not None:
            raise ValueError("the batch holds the engine's kept sets (kept_token_ids) and fused_kernel_options."
                             "sampling_aware_logprobs is on: pass the kept set one way")
        kept, has_set = kept_rows(kept_token_ids, targets.shape, _vocab_of(self.lm_head, self.config))
    log_probs, entropy = head_token_stats(self.lm_head, hidden, targets, temperature=temperature, dtype=hidden.dtype,
                                          linear=getattr(self, LINEAR_ATTRIBUTE, None),
                                          logit_scale=logit_scale_of(self.config),
                                          logit_softcap=logit_softcap_of(self.config),
                                          sampling=sampling, kept_tokens=kept, mask=has_set)
    if has_set is not None:  # rows without a set (prompts, padding): 0, as nothing reads them
        log_probs = torch.where(has_set, log_probs, torch.zeros_like(log_probs))
        entropy = torch.where(has_set, entropy, torch.zeros_like(entropy))
    return CausalLMOutputForPPO(log_probs=log_probs, entropy=entropy, past_key_values=outputs.past_key_values,
                                hidden_states=outputs.hidden_states, attentions=outputs.attentions)
