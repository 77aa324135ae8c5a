"""slime's GSPO policy loss written out in float64 on the whole logits, and slime's batch, for
the slime contract tests (slime/backends/megatron_utils/loss.py policy_loss_function with
vanilla_tis_function; slime/utils/ppo_utils.py compute_gspo_kl, compute_opsm_mask,
compute_policy_loss, compute_approx_kl; cp_utils.py get_sum_of_sample_mean and
get_logits_and_tokens_offset_with_cp; THUDM/slime 624b824). slime is not on PyPI, so these are
read from its source; the function under test never sees this module."""

from __future__ import annotations

from argparse import Namespace

import torch

V = 20
# four samples of prompt + response, packed; at context parallel size 2 the first three put
# all their response tokens on rank 1, the fourth some on each rank.
TOTALS, RESPONSES = [9, 6, 7, 16], [5, 3, 4, 14]
ADVANTAGES = (0.8, -0.6, 0.3, -0.2)


def slime_args(**over):
    base = dict(eps_clip=0.01, eps_clip_high=0.02, eps_clip_c=None, entropy_coef=0.0, use_kl_loss=False,
                kl_loss_coef=0.0, kl_loss_type="low_var_kl", use_unbiased_kl=False, advantage_estimator="gspo",
                rollout_top_p=1.0, use_rollout_logprobs=False, use_tis=False, get_mismatch_metrics=False,
                tis_clip=1.02, tis_clip_low=0.99, custom_tis_function_path=None, use_opsm=False, opsm_delta=0.01,
                custom_pg_loss_reducer_function_path=None, rollout_temperature=1.0, allgather_cp=False)
    return Namespace(**{**base, **over})


