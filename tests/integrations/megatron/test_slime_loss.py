"""gspo_kernels.integrations.megatron.slime.gspo_loss_function under slime's custom-loss contract.

slime is not on PyPI and cannot be installed here, so the test builds slime's batch (per-sample
lists: unconcat_tokens, total_lengths, response_lengths, loss_masks, advantages, log_probs,
ref_log_probs) and calls the function exactly as slime's loss_function does,
`func(args, batch, logits, sum_of_sample_mean)` with `logits` this rank's `[1, T, V/tp]` float32
shard (slime/backends/megatron_utils/loss.py at THUDM/slime 624b824). The expected values are
slime's own formulas for its GSPO policy loss (policy_loss_function with compute_gspo_kl,
compute_policy_loss, compute_approx_kl, and cp_utils.get_sum_of_sample_mean at context parallel
size 1), written out here in float64 on the whole logits. Two gloo processes, megatron-core's
tensor-parallel groups of 2.
"""

from __future__ import annotations

from argparse import Namespace

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_world import megatron_worker  # noqa: E402
from trainer_world import run  # noqa: E402

V, TP = 20, 2
TOTALS, RESPONSES = [9, 6, 7], [5, 3, 4]  # three samples of prompt + response, packed
PAD = 2  # slime pads the packed rows (to a multiple of the TP size and more)


def _batch(gen):
    tokens = [torch.randint(0, V, (n,), generator=gen) for n in TOTALS]
    masks = [(torch.rand(r, generator=gen) > 0.2).float() for r in RESPONSES]
    for m in masks:
        m[0] = 1.0
    advantages = [torch.full((r,), a) for r, a in zip(RESPONSES, (0.8, -0.6, 0.3))]
    return {"unconcat_tokens": tokens, "total_lengths": list(TOTALS), "response_lengths": list(RESPONSES),
            "loss_masks": masks, "advantages": advantages}


def _slime_reducer(masks, denoms=None):
    """slime's get_sum_of_sample_mean at context parallel size 1: sum over samples of the masked
    sum over its tokens, divided by its denominator (its mask's sum unless given)."""
    denoms = [m.sum() for m in masks] if denoms is None else denoms

    def sum_of_sample_mean(x):
        parts = x.split(RESPONSES, dim=0)
        return sum((p * m.to(p.dtype)).sum() / torch.clamp_min(d.to(p.dtype), 1) for p, m, d in zip(parts, masks, denoms))

    return sum_of_sample_mean


def _response_logp_and_entropy(logits64, tokens):
    """Per-sample response log-probs and entropies from whole `[T, V]` logits, as slime slices them."""
    logp_all = torch.log_softmax(logits64, -1)
    entropy_all = -(logp_all.exp() * logp_all).sum(-1)
    lps, ents, offset = [], [], 0
    for ids, total, response in zip(tokens, TOTALS, RESPONSES):
        end = offset + total - 1
        rows = torch.arange(end - response, end)
        lps.append(logp_all[rows, ids[total - response:total]])
        ents.append(entropy_all[rows])
        offset += total
    return lps, ents


def _slime_gspo(args, batch, logits64, reducer):
    """slime's policy loss for advantage_estimator='gspo' at context parallel size 1."""
    lps, ents = _response_logp_and_entropy(logits64, batch["unconcat_tokens"])
    olds = [o.double() for o in batch["log_probs"]]
    kl_seq = [((o - lp) * m).sum() / torch.clamp_min(m.sum(), 1) for lp, o, m in zip(lps, olds, batch["loss_masks"])]
    ppo_kl = torch.cat([k.expand_as(lp) for k, lp in zip(kl_seq, lps)])
    adv = torch.cat(batch["advantages"]).double()
    ratio = torch.exp(-ppo_kl)
    pg1, pg2 = -ratio * adv, -ratio.clamp(1 - args.eps_clip, 1 + args.eps_clip_high) * adv
    pg = reducer(torch.maximum(pg1, pg2))
    loss = pg - args.entropy_coef * reducer(torch.cat(ents))
    if args.use_kl_loss:
        log_ratio = -(torch.cat(lps) - torch.cat(batch["ref_log_probs"]).double())
        kl = (log_ratio.exp() - 1 - log_ratio).clamp(-10, 10)  # low_var_kl
        loss = loss + args.kl_loss_coef * reducer(kl)
    return loss, reducer(torch.gt(pg2, pg1).double())


