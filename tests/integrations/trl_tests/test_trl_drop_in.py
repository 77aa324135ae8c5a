"""The TRL drop-in against TRL's own GRPOTrainer, on the same batch and the same tiny random
model (two copies): loss (relative error < 1e-5 in fp32), every parameter gradient (< 1e-4)
and the metrics TRL logs, for each supported option combination; each fallback warns once and
gives TRL's own result. Plus one offline train() step through the drop-in, and the drop-in's
GRPOConfig.batch_invariant: it reaches the fused-linear call, and a sequence's log-probs are
then bitwise the same alone and in a batch."""

from __future__ import annotations

import copy
import itertools
import math
import warnings

import pytest

from conftest import import_installed
import torch

trl = import_installed("trl")
transformers = pytest.importorskip("transformers")

from gspo_kernels.integrations.trl import GRPOConfig, GRPOTrainer  # noqa: E402

from gspo_kernels.testing.verify import relative_error, relative_errors, worst  # noqa: E402
from gspo_kernels.testing.tiny import PAD, tiny_grpo_trainer, tiny_llama, tiny_transformed_logits_model  # noqa: E402,E501

ROWS, PROMPT, COMPLETION = 6, 4, 5


def _model():
    return tiny_llama()


def _qwen2():
    """A random Qwen2 (grouped-query attention, q/k/v biases) with tiny_llama's sizes and ids."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                      pad_token_id=PAD, eos_token_id=PAD + 1, bos_token_id=PAD + 3,
                                      tie_word_embeddings=False)
    return transformers.Qwen2ForCausalLM(config)


def _trainer(cls, model, tmp_path, completion=COMPLETION, **overrides):
    return tiny_grpo_trainer(cls, model, str(tmp_path), max_completion_length=completion, **overrides)


def _pair(base, tmp_path_factory):
    theirs = _trainer(trl.GRPOTrainer, copy.deepcopy(base), tmp_path_factory.mktemp("trl"))
    ours = _trainer(GRPOTrainer, copy.deepcopy(base), tmp_path_factory.mktemp("ours"))
    return theirs, ours


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    return _pair(_model(), tmp_path_factory)


@pytest.fixture(scope="module")
def qwen2_trainers(tmp_path_factory):
    return _pair(_qwen2(), tmp_path_factory)


def _batch(trainer) -> dict:
    """A generation batch as TRL's _generate_and_score_completions hands it over."""
    gen = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(0, 60, (ROWS, PROMPT), generator=gen)
    prompt_mask = torch.ones(ROWS, PROMPT, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding
    prompt_ids[0, :2] = PAD
    completion_ids = torch.randint(0, 60, (ROWS, COMPLETION), generator=gen)
    lengths = torch.tensor([5, 3, 0, 5, 1, 4])  # row 2: an empty completion (a masked truncation)
    completion_mask = (torch.arange(COMPLETION) < lengths[:, None]).long()
    completion_ids = torch.where(completion_mask.bool(), completion_ids, torch.full_like(completion_ids, PAD))
    with torch.no_grad():
        current, _, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([prompt_mask, completion_mask], 1), COMPLETION)

    def near(scale):
        return (current + scale * torch.randn(current.shape, generator=gen)) * completion_mask

    mask = completion_mask.float()
    # Whole sequences shifted too, so that sequence-level ratios leave the clip range both ways.
    # Row 5 far off-policy: its ratios pass delta (1.5) and both clip ranges.
    old = near(0.05) + torch.tensor([0.0, 0.05, 0.0, -0.05, 0.0, -0.6])[:, None] * completion_mask
    sampling = near(0.04)
    sampling[3, 1] = float("nan")  # a token the sampler could not score
    advantages = torch.randn(ROWS, generator=gen)
    advantages[5] = -0.8  # negative on the far off-policy row: the unclipped side, where delta caps
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": advantages,
            "num_items_in_batch": mask.sum(), "old_per_token_logps": old, "ref_per_token_logps": near(0.1),
            "sampling_per_token_logps": sampling}


