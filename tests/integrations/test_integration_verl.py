"""The verl drop-in against verl's own code: each registered gk_* policy loss against verl's
loss of the same name (loss, gradient of log_prob, verl's metrics), over loss aggregations,
clip ranges, rollout weights and global-batch normalisation; and the fused actor forward
against the model's own logits."""

from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
verl_config = pytest.importorskip("verl.workers.config")
transformers = pytest.importorskip("transformers")

import gspo_kernels.integrations.verl as gk_verl  # noqa: E402
from gspo_kernels.testing.tiny import tiny_llama  # noqa: E402

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")


def _actor_config(**overrides):
    base = verl_config.FSDPActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=2, ppo_mini_batch_size=4,
                                       use_dynamic_bsz=False, rollout_n=2, clip_ratio=0.2)
    return dataclasses.replace(base, **overrides)


def _batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rows, length = 6, 9
    mask = (torch.arange(length) < torch.tensor([9, 4, 0, 7, 1, 9])[:, None]).float()  # row 2 empty
    log_prob = -torch.rand(rows, length, generator=gen) * 4
    old = log_prob + torch.randn(rows, length, generator=gen) * 0.15
    old[1] += 0.3  # whole sequences off to both sides: sequence ratios clip too
    old[3] -= 0.3
    advantages = torch.randn(rows, 1, generator=gen).expand(rows, length).contiguous()
    weights = torch.exp(torch.randn(rows, length, generator=gen) * 0.1)
    return log_prob, old, advantages, mask, weights


def _run(name, config, agg, with_weights):
    log_prob, old, advantages, mask, weights = _batch()
    log_prob = log_prob.clone().requires_grad_()
    loss, metrics = core_algos.get_policy_loss_fn(name)(old, log_prob, advantages, mask, agg, config,
                                                        weights if with_weights else None)
    loss.backward()
    return loss.detach(), log_prob.grad, metrics


CASES = [dict(mode=mode, agg=agg, weights=w, clip=clip, info=info)
         for mode, agg, w, clip, info in itertools.product(
             ("vanilla", "gspo", "sapo", "cispo"), AGGS, (False, True), ("symmetric", "asymmetric", "dual"),
             ("local", "global"))]
CLIPS = {"symmetric": dict(clip_ratio_low=0.05, clip_ratio_high=0.05), "asymmetric": dict(clip_ratio_low=0.05, clip_ratio_high=0.08),
         "dual": dict(clip_ratio_low=0.05, clip_ratio_high=0.05, clip_ratio_c=1.05)}  # dual: verl's dual clip acts on the A < 0 rows


def _case_id(case):
    return "-".join(str(v) for v in case.values())


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_policy_loss_matches_verl(case):
    config = _actor_config(**CLIPS[case["clip"]])
    if case["info"] == "global":  # as verl's actor sets it: this rank's share of a 2-rank batch
        config.global_batch_info.update(dp_size=2, batch_num_tokens=61, global_batch_size=11, loss_scale_factor=12)
    want_loss, want_grad, want_metrics = _run(case["mode"], config, case["agg"], case["weights"])
    loss, grad, metrics = _run(f"gk_{case['mode']}", config, case["agg"], case["weights"])
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5, abs=1e-7)
    assert torch.allclose(grad, want_grad, rtol=1e-4, atol=1e-7), float((grad - want_grad).abs().max())
    assert metrics.keys() == want_metrics.keys()
    for name in want_metrics:
        assert metrics[name] == pytest.approx(want_metrics[name], rel=1e-5, abs=1e-7), name


def test_the_batch_clips_both_ways():
    """The grid would prove little if nothing clipped: each clip setting of the grid clips here,
    at token and sequence level, and the dual clip acts."""
    for clip, options in CLIPS.items():
        for mode in ("vanilla", "gspo", "cispo"):
            _, _, metrics = _run(mode, _actor_config(**options), "token-mean", False)
            assert 0 < metrics["actor/pg_clipfrac"] < 1, (clip, mode)
    _, _, metrics = _run("vanilla", _actor_config(**CLIPS["dual"]), "token-mean", False)
    assert metrics["actor/pg_clipfrac_lower"] > 0