def _args(**over):
    base = dict(eps_clip=0.01, eps_clip_high=0.02, entropy_coef=0.0, use_kl_loss=False, kl_loss_coef=0.0,
                kl_loss_type="low_var_kl", advantage_estimator="gspo", rollout_top_p=1.0, use_rollout_logprobs=False,
                use_tis=False, get_mismatch_metrics=False, use_opsm=False, custom_pg_loss_reducer_function_path=None,
                rollout_temperature=1.0)
    return Namespace(**{**base, **over})


CASES = {
    "plain": (_args(), False),
    "entropy_and_kl": (_args(entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.05), False),
    "rollout_denominators": (_args(), True),
}


def _slime_checks(rank):
    from gspo_kernels.integrations.megatron.slime import gspo_loss_function

    found = {}
    for name, (args, group_denoms) in CASES.items():
        gen = torch.Generator().manual_seed(5)
        batch = _batch(gen)
        rows = sum(TOTALS) + PAD
        whole = 2 * torch.randn(rows, V, generator=gen)
        lps, _ = _response_logp_and_entropy(whole.double(), batch["unconcat_tokens"])
        batch["log_probs"] = [(lp + 0.04 * torch.randn(lp.shape, generator=gen, dtype=torch.float64)).float()
                              for lp in lps]
        batch["ref_log_probs"] = [(lp + 0.1 * torch.randn(lp.shape, generator=gen, dtype=torch.float64)).float()
                                  for lp in lps]
        # slime's per-rollout denominators: samples 0 and 1 one rollout group, sample 2 another.
        denoms = None
        if group_denoms:
            sums = [m.sum() for m in batch["loss_masks"]]
            denoms = [sums[0] + sums[1], sums[0] + sums[1], sums[2]]
        whole64 = whole.double().requires_grad_()
        want, want_clipfrac = _slime_gspo(args, batch, whole64, _slime_reducer(batch["loss_masks"], denoms))
        want.backward()
        width = V // TP
        shard = whole[None, :, rank * width:(rank + 1) * width].clone().requires_grad_()
        loss, report = gspo_loss_function(args, batch, shard, _slime_reducer(batch["loss_masks"], denoms))
        loss.backward()
        grad_want = whole64.grad[None, :, rank * width:(rank + 1) * width]
        found[name] = {
            "loss": float((loss.double() - want).abs() / want.abs()),
            "grad": float((shard.grad.double() - grad_want).norm() / grad_want.norm()),
            "clipfrac": abs(float(report["pg_clipfrac"]) - float(want_clipfrac)),
            "want_clipfrac": float(want_clipfrac),
            "report_loss": abs(float(report["loss"]) - float(loss)),
            "keys": sorted(report),
        }
    try:
        gspo_loss_function(_args(use_tis=True), _batch(torch.Generator().manual_seed(1)),
                           torch.zeros(1, sum(TOTALS), V // TP), _slime_reducer([torch.ones(r) for r in RESPONSES]))
        found["refused"] = "no error"
    except NotImplementedError as exc:
        found["refused"] = str(exc)
    return found


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run(megatron_worker, TP, tmp_path_factory.mktemp("slime"), TP, TP, _slime_checks)


@pytest.mark.parametrize("case", list(CASES))
def test_slime_contract_gives_slimes_gspo_loss_and_gradient(results, case):
    found = results[case]
    assert found["loss"] <= 1e-5 and found["grad"] <= 1e-5, found
    # slime's pg_clipfrac is a sum of per-sample means: some samples clip, not all.
    assert found["clipfrac"] <= 1e-6 and 0.0 < found["want_clipfrac"] < len(TOTALS) - 1, found
    assert found["report_loss"] == 0.0
    want_keys = {"loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl"}
    assert set(found["keys"]) == want_keys | ({"kl_loss"} if case == "entropy_and_kl" else set())


def test_unsupported_slime_options_are_refused_by_name(results):
    assert "--use-tis" in results["refused"]
