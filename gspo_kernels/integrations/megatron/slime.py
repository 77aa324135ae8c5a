"""slime's custom-loss contract: `--loss-type custom_loss --custom-loss-function-path
gspo_kernels.integrations.megatron.slime.gspo_loss_function` runs slime's GSPO with the token
log-probs and entropies of the fused kernels, on the vocab-parallel logits slime hands its loss
(`[1, T, V/tp]`, float32, every sample packed one after the other): no float32 softmax of the
shard is kept for backward.

slime calls `func(args, batch, logits, sum_of_sample_mean)` (slime/backends/megatron_utils/
loss.py, loss_function, at THUDM/slime 624b824). Row j of the logits predicts token j + 1 of its
sample, so sample i (prompt and response, total_lengths[i] tokens) gives its response's
log-probs at rows [end - response_length - 1, end - 1), end = its offset + total_lengths[i].
The loss is slime's policy loss with its reducer:

    loss = R(pg) - entropy_coef * R(entropy) + kl_loss_coef * R(kl)      (kl with use_kl_loss)

pg the clipped GSPO term per token (gk.policy_loss at level sequence, or token for another
advantage estimator), R slime's sum_of_sample_mean. R is linear, so its weight on each token is
read once, by autograd on a zero vector, and handed to policy_loss as token_weights with
loss_agg='token-sum': whatever denominators slime put in R (per sample, per rollout group) hold
exactly. Refused with a message: context parallelism, TIS, OPSM, the mismatch metrics, rollout
top-p replay, a custom pg-loss reducer and cispo, which slime's own policy loss handles.
"""

from __future__ import annotations

import torch

from ...policy_loss import policy_loss
from .logits import token_logprobs

# slime arguments whose features this function does not implement, with what each is.
_REFUSED = {
    "use_tis": "truncated importance sampling (--use-tis)",
    "get_mismatch_metrics": "the train/rollout mismatch metrics (--get-mismatch-metrics)",
    "use_opsm": "the off-policy sequence mask (--use-opsm)",
    "custom_pg_loss_reducer_function_path": "a custom pg-loss reducer",
}


def _check_supported(args) -> None:
    for name, what in _REFUSED.items():
        if getattr(args, name, None):
            raise NotImplementedError(f"gspo_kernels' slime loss does not implement {what}; drop it or use slime's "
                                      "policy_loss")
    if getattr(args, "rollout_top_p", 1.0) != 1.0:
        raise NotImplementedError("gspo_kernels' slime loss does not implement rollout top-p replay "
                                  "(--rollout-top-p < 1)")
    if getattr(args, "advantage_estimator", "gspo") == "cispo":
        raise NotImplementedError("advantage_estimator='cispo': use slime's policy_loss")
    from megatron.core import parallel_state

    if parallel_state.get_context_parallel_world_size() > 1:
        raise NotImplementedError("gspo_kernels' slime loss does not implement context parallelism yet "
                                  "(--context-parallel-size > 1)")


