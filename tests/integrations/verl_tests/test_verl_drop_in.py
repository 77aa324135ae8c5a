"""The verl drop-in against verl's own code: each registered gk_* policy loss against verl's
loss of the same name (loss, gradient of log_prob, verl's metrics), over loss aggregations,
clip ranges, rollout weights and global-batch normalisation; the fused actor forward
against the model's own logits; and `fused_kernel_options.batch_invariant`, from verl's Hydra
keys through its FSDP engine's model build to the fused-linear call, where a sequence's
log-probs are then bitwise the same alone and in a batch."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import types

import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
verl_config = pytest.importorskip("verl.workers.config")
transformers = pytest.importorskip("transformers")

import gspo_kernels.integrations.verl as gk_verl  # noqa: E402
from gspo_kernels.config import LinearConfig  # noqa: E402
from gspo_kernels.testing.tiny import tiny_llama, tiny_tokenizer, tiny_transformed_logits_model  # noqa: E402

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


@pytest.mark.parametrize("kind", ["cohere", "granite", "gemma2"])
def test_fused_forward_applies_the_models_logit_transform(kind):
    # verl's own fused kernels drop the model's multiplier and soft-cap; ours take them (model_logits.py):
    # log-probs, entropies and every parameter's gradient against the model's own float64 logits.
    from verl.models.transformers import monkey_patch

    model = tiny_transformed_logits_model(kind)
    reference = copy.deepcopy(model).double()
    ids = torch.randint(0, 60, (3, 7))
    logp = torch.log_softmax(reference(input_ids=ids).logits / 0.7, -1)
    want = logp.gather(-1, torch.roll(ids, -1, -1)[..., None]).squeeze(-1)
    want_entropy = -(logp.exp() * logp).sum(-1)
    (want.sum() + 0.3 * want_entropy.sum()).backward()
    original = type(model).forward
    try:
        monkey_patch.patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="gspo_kernels")
        assert type(model).forward is gk_verl.forward_with_gspo_kernels
        out = model(input_ids=ids, temperature=0.7, return_dict=True)
        (out.log_probs.double().sum() + 0.3 * out.entropy.double().sum()).backward()
    finally:
        type(model).forward = original
    assert torch.allclose(out.log_probs.double(), want, atol=2e-5)
    assert torch.allclose(out.entropy.double(), want_entropy, atol=2e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.allclose(p.grad.double(), q.grad, rtol=1e-3, atol=1e-5), name


def test_fused_forward_refuses_a_scale_of_unknown_direction():
    from verl.models.transformers import monkey_patch

    model = tiny_llama(vocab=64)
    model.config.logits_scaling = 3.0  # no Llama applies it: its direction is not known
    original = type(model).forward
    try:
        monkey_patch.patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="gspo_kernels")
        with pytest.raises(NotImplementedError, match="logits_scaling.*use_fused_kernels=False"):
            model(input_ids=torch.randint(0, 60, (2, 5)), temperature=1.0, return_dict=True)
    finally:
        type(model).forward = original


def test_the_fused_forward_says_so_once_per_process(capfd, monkeypatch):
    from verl.models.transformers import monkey_patch

    from gspo_kernels.integrations import announce

    monkeypatch.setattr(announce, "_said", set())
    model = tiny_llama(vocab=64)
    original = type(model).forward
    try:
        monkey_patch.patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="gspo_kernels")
        for _ in range(2):
            model(input_ids=torch.randint(0, 60, (2, 5)), temperature=1.0, return_dict=True)
    finally:
        type(model).forward = original
    assert capfd.readouterr().err.count("gspo_kernels: verl's fused forward runs gspo_kernels' fused-linear") == 1


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


# --- fused_kernel_options.batch_invariant -------------------------------------------------------

def _model_config(fused=True, backend="gspo_kernels", **options):
    return types.SimpleNamespace(use_fused_kernels=fused,
                                 fused_kernel_options={"impl_backend": backend, **options})


def test_batch_invariant_option_is_read_and_validated():
    assert gk_verl.linear_config(_model_config()) is None  # unset: the fused call's defaults
    assert gk_verl.linear_config(types.SimpleNamespace(fused_kernel_options=None)) is None
    assert gk_verl.linear_config(_model_config(batch_invariant=True)) == LinearConfig(batch_invariant=True)
    assert gk_verl.linear_config(_model_config(batch_invariant=False)) == LinearConfig()
    assert gk_verl.linear_config(_model_config(fused=False, backend="torch", batch_invariant=False)) == LinearConfig()
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match=f"fused_kernel_options.batch_invariant must be true or false; got {bad!r}"):
            gk_verl.linear_config(_model_config(batch_invariant=bad))
    for config in (_model_config(backend="torch", batch_invariant=True),
                   _model_config(fused=False, batch_invariant=True)):  # the option would reach nothing
        with pytest.raises(ValueError, match="set use_fused_kernels=True and fused_kernel_options.impl_backend"):
            gk_verl.linear_config(config)


def test_sampling_aware_option_is_read_and_validated():
    from gspo_kernels.token_stats.kept_set import SamplingFilter

    assert gk_verl.sampling_config(_model_config()) is None
    rollout = {"top_k": 20, "top_p": 0.9}
    assert gk_verl.sampling_config(_model_config(sampling_aware_logprobs=rollout)) == SamplingFilter(20, 0.9, None)
    # verl's rollout defaults (top_k -1, top_p 1) keep every token: nothing to do.
    assert gk_verl.sampling_config(_model_config(sampling_aware_logprobs={"top_k": -1, "top_p": 1.0})) is None
    with pytest.raises(TypeError, match="must map top_k, top_p and/or min_p"):
        gk_verl.sampling_config(_model_config(sampling_aware_logprobs={"topk": 3}))
    with pytest.raises(ValueError, match="set use_fused_kernels=True"):
        gk_verl.sampling_config(_model_config(backend="torch", sampling_aware_logprobs=rollout))


def test_fused_forward_follows_the_rollouts_kept_set():
    from verl.models.transformers import monkey_patch

    from gspo_kernels.integrations.verl.fused_forward import SAMPLING_ATTRIBUTE
    from gspo_kernels.testing import reference
    from gspo_kernels.token_stats.kept_set import SamplingFilter

    model = tiny_llama(vocab=64)
    ids = torch.randint(0, 60, (3, 7))
    with torch.no_grad():
        logits = model.double()(input_ids=ids).logits
        model.float()
    want, want_entropy = reference.selective_log_softmax(logits, torch.roll(ids, -1, -1), 0.7, True,
                                                         sampling_top_k=10, sampling_top_p=0.8)
    original = type(model).forward
    try:
        monkey_patch.patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="gspo_kernels")
        setattr(model, SAMPLING_ATTRIBUTE, SamplingFilter(10, 0.8, None))  # what the engine's build hands it
        out = model(input_ids=ids, temperature=0.7, return_dict=True)
    finally:
        type(model).forward = original
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(out.log_probs), finite) and (~finite).any()
    assert torch.allclose(out.log_probs.double()[finite], want[finite], atol=2e-5)
    assert torch.allclose(out.entropy.double(), want_entropy, atol=2e-5)


def test_the_engine_build_refuses_before_loading_and_without_our_forward():
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    assert getattr(FSDPEngine._build_module, "gspo_kernels", False)  # wrapped when verl imported its engine
    engine = types.SimpleNamespace(model_config=_model_config(batch_invariant="true"))
    with pytest.raises(TypeError, match="batch_invariant must be true or false"):
        FSDPEngine._build_module(engine)  # before verl reads the (absent) model
    # A model whose forward stays verl's (a vision-language model falls back to verl's backend):
    build = gk_verl._with_linear_options(lambda self: torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="runs verl's own forward"):
        build(types.SimpleNamespace(model_config=_model_config(batch_invariant=True)))


@pytest.fixture(scope="module")
def invariant_model(tmp_path_factory):
    """A model built by verl's FSDPEngine._build_module from verl's Hydra keys, as its engine
    worker builds it (omega_conf_to_dataclass of actor_rollout_ref.model), with
    +fused_kernel_options.batch_invariant=true. A Llama with no decoder layer: the model body is
    the user's (docs/fused_linear.md) and its matmuls give a row other bits in another batch on
    this CPU; with none, the body (embedding, final norm) works row by row (checked below), and
    what is tested is the drop-in's forward. verl sets the forward on the class for the whole
    process: it is put back at once, and the tests install it while they run (_fused)."""
    pytest.importorskip("hydra")
    from hydra import compose, initialize_config_dir

    import verl.trainer.config
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    path = str(tmp_path_factory.mktemp("invariant_model"))
    tiny_llama(vocab=64, layers=0).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    keys = [f"actor_rollout_ref.model.path={path}", "actor_rollout_ref.model.use_fused_kernels=True",
            "actor_rollout_ref.model.fused_kernel_options.impl_backend=gspo_kernels",
            "+actor_rollout_ref.model.fused_kernel_options.batch_invariant=true",
            "+actor_rollout_ref.model.override_config.attn_implementation=eager"]
    with initialize_config_dir(config_dir=os.path.dirname(verl.trainer.config.__file__), version_base=None):
        actor = compose(config_name="ppo_trainer", overrides=keys).actor_rollout_ref
    model_config = omega_conf_to_dataclass(actor.model)  # as verl's engine worker builds it
    # The engine's attributes that _build_module reads: float32, one process (mesh coordinate 0).
    engine = types.SimpleNamespace(engine_config=types.SimpleNamespace(model_dtype="fp32", forward_only=False),
                                   model_config=model_config, use_remove_padding=False,
                                   ulysses_sequence_parallel_size=1,
                                   device_mesh=types.SimpleNamespace(get_coordinate=lambda: [0]))
    cls = transformers.LlamaForCausalLM
    original = cls.forward
    try:
        model = FSDPEngine._build_module(engine)
        assert type(model).forward is gk_verl.forward_with_gspo_kernels
    finally:
        cls.forward = original
    return model


class _fused:
    """The fused forward on the model's class for a block."""

    def __init__(self, model):
        self.cls = type(model)

    def __enter__(self):
        self.original, self.cls.forward = self.cls.forward, gk_verl.forward_with_gspo_kernels

    def __exit__(self, *exc):
        self.cls.forward = self.original