def whole_problem(seed: int = 5, pad: int = 2):
    """(batch with whole per-sample lists, whole packed logits [sum(TOTALS) + pad, V]): old,
    reference and rollout log-probs near the logits' own, so that some samples clip."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, V, (n,), generator=gen) for n in TOTALS]
    masks = [(torch.rand(r, generator=gen) > 0.2).float() for r in RESPONSES]
    for m in masks:
        m[0] = 1.0
    batch = {"unconcat_tokens": tokens, "total_lengths": list(TOTALS), "response_lengths": list(RESPONSES),
             "loss_masks": masks, "advantages": [torch.full((r,), a) for r, a in zip(RESPONSES, ADVANTAGES)]}
    logits = 2 * torch.randn(sum(TOTALS) + pad, V, generator=gen)
    lps, _ = response_logp_and_entropy(logits.double(), tokens)
    for key, noise in (("log_probs", 0.04), ("ref_log_probs", 0.1), ("rollout_log_probs", 0.02)):
        batch[key] = [(lp + noise * torch.randn(lp.shape, generator=gen, dtype=torch.float64)).float() for lp in lps]
    return batch, logits


def response_logp_and_entropy(logits64, tokens):
    """Per-sample response log-probs and entropies from whole packed `[T, V]` logits."""
    logp_all = torch.log_softmax(logits64, -1)
    entropy_all = -(logp_all.exp() * logp_all).sum(-1)
    lps, ents, offset = [], [], 0
    for ids, total, response in zip(tokens, TOTALS, RESPONSES):
        rows = torch.arange(offset + total - 1 - response, offset + total - 1)
        lps.append(logp_all[rows, ids[total - response:total]])
        ents.append(entropy_all[rows])
        offset += total
    return lps, ents


def reducer(masks, denoms=None, lengths=None):
    """slime's sum_of_sample_mean: per sample the masked sum of its (local) tokens over its
    denominator (its whole mask's sum unless given). lengths/masks: each sample's local part."""
    denoms = [m.sum() for m in masks] if denoms is None else denoms
    lengths = RESPONSES if lengths is None else lengths

    def sum_of_sample_mean(x):
        parts = x.split(lengths, dim=0)
        return sum((p * m.to(p.dtype)).sum() / torch.clamp_min(d.to(p.dtype), 1) for p, m, d in zip(parts, masks, denoms))

    return sum_of_sample_mean


def cp_response_index(total: int, response: int, rank: int, cp: int):
    """(this rank's local logits rows of the sample in its slice_with_cp layout, the response
    token indices they predict), from slime's get_logits_and_tokens_offset_with_cp."""
    prompt = total - response
    chunk = (total + 2 * cp - 1) // (2 * cp)
    chunks = ((rank * chunk, (rank + 1) * chunk), ((2 * cp - rank - 1) * chunk, (2 * cp - rank) * chunk))
    rows, index = [], []
    for slot, (start, end) in enumerate(chunks):
        lo, hi = max(start, prompt - 1), min(end, total - 1)
        for p in range(lo, hi):
            rows.append(slot * chunk + p - start)
            index.append(p - (prompt - 1))
    return rows, index


def slime_loss(args, batch, logits64, reduce):
    """(loss, metrics) of slime's policy_loss_function at context parallel size 1, float64."""
    lps, ents = response_logp_and_entropy(logits64, batch["unconcat_tokens"])
    old_key = "rollout_log_probs" if args.use_rollout_logprobs else "log_probs"
    olds = [o.double() for o in batch[old_key]]
    masks = batch["loss_masks"]
    kl_seq = [((o - lp) * m).sum() / torch.clamp_min(m.sum(), 1) for lp, o, m in zip(lps, olds, masks)]
    adv = torch.cat(batch["advantages"]).double()
    if args.advantage_estimator == "gspo":
        ppo_kl = torch.cat([k.expand_as(lp) for k, lp in zip(kl_seq, lps)])
    else:
        ppo_kl = torch.cat(olds) - torch.cat(lps)
    ratio = torch.exp(-ppo_kl)
    pg1, pg2 = -ratio * adv, -ratio.clamp(1 - args.eps_clip, 1 + args.eps_clip_high) * adv
    pg = torch.maximum(pg1, pg2)
    if args.eps_clip_c is not None:
        pg = torch.where(adv < 0, torch.minimum(-args.eps_clip_c * adv, pg), pg)
    metrics = {}
    if args.use_opsm:
        opsm = [((a < 0) & (k.detach() > args.opsm_delta)).double()
                for a, k in zip(batch["advantages"], kl_seq)]
        metrics["opsm_clipfrac"] = sum(o.sum() / torch.clamp_min(m.sum(), 1) for o, m in zip(opsm, masks))
        pg = pg * (1 - torch.cat(opsm))
    if args.use_tis or args.get_mismatch_metrics:
        metrics["ois"] = reduce(torch.exp(-ppo_kl.detach()))
        tis = torch.exp(torch.cat(batch["log_probs"]).double() - torch.cat(batch["rollout_log_probs"]).double())
        weights = tis.clamp(args.tis_clip_low, args.tis_clip)
        metrics.update(tis=reduce(tis), tis_clipfrac=reduce((weights != tis).double()), tis_abs=reduce((tis - 1).abs()))
        pg = pg * weights
    metrics["pg_loss"] = reduce(pg)
    metrics["entropy_loss"] = reduce(torch.cat(ents))
    loss = metrics["pg_loss"] - args.entropy_coef * metrics["entropy_loss"]
    if args.use_kl_loss:
        log_ratio = torch.cat(lps) - torch.cat(batch["ref_log_probs"]).double()
        kl = (torch.expm1(-log_ratio) + log_ratio).clamp(-10, 10)  # low_var_kl
        metrics["kl_loss"] = reduce(kl)
        loss = loss + args.kl_loss_coef * metrics["kl_loss"]
    metrics["pg_clipfrac"] = reduce(torch.gt(pg2, pg1).double())
    metrics["ppo_kl"] = reduce(ppo_kl)
    compare = torch.cat(lps) if args.use_rollout_logprobs else torch.cat(olds)
    metrics["train_rollout_logprob_abs_diff"] = reduce((compare - torch.cat(batch["rollout_log_probs"]).double()).abs())
    metrics["loss"] = loss
    return loss, {k: float(v) for k, v in metrics.items()}
