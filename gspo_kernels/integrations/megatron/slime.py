"""slime's custom-loss contract: `--loss-type custom_loss --custom-loss-function-path
gspo_kernels.integrations.megatron.slime.gspo_loss_function` runs slime's GSPO with the token
log-probs and entropies of the fused kernels, on the vocab-parallel logits slime hands its loss
(`[1, T, V/tp]`, float32, every sample packed one after the other; with context parallelism
this rank's chunks of each, slime_layout.py): no float32 softmax of the shard is kept for
backward.

slime calls `func(args, batch, logits, sum_of_sample_mean)` (slime/backends/megatron_utils/
loss.py, loss_function, at THUDM/slime 624b824). The loss is slime's policy loss with its
reducer R (sum_of_sample_mean):

    loss = R(pg * tis * opsm) - entropy_coef * R(entropy) + kl_loss_coef * R(kl)

pg the clipped GSPO term per token (gk.policy_loss at level sequence, or token for another
advantage estimator), tis slime's vanilla truncated importance weight (with --use-tis or
--get-mismatch-metrics, as slime applies it), opsm its off-policy sequence mask (--use-opsm).
Both are the package's own corrections (sequence/corrections.py) under slime's options: TIS is
rollout_correction='token-truncate' between tis_clip_low and tis_clip on the trainer's old
log-probs (a NaN rollout log-prob counts as no correction there, where slime's weight is NaN),
OPSM is off_policy_mask_threshold=opsm_delta on the whole responses (its sequence mean takes a
NaN old - new log-prob difference as 0, and is summed in float32 where slime's is in float64).
R is linear, so its weight on each token is read once, by autograd on a zero vector, and handed
to policy_loss, times tis and opsm, as token_weights with loss_agg='token-sum': whatever
denominators slime put in R (per sample, per rollout group) hold exactly.

With context parallelism the sequence ratio needs each sample's whole response: as slime does,
each rank's response log-probs are summed into the whole responses over the context-parallel
group (zeros elsewhere), differentiably, so that each rank's loss is its own tokens' part, as
slime's, and backward sums every rank's part into each rank's rows.

Refused with a message: slime's all-gather context parallelism (--allgather-cp), a custom TIS
function, rollout top-p replay, a custom pg-loss reducer and cispo, which slime's own policy
loss handles.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from ...config import GSPOConfig
from ...inputs.segments import Segments
from ...policy_loss import policy_loss
from ...sequence.corrections import on_policy_sequences, rollout_weights
from .logits import token_logprobs
from .slime_layout import slime_layout


def _refusal(args, cp_size: int) -> str | None:
    if getattr(args, "custom_tis_function_path", None):
        return "a custom TIS function (--custom-tis-function-path)"
    if getattr(args, "custom_pg_loss_reducer_function_path", None):
        return "a custom pg-loss reducer (--custom-pg-loss-reducer-function-path)"
    if getattr(args, "rollout_top_p", 1.0) != 1.0:
        return "rollout top-p replay (--rollout-top-p < 1)"
    if getattr(args, "advantage_estimator", "gspo") == "cispo":
        return "--advantage-estimator cispo"
    if cp_size > 1 and getattr(args, "allgather_cp", False):
        return "all-gather context parallelism (--allgather-cp)"
    tis = getattr(args, "use_tis", False) or getattr(args, "get_mismatch_metrics", False)
    if tis and not getattr(args, "tis_clip_low", 0.0) < getattr(args, "tis_clip", math.inf):
        return "--tis-clip-low at or above --tis-clip (a TIS weight clamped to an empty range)"
    return None


def _context_parallel():
    from megatron.core import parallel_state

    size = parallel_state.get_context_parallel_world_size()
    if size == 1:
        return 0, 1, None
    return parallel_state.get_context_parallel_rank(), size, parallel_state.get_context_parallel_group()


def _whole_responses(local, layout, n_whole: int, cp_group):
    """This rank's response values placed in the samples' whole responses; with context
    parallelism summed over its group (each position is one rank's), differentiably."""
    whole = local.new_zeros(n_whole).index_copy(0, layout.full_index, local)
    if cp_group is None:
        return whole
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(whole, group=cp_group)


def _reducer_weights(sum_of_sample_mean, n: int, device) -> torch.Tensor:
    """d R(x) / d x: R's weight on each response token (R is linear)."""
    x = torch.zeros(n, dtype=torch.float32, device=device, requires_grad=True)
    with torch.enable_grad():
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


def _sequence_kl(whole_old, whole_logp, whole_mask, response_lengths):
    """slime's per-sample mean of old - new over its loss mask (compute_gspo_kl), detached."""
    sample = torch.repeat_interleave(torch.arange(len(response_lengths), device=whole_mask.device),
                                     torch.as_tensor(response_lengths, device=whole_mask.device))
    diff = ((whole_old - whole_logp.detach()) * whole_mask).double()
    sums = torch.zeros(len(response_lengths), dtype=torch.float64, device=diff.device).index_add_(0, sample, diff)
    counts = torch.zeros_like(sums).index_add_(0, sample, whole_mask.double())
    return (sums / counts.clamp_min(1)).float()


def _tis(args, batch, train_old, report, reduce):
    """slime's vanilla_tis_function, the weight clamp(exp(old - rollout), tis_clip_low, tis_clip)
    on each token's policy term: the package's token-truncate rollout correction; and slime's
    metrics of it reduced by R."""
    if not batch.get("rollout_log_probs"):
        raise ValueError("--use-tis and --get-mismatch-metrics need the batch's rollout_log_probs")
    rollout = torch.cat(batch["rollout_log_probs"]).float()
    # A bound at or below 0 (the weights are positive) or at +inf clamps nothing: no bound.
    truncate = GSPOConfig(rollout_correction="token-truncate", rollout_is_min=max(args.tis_clip_low, 0.0),
                          rollout_is_max=None if math.isinf(args.tis_clip) else args.tis_clip)
    # Token modes read neither the sequences nor their lengths.
    weights, _ = rollout_weights(truncate, None, torch.ones_like(train_old, dtype=torch.bool), None, train_old, rollout)
    tis = torch.exp(train_old - rollout)
    report.update(tis=reduce(tis), tis_clipfrac=reduce((weights != tis).float()), tis_abs=reduce((tis - 1).abs()))
    return weights


def _off_policy_sequences(args, whole, layout) -> torch.Tensor:
    """slime's OPSM on this rank's response tokens (1.0 where masked): the package's off-policy
    sequence mask with off_policy_mask_threshold = opsm_delta, over the whole responses."""
    cfg = GSPOConfig(off_policy_mask_threshold=args.opsm_delta)
    segments = Segments.packed(whole.cu_seqlens, whole.mask.numel())
    length = segments.seq_sum(whole.mask.float()).clamp(min=1)
    kept = on_policy_sequences(cfg, segments, whole.mask, length, whole.logp, whole.old, whole.advantages)
    return (~kept).index_select(0, layout.full_index).float()


def gspo_loss_function(args, batch, logits, sum_of_sample_mean):
    """slime's custom loss: (loss, metrics) with slime's metric names (loss, pg_loss,
    entropy_loss, pg_clipfrac, ppo_kl; kl_loss with --use-kl-loss; ois, tis, tis_clipfrac,
    tis_abs with TIS or the mismatch metrics; opsm_clipfrac with --use-opsm;
    train_rollout_logprob_abs_diff when the batch has rollout log-probs)."""
    cp_rank, cp_size, cp_group = _context_parallel()
    refused = _refusal(args, cp_size)
    if refused is not None:
        raise NotImplementedError(f"gspo_kernels' slime loss does not implement {refused}; drop it or use slime's "
                                  "policy_loss")
    if logits.dim() != 3 or logits.shape[0] != 1:
        raise ValueError(f"slime hands its loss logits of shape [1, T, V/tp]; got {tuple(logits.shape)}")
    device, rows = logits.device, logits.shape[1]
    layout = slime_layout(batch, rows, device, cp_rank, cp_size)
    in_response = torch.zeros(rows, dtype=torch.bool, device=device).index_fill_(0, layout.response_rows, True)
    logp_all, entropy_all = token_logprobs(logits, layout.targets, sequence_first=False, packed=True,
                                           temperature=getattr(args, "rollout_temperature", 1.0),
                                           return_entropy=True, loss_mask=in_response)
    logp, entropy = logp_all[layout.response_rows], entropy_all[layout.response_rows]

    response_lengths = list(batch["response_lengths"])
    n_whole = sum(response_lengths)
    old_list = batch["rollout_log_probs"] if getattr(args, "use_rollout_logprobs", False) else batch.get("log_probs")
    old = torch.cat(old_list).float() if old_list else logp.detach()
    train_old = torch.cat(batch["log_probs"]).float() if batch.get("log_probs") else logp.detach()
    whole_logp = _whole_responses(logp, layout, n_whole, cp_group)
    whole_old = _whole_responses(old, layout, n_whole, cp_group)
    whole_mask = torch.cat(batch["loss_masks"]).to(device).float()
    advantages = torch.cat(batch["advantages"]).float()
    whole_advantages = _whole_responses(advantages, layout, n_whole, None)
    cu_seqlens = torch.tensor([0] + response_lengths, device=device).cumsum(0)
    gspo = getattr(args, "advantage_estimator", "gspo") == "gspo"

    report = {}
    with torch.no_grad():
        sequence_kl = _sequence_kl(whole_old, whole_logp, whole_mask, response_lengths)
        local_lengths = torch.as_tensor(layout.local_lengths, device=device)
        ppo_kl = torch.repeat_interleave(sequence_kl, local_lengths) if gspo else old - logp.detach()
        weights = _reducer_weights(sum_of_sample_mean, logp.numel(), device)
        if getattr(args, "use_opsm", False):
            whole = SimpleNamespace(cu_seqlens=cu_seqlens, mask=whole_mask != 0, logp=whole_logp.detach(),
                                    old=whole_old, advantages=whole_advantages)
            masked = _off_policy_sequences(args, whole, layout)
            counts = torch.stack([m.sum() for m in batch["loss_masks"]]).to(device).clamp_min(1)
            report["opsm_clipfrac"] = (torch.stack([part.sum() for part in masked.split(layout.local_lengths)])
                                       / counts).sum()
            weights = weights * (1 - masked)
        if getattr(args, "use_tis", False) or getattr(args, "get_mismatch_metrics", False):
            report["ois"] = sum_of_sample_mean(torch.exp(-ppo_kl))
            weights = weights * _tis(args, batch, train_old, report, sum_of_sample_mean)

    pg_loss, _ = policy_loss(
        whole_logp, whole_old, whole_advantages, mask=whole_mask != 0, cu_seqlens=cu_seqlens,
        token_weights=_whole_responses(weights, layout, n_whole, None), level="sequence" if gspo else "token",
        eps_low=args.eps_clip, eps_high=args.eps_clip_high, clip_ratio_c=getattr(args, "eps_clip_c", None),
        loss_agg="token-sum", normalizer=1.0)

    entropy_loss = sum_of_sample_mean(entropy)
    loss = pg_loss - args.entropy_coef * entropy_loss
    with torch.no_grad():
        ratio = torch.exp(-ppo_kl)
        clipped = ratio.clamp(1 - args.eps_clip, 1 + args.eps_clip_high)
        report.update(pg_loss=pg_loss.detach(), entropy_loss=entropy_loss.detach(),
                      pg_clipfrac=sum_of_sample_mean(((-clipped * advantages) > (-ratio * advantages)).float()),
                      ppo_kl=sum_of_sample_mean(ppo_kl))
        if batch.get("rollout_log_probs"):
            compare = logp.detach() if getattr(args, "use_rollout_logprobs", False) else old
            report["train_rollout_logprob_abs_diff"] = sum_of_sample_mean(
                (compare - torch.cat(batch["rollout_log_probs"]).float()).abs())
    if getattr(args, "use_kl_loss", False):
        ref = torch.cat(batch["ref_log_probs"]).float()
        importance = torch.exp(logp - old) if getattr(args, "use_unbiased_kl", False) else None
        kl_loss = sum_of_sample_mean(_approx_kl(logp, ref, args.kl_loss_type, importance))
        loss = loss + args.kl_loss_coef * kl_loss
        report["kl_loss"] = kl_loss.detach()
    report["loss"] = loss.detach()
    return loss, report
