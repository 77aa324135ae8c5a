"""One AReaL PPO step run by AReaL's FSDPPPOActor and by FusedFSDPPPOActor on the same tiny Qwen3
and batch, as AReaL's PPOTrainer runs it (compute_logp for the proximal log-probs,
compute_advantages, ppo_update), and what differs between the two. Used by the spawned workers
of test_areal_actor.py.

Both actors run the same backbone, so what is compared is everything after the hidden states.
(On a CPU, sdpa ignores the packed boundaries AReaL passes for flash-attention's varlen, so a
packed sequence attends to the one before it: the same for both actors, and not what is tested.)
"""

from __future__ import annotations

import torch

VOCAB_RANGE_STATS = {f"ppo_actor/update/vocab_{side}_logits/{agg}" for side in ("min", "max")
                     for agg in ("avg", "min", "max")}


def save_tiny_qwen3(path: str, tied: bool) -> None:
    import transformers

    from gspo_kernels.testing.tiny import BOS, EOS, PAD, tiny_tokenizer

    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=256, pad_token_id=PAD, eos_token_id=EOS,
                                      bos_token_id=BOS, tie_word_embeddings=tied)
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)


def actor_config(path: str, case: dict, world: int):
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, PPOActorConfig, RejectionSamplingConfig

    options = dict(case.get("actor", {}))
    if "rejection_sampling" in options:
        options["rejection_sampling"] = RejectionSamplingConfig(**options["rejection_sampling"])
    return PPOActorConfig(experiment_name="gk", trial_name="t", path=path, attn_impl="sdpa", dtype="float32",
                          optimizer=OptimizerConfig(lr=1e-3), backend=f"fsdp:d{world}", ppo_n_minibatches=1,
                          mb_spec=MicroBatchSpec(n_mbs=2), **options)


def build(cls, path: str, case: dict, world: int):
    from areal.api.io_struct import FinetuneSpec

    actor = cls(actor_config(path, case, world))
    actor.create_process_group()
    actor.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=4 * world, train_batch_size=4 * world))
    return actor


def trajectories(rank: int, case: dict) -> list[dict]:
    """Four trajectories of this rank: prompts of 4 tokens, responses of 3 to 8, AReaL's keys."""
    g = torch.Generator().manual_seed(100 + rank)
    batch = []
    for length in (12, 9, 11, 7):
        ids = torch.randint(0, 60, (1, length), generator=g)
        loss_mask = torch.zeros(1, length, dtype=torch.int32)
        loss_mask[:, 4:] = 1
        traj = dict(input_ids=ids, attention_mask=torch.ones(1, length, dtype=torch.bool), loss_mask=loss_mask,
                    logprobs=-torch.rand(1, length, generator=g) * 3, rewards=torch.randn(1, generator=g),
                    versions=torch.zeros(1, length, dtype=torch.int32))
        if case.get("ref"):
            traj["ref_logp"] = -torch.rand(1, length, generator=g) * 3
        if case.get("teacher"):
            traj["teacher_logp"] = -torch.rand(1, length, generator=g) * 3
            traj["rl_loss_weight"], traj["distill_loss_weight"] = case["teacher"]
        batch.append(traj)
    return batch


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def step(actor, rank: int, case: dict) -> dict:
    """Runs the step; returns the proximal log-probs, each micro-batch's loss, every parameter's
    gradient (gathered whole), AReaL's exported statistics and the fused actor's counts."""
    batch = trajectories(rank, case)
    logps = None
    if actor.config.should_compute_prox_logp():
        logps = actor.compute_logp(batch)
        for traj, logp in zip(batch, logps):
            traj["prox_logp"] = logp
    advantages = actor.compute_advantages(batch)
    losses, grads = [], {}
    compute_loss, optimizer_step = actor._compute_logprobs_and_loss, actor.optimizer_step

    def recording_loss(*args, **kwargs):
        loss = compute_loss(*args, **kwargs)
        losses.append(float(loss.detach()))
        return loss

    def recording_step():
        for name, p in actor.model.named_parameters():
            if p.grad is not None:  # frozen ones (LoRA's base weights) have none
                grads[name] = _full(p.grad)
        return optimizer_step()

    actor._compute_logprobs_and_loss, actor.optimizer_step = recording_loss, recording_step
    actor.ppo_update(advantages)
    return dict(logps=None if logps is None else torch.cat([x.reshape(-1) for x in logps]), losses=losses,
                grads=grads, stats=actor.export_stats(), calls=dict(getattr(actor, "gspo_kernels_calls", {})))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def differences(ours: dict, theirs: dict) -> dict:
    """How far the fused actor's step is from AReaL's (relative), JSON-ready."""
    shared = set(ours["stats"]) & set(theirs["stats"])
    stat_rel = {k: abs(ours["stats"][k] - theirs["stats"][k]) / max(abs(theirs["stats"][k]), 1e-6) for k in shared}
    return dict(
        logp_rel=None if theirs["logps"] is None else _rel(ours["logps"], theirs["logps"]),
        loss_rel=max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(ours["losses"], theirs["losses"])),
        n_losses=(len(ours["losses"]), len(theirs["losses"])),
        grad_rel={name: _rel(ours["grads"][name], g) for name, g in theirs["grads"].items()},
        grad_max=max(float(g.abs().max()) for g in theirs["grads"].values()),
        stat_rel={k: v for k, v in stat_rel.items() if v > 1e-5},
        stats_missing=sorted(set(theirs["stats"]) - set(ours["stats"])),
        stats_extra=sorted(set(ours["stats"]) - set(theirs["stats"])),
        n_stats=len(shared),
        calls=ours["calls"],
    )
