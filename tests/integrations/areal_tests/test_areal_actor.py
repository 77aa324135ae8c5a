"""FusedFSDPPPOActor against AReaL's own FSDPPPOActor: the real FSDP2 engine on gloo, 1 and 2
ranks, one PPO step each (areal_steps.py). The proximal log-probs, each micro-batch's loss and
every parameter's gradient within 1e-5 relative (float32), AReaL's logged statistics equal but
for the two that read every logit, and the fused path taken throughout (counted): no call of
AReaL's logits-to-log-probs functions, every micro-batch through the fused forward, the loss by
gspo_kernels' policy loss where losses.py maps it."""

from __future__ import annotations

import pytest

try:
    import areal.engine.fsdp_engine  # noqa: F401
except ImportError as error:
    pytest.skip(f"AReaL's FSDP engine does not import ({error}): these tests run in the AReaL environment, "
                "scripts/test_areal.sh (scripts/test.sh runs it after the suite)", allow_module_level=True)

from areal_steps import VOCAB_RANGE_STATS, build, differences, save_tiny_qwen3, step  # noqa: E402
from trainer_world import join, leave, run  # noqa: E402

SEQUENCE = {"importance_sampling_level": "sequence"}
CASES = {
    "gspo": dict(actor=SEQUENCE),
    "token": dict(actor={}),  # AReaL's default: token-level PPO ratio
    "gspo_tied": dict(actor=SEQUENCE, tied=True),
    "token_tied": dict(actor={}, tied=True),
    "gspo_ref_kl": dict(actor=dict(SEQUENCE, kl_ctl=0.1), ref=True),
    "gspo_no_kl": dict(actor=dict(SEQUENCE, kl_ctl=0.0), ref=True),
    "token_teacher": dict(actor={}, teacher=(1.0, 0.005)),
    "gspo_teacher_kl": dict(actor=dict(SEQUENCE, kl_ctl=0.1), ref=True, teacher=(0.7, 0.2)),
    "gspo_pure_distillation": dict(actor=SEQUENCE, teacher=(0.0, 0.5)),
    "decoupled_gspo_t07": dict(actor=dict(SEQUENCE, use_decoupled_loss=True, temperature=0.7,
                                          rejection_sampling=dict(level="token", action="mask", upper=1.5))),
    "decoupled_token_clamp": dict(actor=dict(use_decoupled_loss=True, eps_clip_higher=0.28, c_clip=3.0,
                                             rejection_sampling=dict(level="sequence", action="clamp", upper=1.2))),
    "decoupled_loglinear": dict(actor=dict(SEQUENCE, use_decoupled_loss=True, prox_logp_method="loglinear")),
    "decoupled_m2po": dict(actor=dict(SEQUENCE, use_decoupled_loss=True, m2_threshold=0.04)),
    "sapo_gspo": dict(actor=dict(SEQUENCE, use_sapo_loss=True, sapo_tau_pos=1.0, sapo_tau_neg=1.05)),
    # AReaL's LoRA: PEFT around the model before FSDP2 ("all-linear": every projection, not the head).
    "gspo_lora": dict(actor=dict(SEQUENCE, use_lora=True, lora_rank=4, lora_alpha=8)),
    # The logit range AReaL logs, formed by one more product of the head (log_vocab_range).
    "gspo_vocab_range": dict(actor=SEQUENCE, vocab_range=True),
    "token_tied_vocab_range": dict(actor={}, tied=True, vocab_range=True),
}
WORLDS = {1: list(CASES), 2: ["gspo", "token_tied", "gspo_teacher_kl", "decoupled_gspo_t07", "gspo_lora",
                             "token_tied_vocab_range"]}
AREAL_LOSS_CASES = {"gspo_pure_distillation"}  # run AReaL's loss function on the fused log-probs


def _counting_logits_path():
    """Counts the calls of AReaL's log-probs-from-logits functions in its FSDP engine."""
    import areal.engine.fsdp_engine as engine

    counts = {"logits_to_logprobs": 0}
    for name in ("gather_logprobs", "gather_logprobs_entropy"):
        original = getattr(engine, name)

        def counted(*args, _original=original, **kwargs):
            counts["logits_to_logprobs"] += 1
            return _original(*args, **kwargs)

        setattr(engine, name, counted)
    return counts


def worker(rank: int, port: int, out: str, world: int, paths: dict, names: list):
    join(rank, world, port)
    import warnings

    import torch
    import torch.distributed as dist

    from areal.engine.fsdp_engine import FSDPPPOActor

    from gspo_kernels.integrations import announce
    from gspo_kernels.integrations.areal import FusedFSDPPPOActor

    warnings.simplefilter("ignore")
    # The group made here, so that each actor's destroy() leaves it (an actor that made it destroys it).
    dist.init_process_group("gloo")
    counts = _counting_logits_path()
    results = {}
    for name in names:
        case = CASES[name]
        path = paths["tied" if case.get("tied") else "untied"]
        runs = {}
        for label, cls in (("areal", FSDPPPOActor), ("fused", FusedFSDPPPOActor)):
            before = counts["logits_to_logprobs"]
            torch.manual_seed(1234)  # LoRA's A matrices are drawn when the engine wraps the model
            actor = build(cls, path, case, world)
            if case.get("vocab_range") and cls is FusedFSDPPPOActor:
                actor.log_vocab_range = True
            runs[label] = step(actor, rank, case)
            runs[label]["logits_calls"] = counts["logits_to_logprobs"] - before
            actor.destroy()
        result = differences(runs["fused"], runs["areal"])
        result.update(areal_logits_calls=runs["areal"]["logits_calls"], fused_logits_calls=runs["fused"]["logits_calls"],
                      announced=sorted(line for line in announce._said if "AReaL" in line))
        results[name] = result
    leave(rank, out, results)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("areal_models")
    paths = {"untied": str(root / "untied"), "tied": str(root / "tied")}
    save_tiny_qwen3(paths["untied"], tied=False)
    save_tiny_qwen3(paths["tied"], tied=True)
    return paths


