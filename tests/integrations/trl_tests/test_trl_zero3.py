"""The TRL drop-in under DeepSpeed ZeRO-3, for real: DeepSpeed's CPU accelerator on 2 gloo
processes, TRL's trainer prepared by accelerate's DeepSpeed path (every parameter partitioned;
the lm_head holds 0 elements outside its module's forward), a different batch on each rank.
The drop-in's fused path (no fallback) must give TRL's loss, and every parameter's full
gradient (DeepSpeed's safe_get_full_grad) must equal TRL's under ZeRO-3 and the mean of the
ranks' own gradients on an unsharded model."""

from __future__ import annotations

import copy
import tempfile
import warnings

import pytest

from conftest import import_installed
import torch.distributed as dist

import_installed("trl")
pytest.importorskip("deepspeed")
from trainer_world import join, leave, run  # noqa: E402  (tests/integrations/, pyproject.toml's pythonpath)
from gspo_kernels.testing.verify import relative_errors, worst  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

WORLD = 2
ZERO3 = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
         "zero_allow_untested_optimizer": True}
CASE = dict(level="sequence", loss_type="grpo", beta=0.04)


def _worker(rank: int, port: int, out: str) -> None:
    join(rank, WORLD, port)
    import test_trl_drop_in as T
    import trl
    from deepspeed.utils import safe_get_full_grad

    from gspo_kernels.integrations.trl import GRPOTrainer
    from gspo_kernels.testing.tiny import tiny_grpo_trainer, tiny_llama

    base = tiny_llama()
    plain = tiny_grpo_trainer(trl.GRPOTrainer, copy.deepcopy(base), tempfile.mkdtemp(),
                              max_completion_length=T.COMPLETION)
    T._configure(plain, CASE)
    batch = T._batch(plain)
    batch["advantages"] = batch["advantages"] * (1 + rank)  # a different batch on each rank
    del batch["sampling_per_token_logps"]
    plain._compute_loss(plain.model, batch).backward()
    mean = {n: p.grad.clone() for n, p in plain.model.named_parameters()}
    for g in mean.values():
        dist.all_reduce(g)
        g /= WORLD
    results = {}
    for name, cls in (("theirs", trl.GRPOTrainer), ("ours", GRPOTrainer)):
        t = tiny_grpo_trainer(cls, copy.deepcopy(base), tempfile.mkdtemp(), max_completion_length=T.COMPLETION,
                              deepspeed=ZERO3)
        T._configure(t, CASE)
        t.create_optimizer()
        engine, _ = t.accelerator.prepare(t.model, t.optimizer)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = t._compute_loss(engine, batch)
        t.accelerator.backward(loss)
        grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
        results[name] = {
            "loss": float(loss.detach()),
            "fallbacks": [str(w.message) for w in caught if "gspo_kernels:" in str(w.message)],
            "head_numel": engine.module.lm_head.weight.numel(),  # partitioned: 0 outside its forward
            "vs_mean": worst(relative_errors(grads, mean)),
            "grads": grads,
        }
    ours, theirs = results["ours"], results["theirs"]
    summary = {"loss": abs(ours["loss"] - theirs["loss"]) / abs(theirs["loss"]),
               "vs_theirs": worst(relative_errors(ours["grads"], theirs["grads"])),
               **{f"{k}_{name}": results[name][k] for name in results for k in ("fallbacks", "head_numel", "vs_mean")}}
    leave(rank, out, summary)


def test_drop_in_under_zero3(tmp_path):
    r = run(_worker, WORLD, tmp_path)
    assert r["head_numel_ours"] == 0 and r["head_numel_theirs"] == 0, r  # ZeRO-3 really partitioned the head
    assert r["fallbacks_ours"] == [], r["fallbacks_ours"]
    assert r["loss"] < 1e-5, r
    assert r["vs_theirs"] < 1e-4 and r["vs_mean_ours"] < 1e-4 and r["vs_mean_theirs"] < 1e-4, r