def _targets_and_rows(batch, rows: int, device):
    """(targets [T], response rows [R]): each sample's next tokens at its rows, 0 elsewhere (rows
    outside every response are masked out, so their target is never read); the response rows in
    sample order, as slime concatenates its per-sample lists."""
    targets = torch.zeros(rows, dtype=torch.long, device=device)
    response_rows, offset = [], 0
    for tokens, total, response in zip(batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"]):
        targets[offset:offset + total - 1] = tokens[1:total].to(device)
        end = offset + total - 1
        response_rows.extend(range(end - response, end))
        offset += total
    if offset > rows:
        raise ValueError(f"the samples' total_lengths add up to {offset} tokens but the logits hold {rows} rows")
    return targets, torch.tensor(response_rows, dtype=torch.long, device=device)


def _reducer_weights(sum_of_sample_mean, n: int, device) -> torch.Tensor:
    """d R(x) / d x: R's weight on each response token (R is linear)."""
    x = torch.zeros(n, dtype=torch.float32, device=device, requires_grad=True)
    reduced = sum_of_sample_mean(x)
    if not isinstance(reduced, torch.Tensor) or not reduced.requires_grad:
        return torch.zeros(n, dtype=torch.float32, device=device)
    return torch.autograd.grad(reduced, x)[0]


def _approx_kl(logp, ref, kind: str, ratio=None):
    """slime's KL estimators of log pi / pi_ref per token (k1, k2, k3 = low_var_kl, the latter
    clamped to [-10, 10]), times the importance ratio when given."""
    log_ratio = logp - ref
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio.square()
    elif kind in ("k3", "low_var_kl"):
        kl = torch.expm1(-log_ratio) + log_ratio
    else:
        raise ValueError(f"unknown kl_loss_type {kind!r}; slime's are k1, k2, k3, low_var_kl")
    if ratio is not None:
        kl = ratio * kl
    return kl.clamp(-10.0, 10.0) if kind == "low_var_kl" else kl


def gspo_loss_function(args, batch, logits, sum_of_sample_mean):
    """slime's custom loss: (loss, metrics) with slime's metric names (loss, pg_loss,
    entropy_loss, pg_clipfrac, ppo_kl, and kl_loss with use_kl_loss)."""
    _check_supported(args)
    if logits.dim() != 3 or logits.shape[0] != 1:
        raise ValueError(f"slime hands its loss logits of shape [1, T, V/tp]; got {tuple(logits.shape)}")
    rows = logits.shape[1]
    targets, response_rows = _targets_and_rows(batch, rows, logits.device)
    in_response = torch.zeros(rows, dtype=torch.bool, device=logits.device).index_fill_(0, response_rows, True)
    logp_all, entropy_all = token_logprobs(logits, targets, sequence_first=False, packed=True,
                                           temperature=getattr(args, "rollout_temperature", 1.0),
                                           return_entropy=True, loss_mask=in_response)
    logp, entropy = logp_all[response_rows], entropy_all[response_rows]

    lengths = torch.tensor([0] + list(batch["response_lengths"]), device=logits.device).cumsum(0)
    loss_mask = torch.cat(batch["loss_masks"]).to(logits.device)
    old_list = batch["rollout_log_probs"] if getattr(args, "use_rollout_logprobs", False) else batch.get("log_probs")
    old = torch.cat(old_list).float() if old_list else logp.detach()
    weights = _reducer_weights(sum_of_sample_mean, logp.numel(), logits.device)
    level = "sequence" if getattr(args, "advantage_estimator", "gspo") == "gspo" else "token"
    advantages = torch.cat(batch["advantages"]).float()
    pg_loss, metrics = policy_loss(
        logp, old, advantages, mask=loss_mask != 0, cu_seqlens=lengths, token_weights=weights, level=level,
        eps_low=args.eps_clip, eps_high=args.eps_clip_high, clip_ratio_c=getattr(args, "eps_clip_c", None),
        loss_agg="token-sum", normalizer=1.0)

    entropy_loss = sum_of_sample_mean(entropy)
    loss = pg_loss - args.entropy_coef * entropy_loss
    ratio = metrics["seq_ratio"] if level == "sequence" else None
    with torch.no_grad():
        per_token_ratio = torch.exp(logp - old) if ratio is None else \
            torch.repeat_interleave(ratio, torch.as_tensor(batch["response_lengths"], device=logits.device))
        clipped = per_token_ratio.clamp(1 - args.eps_clip, 1 + args.eps_clip_high)
        report = {
            "pg_loss": pg_loss.detach(),
            "entropy_loss": entropy_loss.detach(),
            "pg_clipfrac": sum_of_sample_mean(((-clipped * advantages) > (-per_token_ratio * advantages)).float()),
            "ppo_kl": sum_of_sample_mean(-torch.log(per_token_ratio)),
        }
    if getattr(args, "use_kl_loss", False):
        ref = torch.cat(batch["ref_log_probs"]).float()
        importance = torch.exp(logp - old) if getattr(args, "use_unbiased_kl", False) else None
        kl_loss = sum_of_sample_mean(_approx_kl(logp, ref, args.kl_loss_type, importance))
        loss = loss + args.kl_loss_coef * kl_loss
        report["kl_loss"] = kl_loss.detach()
    report["loss"] = loss.detach()
    return loss, report