_results: dict = {}


def _world_results(world: int, models, tmp_path_factory) -> dict:
    if world not in _results:
        _results[world] = run(worker, world, tmp_path_factory.mktemp(f"areal_world{world}"), world, models,
                              WORLDS[world])
    return _results[world]


@pytest.mark.parametrize("world,name", [(w, n) for w, names in WORLDS.items() for n in names])
def test_fused_actor_matches_areal(world, name, models, tmp_path_factory):
    r = _world_results(world, models, tmp_path_factory)[name]
    assert r["areal_logits_calls"] > 0, "the counter of AReaL's logits path saw nothing: it counts nothing"
    assert r["fused_logits_calls"] == 0, "the fused actor ran AReaL's log-probs from logits"
    n_losses = r["n_losses"][0]
    assert r["n_losses"][0] == r["n_losses"][1] and n_losses >= 2
    calls = r["calls"]
    assert calls["fused_forward"] >= n_losses
    path = "areal_loss" if name in AREAL_LOSS_CASES else "gspo_loss"
    assert calls.get(path, 0) == n_losses and sum(v for k, v in calls.items() if k != "fused_forward") == n_losses, calls
    if r["logp_rel"] is not None:
        assert r["logp_rel"] <= 1e-5
    assert r["loss_rel"] <= 1e-5, r["loss_rel"]
    assert r["grad_max"] > 0
    worst = max(r["grad_rel"].items(), key=lambda kv: kv[1])
    assert worst[1] <= 1e-5, f"gradient of {worst[0]} off by {worst[1]:.2e} relative"
    assert not r["stat_rel"], r["stat_rel"]
    missing = set() if CASES[name].get("vocab_range") else VOCAB_RANGE_STATS
    assert set(r["stats_missing"]) == missing and not r["stats_extra"], (r["stats_missing"], r["stats_extra"])
    assert r["n_stats"] > 40
    assert r["announced"] == ["AReaL's FSDP actor runs gspo_kernels' fused-linear log-probs and entropies (no logits)"]


def test_use_fused_actor_makes_the_trainer_build_it(models, monkeypatch):
    """PPOTrainer builds its actor, reference and teacher models from `areal.engine.FSDPPPOActor` (here in
    AReaL's SPMD mode; its single controller hands the workers the class's import path)."""
    import importlib
    import os

    import areal.engine
    from areal.api.alloc_mode import ModelAllocation
    from areal.trainer.rl_trainer import PPOTrainer

    import gspo_kernels.integrations.areal as gk_areal

    monkeypatch.setenv("AREAL_SPMD_MODE", "1")
    monkeypatch.setattr(areal.engine, "FSDPPPOActor", areal.engine.FSDPPPOActor)
    monkeypatch.setattr(gk_areal.FusedFSDPPPOActor, "log_vocab_range", False)
    monkeypatch.delenv(gk_areal.VOCAB_RANGE_ENV, raising=False)
    gk_areal.use_fused_actor(log_vocab_range=True)
    # The option reaches the class here, and the processes this one starts through the environment.
    assert gk_areal.FusedFSDPPPOActor.log_vocab_range and os.environ[gk_areal.VOCAB_RANGE_ENV] == "1"
    built = []
    monkeypatch.setattr(gk_areal.FusedFSDPPPOActor, "create_process_group", lambda self, parallel_strategy=None:
                        built.append(self))
    from areal_steps import actor_config

    actor = PPOTrainer._create_train_engine(None, actor_config(models["untied"], CASES["gspo"], 1),
                                            ModelAllocation.from_str("fsdp:d1"))
    assert type(actor) is gk_areal.FusedFSDPPPOActor and built == [actor]
    cls = gk_areal.FusedFSDPPPOActor
    assert getattr(importlib.import_module(cls.__module__), cls.__name__) is cls


def test_refuses_what_it_does_not_run():
    from types import SimpleNamespace

    from gspo_kernels.integrations.areal.actor import _unsupported

    def engine(sp=1, tp=1, tree=False, critic=False, vision=False):
        return SimpleNamespace(config=SimpleNamespace(is_critic=critic), enable_tree_training=tree,
                               is_vision_model=vision, model_config=SimpleNamespace(model_type="qwen2_vl"),
                               parallel_helper=SimpleNamespace(sp_size=sp, tp_size=tp))

    assert _unsupported(engine()) is None
    assert "Ulysses" in _unsupported(engine(sp=2))
    assert "tensor parallelism" in _unsupported(engine(tp=2))
    assert "enable_tree_training" in _unsupported(engine(tree=True))
    assert "critic" in _unsupported(engine(critic=True))
    assert "qwen2_vl" in _unsupported(engine(vision=True))