def test_batch_invariant_reaches_the_fused_linear_call(invariant_model, monkeypatch):
    from gspo_kernels.integrations import head

    seen, plain = [], head.fused_linear_selective_log_softmax

    def spy(*args, linear=None, **kwargs):
        seen.append(linear)
        return plain(*args, linear=linear, **kwargs)

    monkeypatch.setattr(head, "fused_linear_selective_log_softmax", spy)
    with _fused(invariant_model), torch.no_grad():
        invariant_model(input_ids=torch.randint(0, 60, (2, 5)), temperature=0.9, return_dict=True)
    assert seen == [LinearConfig(batch_invariant=True)]


def _alone_and_in_a_batch(model, packed: bool):
    """For each of 5 sequences: its (log-probs, entropies, the body's hidden states) alone and
    among the 5, padded `(5, 7)`, or packed as verl's padding-free layout `(1, 31)` with position
    ids and shift_labels (lengths 5, 9, 7, 4, 6)."""
    gen = torch.Generator().manual_seed(5)
    lengths = [5, 9, 7, 4, 6] if packed else [7] * 5
    seqs = [torch.randint(0, 60, (n,), generator=gen) for n in lengths]
    labels = [torch.randint(0, 64, (n,), generator=gen) for n in lengths]
    if packed:
        whole = dict(input_ids=torch.cat(seqs)[None], shift_labels=torch.cat(labels)[None],
                     position_ids=torch.cat([torch.arange(n) for n in lengths])[None])
        starts = [sum(lengths[:i]) for i in range(5)]
        picks = [lambda t, a=a, n=n: t[:, a:a + n] for a, n in zip(starts, lengths)]
    else:
        whole = dict(input_ids=torch.stack(seqs), shift_labels=torch.stack(labels),
                     position_ids=torch.arange(7).expand(5, 7))
        picks = [lambda t, i=i: t[i:i + 1] for i in range(5)]

    def run(inputs):
        out = model(**inputs, temperature=0.9, return_dict=True)
        hidden = model.model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"]).last_hidden_state
        return out.log_probs, out.entropy, hidden

    with _fused(model), torch.no_grad():
        batch = run(whole)
        return [(run(dict(input_ids=seq[None], shift_labels=label[None], position_ids=torch.arange(len(seq))[None])),
                 tuple(pick(t) for t in batch)) for seq, label, pick in zip(seqs, labels, picks)]