def _is_ratio(trainer, batch) -> torch.Tensor:
    """TRL's importance_sampling_ratio for the trainer's mode (its formula, in the test)."""
    mask = batch["completion_mask"] * batch.get("tool_mask", 1)
    diff = torch.nan_to_num((batch["old_per_token_logps"] - batch["sampling_per_token_logps"]) * mask, nan=0.0)
    mode = trainer.vllm_importance_sampling_mode
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    low, high = trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max
    if mode.endswith("truncate"):
        return ratio.clamp(min=low, max=high)
    low = -math.inf if low is None else low
    high = math.inf if high is None else high
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def _configure(trainer, case: dict) -> None:
    trainer.loss_type = case["loss_type"]
    trainer.importance_sampling_level = case["level"]
    trainer.beta = case["beta"]
    trainer.epsilon_low, trainer.epsilon_high = 0.02, (1.03 if case["loss_type"] == "cispo" else 0.03)
    trainer.temperature = case.get("temperature", 1.0)
    trainer.top_entropy_quantile = case.get("top_entropy_quantile", 1.0)
    trainer.off_policy_mask_threshold = case.get("off_policy_mask_threshold")
    trainer.args.delta = case.get("delta")
    trainer.args.use_bias_correction_kl = case.get("use_bias_correction_kl", False)
    trainer.entropy_coef = case.get("entropy_coef", 0.0)
    trainer.use_adaptive_entropy = case.get("use_adaptive_entropy", False)
    trainer._entropy_bonus_enabled = trainer.entropy_coef != 0.0 or trainer.use_adaptive_entropy
    trainer._entropy_window_stats = None
    trainer._last_world_entropy = float("inf")
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = case.get("rollout") is not None
    if case.get("rollout") is not None:
        trainer.vllm_importance_sampling_mode = case["rollout"]
        trainer.vllm_importance_sampling_clip_min = 0.97 if case["rollout"].endswith("mask") else None
        trainer.vllm_importance_sampling_clip_max = 1.03
    # accumulation=n: TRL's gradient accumulation, the batch as n micro-batches of one generation
    # batch (steps_per_generation = n), their gradients summed (_run); without it one call at 2.
    trainer.current_gradient_accumulation_steps = case.get("accumulation", 2)
    trainer.args.steps_per_generation = case.get("accumulation", 1)
    trainer.model.train(not case.get("eval", False))
    for mode in ("train", "eval"):
        trainer._metrics[mode].clear()


def _run(trainer, batch, case):
    _configure(trainer, case)
    inputs = dict(batch)
    if case.get("tool_mask"):
        inputs["tool_mask"] = torch.ones_like(batch["completion_mask"])
        inputs["tool_mask"][1, 1] = 0
        inputs["tool_mask"][3, 2] = 0
    if case.get("rollout") is not None:
        inputs["importance_sampling_ratio"] = _is_ratio(trainer, inputs)
    else:  # as TRL hands it over without vLLM: no sampler log-probs
        del inputs["sampling_per_token_logps"]
    if case.get("on_policy"):  # TRL drops old log-probs when they equal the current ones
        del inputs["old_per_token_logps"]
    trainer.model.zero_grad(set_to_none=True)
    losses = []
    for rows in torch.arange(ROWS).chunk(case.get("accumulation", 1)):
        micro = {k: v[rows] if v.dim() and v.size(0) == ROWS else v for k, v in inputs.items()}
        losses.append(trainer._compute_loss(trainer.model, micro))
        losses[-1].backward()
    loss = torch.stack(losses).sum()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {f"{mode}/{k}": list(v) for mode in ("train", "eval") for k, v in trainer._metrics[mode].items()}
    return loss.detach(), grads, metrics


_rel = relative_error  # the sibling test files read it from here


