"""AReaL's actor loss on one micro-batch, from the fused log-probs.

PPOActor hands the engine `functools.partial(grpo_loss_fn, **the actor's options)`. Its options
map onto gspo_kernels.policy_loss:

    importance_sampling_level   level: "token" (PPO ratio) or "sequence" (GSPO: s_i on every
                                token, and AReaL's mean advantage of the sequence on each)
    eps_clip, eps_clip_higher   eps_low, eps_high
    c_clip                      clip_ratio_c (dual clip)
    use_sapo_loss, sapo_tau_*   objective="sapo", against the behaviour log-probs as AReaL's SAPO
    aggregation                 token-mean over the micro-batch's loss tokens (AReaL's count)

Which tokens and which proximal log-probs enter are AReaL's rules, run by AReaL's own functions:
the proximal log-probs of `prox_logp_method`, M2PO's mask (`m2_threshold`), and the decoupled
loss's `rejection_sampling` (its mask, and its behaviour weights as policy_loss's token_weights).
The teacher's joint term (`rl_loss_weight * loss + distill_loss_weight * mean(logp - teacher)`)
is added as AReaL adds it. AReaL's statistics are logged by grpo_loss_fn itself, run without
gradient on the same log-probs; `vocab_min_logits` and `vocab_max_logits` (they read every
logit, which the fused path never forms) only where the actor is asked to form them
(FusedFSDPPPOActor.log_vocab_range).

Pure distillation (`teacher.rl_loss_weight=0`) and a loss function other than grpo_loss_fn run
that function itself on the fused log-probs, with a warning once.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch
from areal.trainer.ppo.actor import _apply_m2po_masking, _resolve_proximal_logp, grpo_loss_fn
from areal.utils.functional import apply_rejection_sampling

from ...config import GSPOConfig
from ...inputs.segments import Segments
from ...policy_loss import policy_loss
from .fused_forward import TokenStats

_warned: set[str] = set()


def grpo_options(loss_fn) -> dict | None:
    """grpo_loss_fn's options as PPOActor bound them, defaults filled; None for another loss."""
    if not (isinstance(loss_fn, functools.partial) and loss_fn.func is grpo_loss_fn and not loss_fn.args):
        return None
    bound = inspect.signature(grpo_loss_fn).bind_partial(**loss_fn.keywords)
    bound.apply_defaults()
    return dict(bound.arguments)


def _scalar(value) -> float | None:
    """A per-trajectory weight as one float, or None when the micro-batch's values differ."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 0 or not bool((value == value.reshape(-1)[0]).all()):
            return None
        return float(value.reshape(-1)[0])
    return float(value)


def _teacher_weights(mb: dict) -> tuple[float | None, float | None]:
    return _scalar(mb.get("rl_loss_weight", 1.0)), _scalar(mb.get("distill_loss_weight", 0.005))


def unmapped(options: dict | None, mb: dict) -> str | None:
    """Why this micro-batch's loss runs AReaL's function, or None when policy_loss runs it."""
    if options is None:
        return "the actor's loss function is not AReaL's grpo_loss_fn"
    if mb.get("teacher_logp") is not None:
        rl_weight, distill_weight = _teacher_weights(mb)
        if rl_weight is None or distill_weight is None:
            return "the micro-batch's trajectories carry different rl_loss_weight or distill_loss_weight"
        if rl_weight == 0:
            return "teacher.rl_loss_weight=0 (pure distillation, an importance-weighted reverse KL)"
    return None


def _sequence_mean(values: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """AReaL's GSPO advantage: each sequence's mean over its loss tokens, on every one of them."""
    segments = (Segments.padded(*values.shape) if values.dim() == 2
                else Segments.packed(cu_seqlens.long(), values.numel()))
    sums, counts = segments.seq_sums((torch.where(mask, values, 0.0), mask), values.dtype)
    return torch.where(mask, segments.per_row(sums / counts.clamp(min=1)), 0.0)


def _policy_term(logprobs: torch.Tensor, mb: dict, options: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(the micro-batch's policy loss, the mask the teacher term averages over)."""
    mask = mb["loss_mask"].bool()
    old = mb["logprobs"]
    prox = _resolve_proximal_logp(prox_logp_gt=mb.get("prox_logp"), prox_logp_method=options["prox_logp_method"],
                                  old_logp=old, logprobs=logprobs.detach(), versions=mb.get("versions"),
                                  current_version=options["current_version"])
    if options["m2_threshold"] is not None:
        mask = _apply_m2po_masking(old, prox, mask, options["m2_threshold"])
    count = mask.count_nonzero().clamp(min=1).to(torch.float32)  # AReaL's denominator, without a host sync
    cu_seqlens = mb.get("cu_seqlens") if logprobs.dim() == 1 else None
    policy_mask, weights, baseline = mask, None, prox
    if options["use_sapo_loss"]:  # AReaL's SAPO: against the behaviour log-probs, no rejection sampling
        baseline = old
        settings = dict(objective="sapo", sapo_tau_pos=float(options["sapo_tau_pos"]),
                        sapo_tau_neg=float(options["sapo_tau_neg"]))
    else:
        eps_high = options["eps_clip"] if options["eps_clip_higher"] is None else options["eps_clip_higher"]
        settings = dict(eps_low=float(options["eps_clip"]), eps_high=float(eps_high), clip_ratio_c=options["c_clip"])
        if options["rejection_sampling"] is not None:
            rejection = apply_rejection_sampling(proximal_logprobs=prox, old_logprobs=old, loss_mask=mask,
                                                 cu_seqlens=mb.get("cu_seqlens"), config=options["rejection_sampling"])
            policy_mask, weights = rejection.loss_mask.bool(), rejection.behave_imp_weight
    advantages = mb["advantages"].detach()
    level = options["importance_sampling_level"]
    if level == "sequence":
        advantages = _sequence_mean(advantages, policy_mask, mb.get("cu_seqlens"))
    config = GSPOConfig(level=level, loss_agg="token-mean", log_ratio_clamp=(None, None), **settings)
    loss, _ = policy_loss(logprobs, baseline, advantages, mask=policy_mask, cu_seqlens=cu_seqlens,
                          token_weights=weights, normalizer=count, config=config)
    return loss, mask


def micro_batch_loss(loss_fn, stats: TokenStats, mb: dict, calls) -> torch.Tensor:
    """AReaL's actor loss of one micro-batch (before the engine's scale by its share of the
    global loss tokens), from the fused log-probs; `calls` counts which path ran."""
    options = grpo_options(loss_fn)
    reason = unmapped(options, mb)
    if reason is not None:
        if reason not in _warned:
            _warned.add(reason)
            warnings.warn(f"gspo_kernels: {reason}; AReaL's loss function runs on the fused log-probs", stacklevel=2)
        calls["areal_loss"] += 1
        return loss_fn(stats.logprobs, stats.entropy, mb, vocab_min_logits=stats.vocab_min,
                       vocab_max_logits=stats.vocab_max)
    with torch.no_grad():  # AReaL's statistics, by AReaL's code
        loss_fn(stats.logprobs.detach(), stats.entropy.detach(), mb, vocab_min_logits=stats.vocab_min,
                vocab_max_logits=stats.vocab_max)
    loss, mask = _policy_term(stats.logprobs, mb, options)
    teacher = mb.get("teacher_logp")
    if teacher is not None:
        rl_weight, distill_weight = _teacher_weights(mb)
        penalty = ((stats.logprobs - teacher.detach()) * mask).sum() / mask.sum().clamp(min=1)
        loss = rl_weight * loss + distill_weight * penalty
    calls["gspo_loss"] += 1
    return loss
