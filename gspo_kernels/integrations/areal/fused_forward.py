"""One AReaL micro-batch's log-probs and entropies from the hidden states and the lm_head, with
no logits.

AReaL's FSDP engine runs the whole causal LM (`self.model(**inputs)`) and reads `.logits`, a
`[L, V]` tensor that its `gather_logprobs_entropy` turns into a float32 log-softmax. Here the
backbone runs as the model's own call (`call_as_forward`): FSDP2's hooks on the root unshard the
parameters no layer unit holds (the embedding, the final norm, a tied head) and cast the inputs
as for the model's forward, and reshard after. The fused-linear token stats then run as the
head's call (head.py), so an lm_head that is its own FSDP unit is unsharded for them too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..head import call_as_forward, head_logit_range, head_token_stats
from ..model_logits import logit_scale_of, logit_softcap_of, unsupported_logit_transform


@dataclass
class TokenStats:
    """Per-token log-probs and entropies of a packed micro-batch, float32, `(L,)`; and each
    token's smallest and largest logit where they were asked for (AReaL's vocab_min_logits and
    vocab_max_logits), else None."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    vocab_min: torch.Tensor | None = None
    vocab_max: torch.Tensor | None = None

    def trimmed(self, pad_length: int) -> "TokenStats":
        """Without the padding AReaL appends to a micro-batch (its `pad_length`)."""
        if pad_length <= 0:
            return self
        cut = slice(0, -pad_length)
        return TokenStats(*(None if t is None else t[cut]
                            for t in (self.logprobs, self.entropy, self.vocab_min, self.vocab_max)))


def _causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM inside AReaL's model: a PEFT wrapper's base model, else the model."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _next_tokens(inputs: dict) -> torch.Tensor:
    """The targets AReaL's engine reads: each position's next input id, rolled over the packed row."""
    labels = inputs.get("rolled_input_ids")
    if labels is None:
        labels = torch.roll(inputs["input_ids"], shifts=-1, dims=-1)
    return labels.squeeze(0) if labels.dim() == 2 and labels.shape[0] == 1 else labels


def micro_batch_token_stats(model: torch.nn.Module, inputs: dict, temperature: float,
                            vocab_range: bool = False) -> TokenStats:
    """The log-probs of each position's next token and the entropies, under
    softmax(model's logits / temperature), for AReaL's packed micro-batch `inputs` (the engine's
    padded_mb: input_ids `(1, L)` and the attention keys). vocab_range: each position's smallest
    and largest logit too (head.head_logit_range: one more forward product of the head)."""
    causal = _causal_lm(model)
    transform = unsupported_logit_transform(causal.config)
    if transform is not None:
        raise NotImplementedError(f"gspo_kernels' fused actor does not apply this model's {transform}; build "
                                  "AReaL's own FSDPPPOActor for it")
    head = causal.get_output_embeddings()
    targets = _next_tokens(inputs)

    transforms = dict(logit_scale=logit_scale_of(causal.config), logit_softcap=logit_softcap_of(causal.config))

    def forward(**kwargs):
        hidden = causal.base_model(**kwargs)[0]
        hidden = hidden.squeeze(0) if hidden.dim() == 3 and hidden.shape[0] == 1 else hidden
        logprobs, entropy = head_token_stats(head, hidden, targets, temperature=temperature, dtype=hidden.dtype,
                                             **transforms)
        # Tensors of their own, not views of the kernels' buffers: FSDP2 hooks the root's outputs
        # for backward, and warns that an in-place op on a view would skip that hook.
        stats = [logprobs.clone(), entropy.clone()]
        if vocab_range:
            stats += head_logit_range(head, hidden, **transforms)
        return tuple(stats)

    return TokenStats(*call_as_forward(model, forward, **inputs))