def _compare(trainers, case):
    theirs, ours = trainers
    batch = _batch(theirs)
    want_loss, want_grads, want_metrics = _run(theirs, batch, case)
    loss, grads, metrics = _run(ours, batch, case)
    assert _rel(loss, want_loss) < 1e-5 or abs(float(loss - want_loss)) < 1e-8, (float(loss), float(want_loss))
    errors = relative_errors(grads, want_grads)  # every parameter, a zero reference gradient included
    assert worst(errors) < 1e-4, errors
    assert metrics.keys() == want_metrics.keys()
    for name in want_metrics:
        assert metrics[name] == pytest.approx(want_metrics[name], rel=1e-4, abs=1e-6), name


GRID = [dict(level=level, loss_type=loss_type, beta=beta, rollout=rollout)
        for level, loss_type, beta, rollout in itertools.product(
            ("token", "sequence"), ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo"), (0.0, 0.04),
            (None, "rollout"))]
ROLLOUT_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
for i, case in enumerate(GRID):
    if case["rollout"] is not None:
        case["rollout"] = ROLLOUT_MODES[i % len(ROLLOUT_MODES)]
EXTRAS = [
    dict(level="sequence", loss_type="grpo", beta=0.04, use_bias_correction_kl=True),
    dict(level="token", loss_type="dapo", beta=0.0, delta=1.5),
    dict(level="sequence", loss_type="bnpo", beta=0.0, top_entropy_quantile=0.5),
    dict(level="token", loss_type="grpo", beta=0.0, off_policy_mask_threshold=0.001, rollout="token_truncate"),
    dict(level="sequence", loss_type="grpo", beta=0.0, tool_mask=True),
    dict(level="token", loss_type="grpo", beta=0.04, tool_mask=True, rollout="sequence_mask"),
    dict(level="sequence", loss_type="dapo", beta=0.04, eval=True),
    dict(level="sequence", loss_type="grpo", beta=0.0, eval=True, entropy_coef=0.01),
    dict(level="token", loss_type="bnpo", beta=0.04, on_policy=True),
    dict(level="sequence", loss_type="grpo", beta=0.0, off_policy_mask_threshold=0.001),
    dict(level="sequence", loss_type="grpo", beta=0.0, delta=1.5),
    dict(level="sequence", loss_type="grpo", beta=0.0, entropy_coef=0.01),
    dict(level="token", loss_type="dapo", beta=0.04, entropy_coef=0.02, top_entropy_quantile=0.5),
    dict(level="sequence", loss_type="bnpo", beta=0.0, entropy_coef=-0.01),
    dict(level="token", loss_type="vespo", beta=0.0),
    dict(level="token", loss_type="vespo", beta=0.04, entropy_coef=0.01),
    dict(level="token", loss_type="vespo", beta=0.0, eval=True, off_policy_mask_threshold=0.001),
]


def _case_id(case):
    return "-".join(f"{k}={v}" for k, v in case.items() if v not in (None, False))


@pytest.mark.parametrize("case", GRID + EXTRAS, ids=_case_id)
def test_drop_in_matches_trl(trainers, case):
    _compare(trainers, case)


# VESPO's weight is the sequence's product ratio at either level, but the KL's bias correction
# (TRL's default use_bias_correction_kl) multiplies by importance_sampling_level's ratio: each
# token's at "token". A drop-in that ran "token" as level="sequence" would match TRL's loss to
# ~1e-6 on these cases and miss its gradients by up to 1.3e-3 relative (TRL 1.16, tiny Llama and
# Qwen2, float32, CPU): the gradients are what these cases check; sequence level is the control.
VESPO_KL_CASES = [dict(level=level, loss_type="vespo", beta=beta, use_bias_correction_kl=True, accumulation=steps)
                  for level, beta, steps in [("token", 0.04, 1), ("token", 0.04, 2), ("token", 0.1, 1),
                                             ("token", 0.1, 2), ("sequence", 0.04, 2)]]


@pytest.mark.parametrize("model", ["llama", "qwen2"])
@pytest.mark.parametrize("case", VESPO_KL_CASES, ids=_case_id)
def test_vespo_kl_correction_follows_the_level(request, model, case):
    _compare(request.getfixturevalue("trainers" if model == "llama" else "qwen2_trainers"), case)