def _differing(pairs) -> list[str]:
    """What differs in bits between a sequence alone and in the batch: (sequence, output)."""
    return [f"sequence {i}: {name}" for i, (alone, in_batch) in enumerate(pairs)
            for name, a, b in zip(("log-probs", "entropies"), alone[:2], in_batch[:2]) if not torch.equal(a, b)]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_batch_invariant_log_probs_alone_equal_in_a_batch(invariant_model, packed):
    pairs = _alone_and_in_a_batch(invariant_model, packed)
    for alone, in_batch in pairs:  # the body's part: the same input to the head
        assert torch.equal(alone[2], in_batch[2])
    assert not _differing(pairs)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_without_batch_invariant_the_log_probs_can_differ(invariant_model, packed, monkeypatch, row_count_products):
    """The check above can fail, on every machine: with a logits product whose sum over H is split
    where the row count says (tests/conftest.py; a BLAS picks its split-K by shape, and on a 2-core
    AVX2 EPYC the default path's 4 to 9-row products already differed from 35 or 31-row ones),
    the default path gives some sequences other bits alone than among the 5, and the comparison
    sees it; with batch_invariant the same product leaves every sequence's bits alone."""
    assert not _differing(_alone_and_in_a_batch(invariant_model, packed))
    monkeypatch.setattr(invariant_model, gk_verl.LINEAR_ATTRIBUTE, LinearConfig(batch_invariant=False))
    pairs = _alone_and_in_a_batch(invariant_model, packed)
    for alone, in_batch in pairs:
        assert torch.equal(alone[2], in_batch[2])
    assert _differing(pairs)
