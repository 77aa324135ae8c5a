"""Stage 2 alone: the GSPO loss from per-token log-probs a trainer already has.

For trainers whose actor computes the log-probs itself (verl's policy-loss registry hands its
loss functions `log_prob`, not logits): the same sequence math, options and metrics as
gspo_loss, with autograd carrying dLoss/dlogp back to whatever produced the log-probs.
"""

from __future__ import annotations

import torch

from .config import GSPOConfig, resolve_config
from .inputs.batch import CallInputs, prepare_batch
from .inputs.checks import LOGPROB_DTYPES, TokenLayout
from .sequence.gspo_objective import gspo_objective


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor | None, advantages: torch.Tensor, *,
                mask=None, cu_seqlens=None, entropy=None, ref_logprobs=None, rollout_logprobs=None, token_weights=None,
                normalizer=None, entropy_threshold=None, cp_group=None, config: GSPOConfig | None = None, **options):
    """gspo_loss's stage 2 on per-token log-probs: `(B, T)` padded or `(N,)` packed with
    cu_seqlens, float32 or float64, differentiable. entropy (like logprobs) is needed only by
    entropy_coef and top_entropy_quantile. token_weights (like logprobs, detached) multiply the
    policy term before the KL term and the aggregation: weights computed elsewhere, such as
    verl's rollout_is_weights. Every other argument and option is gspo_loss's; `temperature`
    and `backend` do not apply (the log-probs are given). Returns (loss, metrics) as gspo_loss,
    without the entropy metrics when no entropy is given.
    """
    config = resolve_config(config, options)
    given_logits_options = [name for name, plain in (("logit_scale", 1.0), ("logit_softcap", None), ("sampling_top_k", None),
                                                     ("sampling_top_p", None), ("sampling_min_p", None))
                            if getattr(config, name) != plain]
    if given_logits_options:
        raise ValueError(f"{', '.join(given_logits_options)} shape the log-probs, which policy_loss is given: pass them "
                         "where the log-probs are computed (selective_log_softmax, fused_linear_selective_log_softmax)")
    if not isinstance(logprobs, torch.Tensor):
        raise TypeError(f"logprobs must be a torch.Tensor; got {type(logprobs).__name__}")
    if logprobs.dtype not in LOGPROB_DTYPES or logprobs.dim() not in (1, 2):
        raise ValueError(f"logprobs must be float32/float64, (B, T) padded or (N,) packed; got {logprobs.dtype} "
                         f"of shape {tuple(logprobs.shape)}")
    needs_entropy = config.entropy_coef != 0.0 or config.top_entropy_quantile < 1.0
    if entropy is None and needs_entropy:
        raise ValueError("entropy_coef and top_entropy_quantile need the per-token entropy: pass entropy=")
    if entropy is not None and (not isinstance(entropy, torch.Tensor) or entropy.shape != logprobs.shape):
        raise ValueError("entropy must be a tensor shaped like logprobs")
    layout = TokenLayout(logprobs.shape, logprobs.device)
    call = CallInputs(mask=mask, cu_seqlens=cu_seqlens, ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs,
                      normalizer=normalizer, entropy_threshold=entropy_threshold, token_weights=token_weights,
                      cp_group=cp_group)
    batch = prepare_batch(config, layout, None, old_logprobs, advantages, call)
    loss, metrics = gspo_objective(config, batch, logprobs, torch.zeros_like(logprobs) if entropy is None else entropy)
    if entropy is None:
        del metrics["entropy"], metrics["entropy_mean"]
    return loss, metrics