def test_temperature_matches_trl(tmp_path):
    # TRL binds the temperature into the model's fused head when the trainer is built.
    base = _model()
    pair = tuple(_trainer(cls, copy.deepcopy(base), tmp_path / cls.__module__, temperature=0.7)
                 for cls in (trl.GRPOTrainer, GRPOTrainer))
    _compare(pair, dict(level="sequence", loss_type="dr_grpo", beta=0.04, temperature=0.7))


@pytest.mark.parametrize("case", [dict(level="token", loss_type="vespo", beta=0.0, rollout="token_truncate"),
                                  dict(level="sequence", loss_type="grpo", beta=0.0, entropy_coef=0.01,
                                       use_adaptive_entropy=True)],
                         ids=_case_id)
def test_fallback_warns_once_and_matches_trl(trainers, case):
    theirs, ours = trainers
    ours._gspo_warned.clear()
    batch = _batch(theirs)
    with pytest.warns(UserWarning, match="gspo_kernels: .* not supported"):
        _compare(trainers, case)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the second call stays quiet
        _run(ours, batch, case)


def test_no_grad_log_probs_match_trl(trainers):
    """The old/reference log-prob pass (chunked by batch_size, left padding) against TRL's."""
    theirs, ours = trainers
    batch = _batch(theirs)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        want = trl.GRPOTrainer._get_per_token_logps_and_entropies(theirs, theirs.model, ids, attention, COMPLETION,
                                                                  batch_size=4, compute_entropy=True)
        got = ours._get_per_token_logps_and_entropies(ours.model, ids, attention, COMPLETION, batch_size=4,
                                                      compute_entropy=True)
    for name, a, b in zip(("log-probs", "entropies"), got[:2], want[:2]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (name, float((a - b).abs().max()))


def test_train_step_offline(tmp_path):
    """A whole train() step, generation included, through the drop-in, with no fallback."""
    trainer = _trainer(GRPOTrainer, _model(), tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in caught if str(w.message).startswith("gspo_kernels:")]
    logged = trainer.state.log_history[0]
    assert math.isfinite(logged["loss"]) and "entropy" in logged and "clip_ratio/region_mean" in logged


# --- batch_invariant: the drop-in's GRPOConfig field ------------------------------------------

# 7 completion tokens: a sequence alone gives the lm_head product 7 rows, a batch of 5 gives it
# 35, shapes for which this CPU's matmul picks different kernels (a 2-core AVX2 EPYC, torch
# 2.14.1: the default path then gave the row other bits, see the last test).
INVARIANT_COMPLETION = 7


def _spy_on_the_fused_call(monkeypatch) -> list:
    """The `linear` of every fused-linear call the drop-in makes (head.py calls it)."""
    from gspo_kernels.integrations import head

    seen, plain = [], head.fused_linear_selective_log_softmax

    def spy(*args, linear=None, **kwargs):
        seen.append(linear)
        return plain(*args, linear=linear, **kwargs)

    monkeypatch.setattr(head, "fused_linear_selective_log_softmax", spy)
    return seen


def test_batch_invariant_reaches_the_fused_linear_call(trainers, tmp_path, monkeypatch):
    """GRPOConfig.batch_invariant reaches LinearConfig in the loss and in the no-grad log-prob
    pass; TRL's own GRPOConfig (no such field) reads as False; a bad value fails when the
    trainer is built."""
    theirs, ours = trainers
    seen = _spy_on_the_fused_call(monkeypatch)
    batch = _batch(theirs)
    case = dict(level="sequence", loss_type="grpo", beta=0.04)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    _run(ours, batch, case)
    assert [linear.batch_invariant for linear in seen] == [False]
    invariant = _trainer(GRPOTrainer, _model(), tmp_path / "invariant", config_cls=GRPOConfig, batch_invariant=True)
    seen.clear()
    _run(invariant, batch, case)
    with torch.no_grad():
        invariant._get_per_token_logps_and_entropies(invariant.model, ids, attention, COMPLETION, batch_size=4)
    assert [linear.batch_invariant for linear in seen] == [True, True, True]  # the loss, then two chunks of rows
    with pytest.raises(TypeError, match="GRPOConfig.batch_invariant must be True or False; got 'yes'"):
        _trainer(GRPOTrainer, _model(), tmp_path / "bad", config_cls=GRPOConfig, batch_invariant="yes")


@pytest.fixture(scope="module")
def invariant_trainer(tmp_path_factory):
    """The drop-in with batch_invariant=True on a Llama with no decoder layer. The model body is
    the user's (docs/fused_linear.md): its matmuls give a row other bits in another batch on this
    CPU (a 2-layer Llama did). With none, the body (embedding, final norm) works row by row, so a
    row's hidden states are the same in any batch (checked below), and what is tested is the
    drop-in's part: slicing the completion's hidden states, calling the head, the fused-linear call.
    Temperature 0.7: at 1.0 the default path's logits of these sequences differed alone and in the
    batch too, but every log-prob and entropy rounded to the same bits (cpu backend), so the last
    test would have had nothing to show."""
    return _trainer(GRPOTrainer, tiny_llama(layers=0), tmp_path_factory.mktemp("invariant"),
                    completion=INVARIANT_COMPLETION, config_cls=GRPOConfig, batch_invariant=True, temperature=0.7)


def _alone_and_in_a_batch(trainer):
    """For each of 5 sequences (different prompts and completions, left padding, a completion 3
    tokens short): its (log-probs, entropies) alone and inside the batch of 5, from the drop-in's
    no-grad log-prob pass (the old and reference policies' log-probs), and the body's hidden
    states both ways."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 60, (5, PROMPT + INVARIANT_COMPLETION), generator=gen)
    attention = torch.ones_like(ids)
    attention[0, :2] = attention[2, :1] = attention[3, :3] = 0  # left padding
    attention[4, -3:] = 0  # a completion 3 tokens short
    ids = ids.masked_fill(attention == 0, PAD)

    def run(rows):
        logp, entropy, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids[rows], attention[rows], INVARIANT_COMPLETION, compute_entropy=True)
        hidden = trainer.model.model(input_ids=ids[rows], attention_mask=attention[rows]).last_hidden_state
        return logp, entropy, hidden

    with torch.no_grad():
        batch = run(slice(0, 5))
        return [(run(slice(i, i + 1)), tuple(t[i:i + 1] for t in batch)) for i in range(5)]


def _differing(pairs) -> list[str]:
    """What differs in bits between a sequence alone and in the batch: (sequence, output)."""
    return [f"sequence {i}: {name}" for i, (alone, in_batch) in enumerate(pairs)
            for name, a, b in zip(("log-probs", "entropies"), alone[:2], in_batch[:2]) if not torch.equal(a, b)]


def test_batch_invariant_log_probs_alone_equal_in_a_batch(invariant_trainer):
    pairs = _alone_and_in_a_batch(invariant_trainer)
    for alone, in_batch in pairs:  # the body's part: the same input to the head
        assert torch.equal(alone[2], in_batch[2])
    assert not _differing(pairs)


def test_without_batch_invariant_the_log_probs_can_differ(invariant_trainer, row_count_products):
    """The check above can fail, on every machine: with a logits product whose sum over H is split
    where the row count says (tests/conftest.py; a BLAS picks its split-K by shape, and on some
    CPUs the default path's 7-row and 35-row products already differ), the default path gives
    some sequences other bits alone than in the batch, and the comparison sees it; with
    batch_invariant the same product leaves every sequence's bits alone."""
    invariant_trainer.args.batch_invariant = False  # read at every call, as TRL's options are
    try:
        pairs = _alone_and_in_a_batch(invariant_trainer)
    finally:
        invariant_trainer.args.batch_invariant = True
    for alone, in_batch in pairs:
        assert torch.equal(alone[2], in_batch[2])
    assert _differing(pairs)
    assert not _differing(_alone_and_in_a_batch(invariant_trainer))


@pytest.mark.parametrize("kind", ["cohere", "granite", "gemma2"])
def test_transformed_logits_run_fused_and_match_trl(tmp_path, kind):
    # The model's own multiplier or soft-cap reaches the kernels (model_logits.py): no fallback,
    # TRL's result.
    base = tiny_transformed_logits_model(kind)
    pair = tuple(_trainer(cls, copy.deepcopy(base), tmp_path / cls.__module__, temperature=0.7)
                 for cls in (trl.GRPOTrainer, GRPOTrainer))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a fallback would warn
        _compare(pair, dict(level="sequence", loss_type="grpo", beta=0.04, temperature=0.7))
    assert not pair[1]._gspo_in_fallback


@pytest.mark.parametrize("kind, attribute, plain", [("cohere", "logit_scale", 1.0),
                                                    ("gemma2", "final_logit_softcapping", None)])
def test_transformed_logits_change_the_result(tmp_path, kind, attribute, plain):
    # The control: the same model with its transform left out of ours gives other results than TRL's.
    base = tiny_transformed_logits_model(kind)
    theirs, ours = (_trainer(cls, copy.deepcopy(base), tmp_path / cls.__module__)
                    for cls in (trl.GRPOTrainer, GRPOTrainer))
    setattr(ours.model.config, attribute, plain)
    with pytest.raises(AssertionError):
        _compare((theirs, ours), dict(level="sequence", loss_type="grpo", beta=0.0))


def test_the_fused_path_says_so_once_per_process(trainers, capfd, monkeypatch):
    from gspo_kernels.integrations import announce

    monkeypatch.setattr(announce, "_said", set())
    theirs, ours = trainers
    batch = _batch(theirs)
    case = dict(level="sequence", loss_type="grpo", beta=0.0)
    _run(ours, batch, case)
    _run(ours, batch, case)
    err = capfd.readouterr().err
    assert err.count("gspo_kernels: TRL GRPOTrainer runs fused: loss_type='grpo' on the fused-linear lm_head") == 1
    monkeypatch.setenv("GSPO_KERNELS_QUIET", "1")
    monkeypatch.setattr(announce, "_said", set())
    _run(ours, batch, case)
    assert "runs fused" not in capfd.readouterr().err


def test_sampling_aware_logprobs_follow_the_generation_settings(tmp_path):
    # GRPOConfig(sampling_aware_logprobs=True): the log-prob passes give the distribution the
    # generation sampled from (top_k, top_p, min_p of the same config), against the float64
    # reference sampler on the model's own logits; off, TRL's full softmax (the tests above).
    from gspo_kernels.testing import reference

    model = _model()
    trainer = _trainer(GRPOTrainer, copy.deepcopy(model), tmp_path, config_cls=GRPOConfig,
                       sampling_aware_logprobs=True, top_k=8, top_p=0.9, min_p=0.02, temperature=0.8)
    batch = _batch(trainer)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        got, entropy = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention, COMPLETION,
                                                                   compute_entropy=True)[:2]
        logits = model.double()(input_ids=ids, attention_mask=attention).logits[:, -COMPLETION - 1:-1]
    want, want_entropy = reference.selective_log_softmax(logits, batch["completion_ids"], 0.8, True,
                                                         sampling_top_k=8, sampling_top_p=0.9, sampling_min_p=0.02)
    mask = batch["completion_mask"].bool()
    finite = torch.isfinite(want) & mask
    assert torch.equal(torch.isfinite(got) & mask, finite) and (mask & ~finite).any()  # some outside the kept set
    assert torch.allclose(got.double()[finite], want[finite], atol=1e-5)
    assert torch.allclose(entropy.double()[mask], want_entropy[mask], atol=1e-5)
    with pytest.raises(TypeError, match="sampling_aware_logprobs must be True or False"):
        _trainer(GRPOTrainer, copy.deepcopy(model), tmp_path / "bad", config_cls=GRPOConfig,
                 sampling_aware_logprobs="yes")


# --- the engine's kept sets from a rollout_func -------------------------------------------------

def _top_k_rollout(k: int, temperature: float):
    """A rollout_func that samples each token from the tiny model's top-k (as an engine would) and
    returns the sets it kept, per generated token, under kept_token_ids."""
    def rollout(prompts, trainer):
        tokenizer, model = trainer.processing_class, trainer.model
        gen = torch.Generator().manual_seed(0)
        prompt_ids, completion_ids, logprobs, kept = [], [], [], []
        for prompt in prompts:
            ids = tokenizer(prompt)["input_ids"]
            completion, sets, lps = [], [], []
            with torch.no_grad():
                for _ in range(trainer.max_completion_length):
                    logits = model(input_ids=torch.tensor([ids + completion])).logits[0, -1].double() / temperature
                    top = logits.topk(k)
                    probs = torch.softmax(top.values, -1)
                    pick = int(torch.multinomial(probs, 1, generator=gen))
                    completion.append(int(top.indices[pick]))
                    sets.append(top.indices.tolist())
                    lps.append(float(probs[pick].log()))
            prompt_ids.append(ids)
            completion_ids.append(completion)
            logprobs.append(lps)
            kept.append(sets)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs,
                "kept_token_ids": kept}

    return rollout


