"""The TRL drop-in under FSDP2 on 2 gloo processes, with a different batch on each rank:
fully_shard applied by hand as a CPU run needs it (accelerate turns fsdp_version=2 into DDP on a
CPU), to each decoder layer and the root, in one set-up also to an untied lm_head and its
embedding as units of their own (as verl shards them), and in one to a PEFT LoRA model (r 8 on
every projection, frozen head). Every parameter's gradient, gathered
from the shards, must be the mean of the ranks' own gradients on the unsharded model (what
FSDP2's averaging gives), the loss must equal TRL's own, and no fallback may be warned.

TRL's own trainer is compared too. Where the lm_head is its own unit, TRL 1.16's fused head reads
`lm_head.weight.full_tensor()` outside the head's forward: FSDP2 never reduces that gradient, so
each rank keeps its own lm_head gradient rows (measured: 0.333 relative error against the mean
here); the drop-in calls the head module (integrations/head.py) and gets the mean."""

from __future__ import annotations

import copy
import tempfile
import warnings

import pytest

from conftest import import_installed
import torch.distributed as dist

import_installed("trl")
from trainer_world import join, leave, run  # noqa: E402  (tests/integrations/, pyproject.toml's pythonpath)
from gspo_kernels.testing.verify import worst  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

WORLD = 2
CASES = {"sequence-grpo": dict(level="sequence", loss_type="grpo", beta=0.04),
         "token-dapo-entropy": dict(level="token", loss_type="dapo", beta=0.0, entropy_coef=0.01)}


SETUPS = {"tied": dict(tied=True, head_unit=False, lora=False), "untied": dict(tied=False, head_unit=False, lora=False),
          "untied-head-unit": dict(tied=False, head_unit=True, lora=False),
          "lora": dict(tied=False, head_unit=False, lora=True)}
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _shard(model, head_unit: bool, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():  # the decoder layers, inside a PEFT wrapper too
        if type(module).__name__ == "LlamaDecoderLayer":
            fully_shard(module, mesh=mesh)
    if head_unit:
        fully_shard(model.model.embed_tokens, mesh=mesh)
        fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _full_grads(model) -> dict:
    return {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).reshape(-1)
            for name, p in model.named_parameters() if p.requires_grad}


def _worker(rank: int, port: int, out: str, setup: str) -> None:
    join(rank, WORLD, port)
    import test_trl_drop_in as T
    import trl
    from torch.distributed.device_mesh import init_device_mesh

    from gspo_kernels.integrations.trl import GRPOTrainer
    from gspo_kernels.testing.tiny import tiny_grpo_trainer, tiny_llama

    base = tiny_llama(tied=SETUPS[setup]["tied"])
    if SETUPS[setup]["lora"]:
        import peft

        # init_lora_weights=False: B is random too, so that every adapter weight gets a gradient.
        base = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS,
                                                         lora_dropout=0.0, init_lora_weights=False))
    results = {}
    for label, case in CASES.items():
        def trainer(cls):
            t = tiny_grpo_trainer(cls, copy.deepcopy(base), tempfile.mkdtemp(), max_completion_length=T.COMPLETION)
            T._configure(t, case)
            return t

        ours, theirs, plain = trainer(GRPOTrainer), trainer(trl.GRPOTrainer), trainer(trl.GRPOTrainer)
        assert dist.is_initialized() and dist.get_world_size() == WORLD
        batch = T._batch(theirs)
        batch["advantages"] = batch["advantages"] * (1 + rank)  # a different batch on each rank
        del batch["sampling_per_token_logps"]
        plain._compute_loss(plain.model, batch).backward()  # this rank's own gradients, unsharded
        own = _full_grads(plain.model)
        mean = {n: g.clone() for n, g in own.items()}
        for g in mean.values():
            dist.all_reduce(g)
            g /= WORLD
        mesh = init_device_mesh("cpu", (WORLD,))
        losses, grads = {}, {}
        for name, t in (("ours", ours), ("theirs", theirs)):
            _shard(t.model, SETUPS[setup]["head_unit"], mesh)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss = t._compute_loss(t.model, batch)
            fallbacks = [str(w.message) for w in caught if "gspo_kernels:" in str(w.message)]
            assert not fallbacks, fallbacks
            loss.backward()
            losses[name], grads[name] = float(loss), _full_grads(t.model)
        def relative(a: dict) -> dict:
            return {n: T._rel(a[n], g) for n, g in mean.items()}

        ours_error, theirs_error = relative(grads["ours"]), relative(grads["theirs"])
        results[label] = {"loss": abs(losses["ours"] - losses["theirs"]) / abs(losses["theirs"]),
                          "ours": ours_error, "theirs": theirs_error,
                          "spread": max(relative(own).values()),
                          "head_is_unit": type(ours.model.get_output_embeddings()).__name__.startswith("FSDP")}
    leave(rank, out, results)


@pytest.mark.parametrize("setup", list(SETUPS))
def test_drop_in_under_fsdp2(setup, tmp_path):
    if SETUPS[setup]["lora"]:
        pytest.importorskip("peft")
    results = run(_worker, WORLD, tmp_path, setup)
    assert set(results) == set(CASES)
    for label, r in results.items():
        assert r["head_is_unit"] == SETUPS[setup]["head_unit"], label
        expected = 2 * len(PROJECTIONS) * 2 if SETUPS[setup]["lora"] else 20 if SETUPS[setup]["tied"] else 21
        assert len(r["ours"]) == expected, (label, sorted(r["ours"])[:4])
        assert r["spread"] > 0.05, "the ranks' own gradients should differ"
        assert r["loss"] < 1e-5, (label, r["loss"])
        bad = {n: e for n, e in r["ours"].items() if not e <= 1e-4}  # a NaN error is bad too
        assert not bad, (label, bad)
        if not SETUPS[setup]["head_unit"]:  # TRL's own trainer is right here, and so the same as ours
            assert worst(r["theirs"]) < 1e-4, (label, r["theirs"])