def test_settings_we_refuse_fall_back_to_verl_with_a_warning():
    config = _actor_config(clip_ratio_low=1.0, clip_ratio_high=0.3)  # CISPO with no lower bound
    gk_verl._warned.clear()
    with pytest.warns(UserWarning, match="gspo_kernels: gk_cispo"):
        got = _run("gk_cispo", config, "token-mean", True)
    want = _run("cispo", config, "token-mean", True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_external_modules_env_registers_in_a_fresh_process():
    import os
    import subprocess
    import sys

    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES="gspo_kernels.integrations.verl")
    code = "import verl; from verl.trainer.ppo.core_algos import get_policy_loss_fn; get_policy_loss_fn('gk_gspo')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_registered_names():
    for name in ("gk_vanilla", "gk_gspo", "gk_sapo", "gk_cispo"):
        assert core_algos.get_policy_loss_fn(name) is gk_verl.POLICY_LOSSES[name]


def test_fused_forward_packed_shift_labels_and_gradients():
    """verl's padding-free layout: one (1, nnz) row with pre-shifted labels; gradients of a mix
    of log-probs and entropies against the model's own float64 logits."""
    from verl.models.transformers import monkey_patch

    model = tiny_llama(vocab=64)
    reference = copy.deepcopy(model).double()
    ids = torch.randint(0, 60, (1, 11))
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3]])  # three packed sequences
    shift = torch.roll(ids, -1, -1)
    weights = torch.linspace(0.5, 1.5, 11, dtype=torch.float64)
    logits = reference(input_ids=ids, position_ids=position_ids).logits / 0.9
    logp = torch.log_softmax(logits, -1)
    want_logp = logp.gather(-1, shift[..., None]).squeeze(-1)
    want_entropy = -(logp.exp() * logp).sum(-1)
    ((want_logp * weights).sum() + 0.3 * want_entropy.sum()).backward()
    original = type(model).forward
    try:
        monkey_patch.patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="gspo_kernels")
        out = model(input_ids=ids, position_ids=position_ids, shift_labels=shift, temperature=0.9, return_dict=True)
        ((out.log_probs.double() * weights).sum() + 0.3 * out.entropy.double().sum()).backward()
    finally:
        type(model).forward = original
    assert torch.allclose(out.log_probs.double(), want_logp, atol=2e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.allclose(p.grad.double(), q.grad, rtol=1e-3, atol=1e-5), name


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_forward_matches_the_logits(temperature):
    from verl.models.transformers import monkey_patch

    model = tiny_llama(vocab=64)
    ids = torch.randint(0, 60, (3, 7))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.double() / temperature
    want = torch.log_softmax(logits, -1).gather(-1, torch.roll(ids, -1, -1)[..., None]).squeeze(-1)
    want_entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    original = type(model).forward
    try:
        monkey_patch.patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="gspo_kernels")
        assert type(model).forward is gk_verl.forward_with_gspo_kernels
        out = model(input_ids=ids, temperature=temperature, return_dict=True)
        out.log_probs.sum().backward()  # differentiable down to the lm_head
        assert model.lm_head.weight.grad is not None
    finally:
        type(model).forward = original
    assert torch.allclose(out.log_probs.double(), want, atol=2e-5)
    assert torch.allclose(out.entropy.double(), want_entropy, atol=2e-5)


def test_other_backends_stay_verls():
    from verl.models.transformers import monkey_patch

    model = tiny_llama(vocab=64)
    original = type(model).forward
    try:
        monkey_patch.patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="torch")
        assert type(model).forward is not gk_verl.forward_with_gspo_kernels
    finally:
        type(model).forward = original


def test_fused_forward_refuses_a_lora_head():
    peft = pytest.importorskip("peft")
    from verl.models.transformers import monkey_patch

    config = peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"], lora_dropout=0.0)
    model = peft.get_peft_model(tiny_llama(vocab=64), config).base_model.model
    original = type(model).forward
    try:
        monkey_patch.patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="gspo_kernels")
        with pytest.raises(ValueError, match="lm_head.*target_modules"):
            model(input_ids=torch.randint(0, 60, (2, 5)), return_dict=True)
        # An adapter elsewhere is fine: the head is a plain Linear there.
        plain = peft.get_peft_model(tiny_llama(vocab=64), peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                                          lora_dropout=0.0)).base_model.model
        out = plain(input_ids=torch.randint(0, 60, (2, 5)), return_dict=True)
        assert out.log_probs.shape == (2, 5)
    finally:
        type(model).forward = original