def test_kept_sets_from_the_rollout_reach_every_log_prob_pass(tmp_path, monkeypatch):
    """A rollout_func's kept_token_ids: every fused log-prob call of the step gets them (old policy
    and training loss), the step runs without a fallback, and the rollout's own log-probs (the
    top-k renormalised ones) equal the drop-in's at the step's start (the same weights)."""
    from gspo_kernels import KeptTokens
    from gspo_kernels.integrations import head

    seen, plain = [], head.fused_linear_selective_log_softmax

    def spy(*args, kept_tokens=None, **kwargs):
        out = plain(*args, kept_tokens=kept_tokens, **kwargs)
        seen.append((kept_tokens, out[0].detach()))
        return out

    monkeypatch.setattr(head, "fused_linear_selective_log_softmax", spy)
    trainer = _trainer(GRPOTrainer, _model(), tmp_path, rollout_func=_top_k_rollout(6, 0.9), temperature=0.9,
                       num_iterations=2)
    captured = {}
    original = trainer._generate_and_score_completions

    def keep_output(inputs):
        captured["output"] = original(inputs)
        return captured["output"]

    trainer._generate_and_score_completions = keep_output
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in caught if str(w.message).startswith("gspo_kernels:")]
    assert seen and all(isinstance(kept, KeptTokens) for kept, _ in seen)
    assert math.isfinite(trainer.state.log_history[0]["loss"])
    output = captured["output"]
    kept_ids = output["kept_token_ids"]
    mask = output["completion_mask"].bool()
    assert kept_ids.shape[:2] == output["completion_ids"].shape and ((kept_ids >= 0).sum(-1)[mask] == 6).all()
    # The old-policy pass ran before any update: its log-probs are the rollout's own.
    old = output["old_per_token_logps"]
    assert torch.allclose(old[mask], output["sampling_per_token_logps"][mask].float(), atol=1e-5)


def test_kept_sets_refuse_the_unfused_path_and_a_second_description(tmp_path):
    from gspo_kernels.integrations.trl import rollout_kept

    sets = rollout_kept.RolloutKeptSets()
    sets.take({"kept_token_ids": [[[1, 2], [3]]]})
    with pytest.raises(ValueError, match="which TRL's own log-prob code would not read"):
        sets.refuse_unfused("TRL's own log-prob code")
    assert sets.padded(1, 3, "cpu").tolist() == [[[1, 2], [3, -1], [-1, -1]]]
    with pytest.raises(ValueError, match="for 1 completions; this process has 2"):
        sets.padded(2, 3, "cpu")
    from gspo_kernels.token_stats.kept_set import SamplingFilter
    with pytest.raises(ValueError, match="pass the kept set one way"):
        rollout_kept.as_kept_tokens(torch.tensor([[[1, -1]]]), torch.ones(1, 1, dtype=torch.bool), 10,
                                    SamplingFilter(top_k=3))
