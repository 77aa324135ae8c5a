"""verl's own actor worker end to end with the drop-in: `ActorRolloutRefWorker` built from a
Hydra config with the README's keys, through verl's FSDP2 engine and `apply_monkey_patch`, fed
the way verl's trainer feeds it (a padded DataProto turned padding-free), on 1 and 2 gloo
processes: every configuration on 1, and on 2 a set of six in which the values of any two
settings meet in every pair (no setting is assumed not to interact with the sharding; all 32
took 163 s on 2 processes, 39 s the six, 2-core AVX-512 Xeon). Each configuration runs
`compute_log_prob` and one `update_actor` with gk_<mode> (fused forward off, then on) and with
verl's own <mode> (fused forward off), and compares log-probs, entropies, the loss and its
metrics and every parameter's gradient as the optimizer sees it (gathered from the FSDP2
shards). Plus one fused worker built with +fused_kernel_options.batch_invariant=true: every
fused-linear call of its compute_log_prob gets LinearConfig(batch_invariant=True)."""

from __future__ import annotations

import itertools
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("verl.workers.engine_workers")
pytest.importorskip("hydra")
from trainer_world import join, leave, run  # noqa: E402  (tests/integrations/, pyproject.toml's pythonpath)

from gspo_kernels.config import LinearConfig  # noqa: E402
from gspo_kernels.testing.verify import relative_errors, worst  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

TEMPERATURE = 0.8
ROWS = 4  # per rank
PROMPT, RESPONSE = 5, 6
MODES = ("gspo", "vanilla")
AGGS = ("token-mean", "seq-mean-token-mean")
# (remove padding, KL loss and entropy bonus): the settings the engine's layout and verl's
# ppo_loss read around the policy loss.
SETTINGS = list(itertools.product((False, True), (False, True)))
# (tied, remove padding, KL loss and entropy bonus, mode, agg): every configuration, and six of
# them that hold every pair of values of any two of the five (checked by the test).
ALL_CASES = [(tied, rmpad, reg, mode, agg) for tied, (rmpad, reg), mode, agg
             in itertools.product((False, True), SETTINGS, MODES, AGGS)]
PAIRWISE_CASES = [(False, True, False, "gspo", "token-mean"),  # the batch-invariant run's reference
                  (False, False, False, "gspo", "token-mean"),
                  (False, False, True, "vanilla", "seq-mean-token-mean"),
                  (True, False, False, "vanilla", "seq-mean-token-mean"),
                  (True, True, True, "gspo", "seq-mean-token-mean"),
                  (True, True, True, "vanilla", "token-mean")]


def _cases(world: int) -> list[tuple]:
    return ALL_CASES if world == 1 else PAIRWISE_CASES


def _overrides(model_dir: str, mode: str, agg: str, remove_padding: bool, regularized: bool, fused: bool,
               world: int) -> list[str]:
    actor = "actor_rollout_ref.actor"
    keys = [
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.external_lib=gspo_kernels.integrations.verl",
        f"actor_rollout_ref.model.use_remove_padding={remove_padding}",
        f"actor_rollout_ref.model.use_fused_kernels={fused}",
        f"actor_rollout_ref.model.fused_kernel_options.impl_backend={'gspo_kernels' if fused else 'torch'}",
        # flash-attention is verl's default and needs a GPU
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",
        f"{actor}.strategy=fsdp2",
        f"{actor}.policy_loss.loss_mode={mode}",
        f"{actor}.loss_agg_mode={agg}",
        f"{actor}.use_kl_loss={regularized}",
        f"{actor}.kl_loss_coef=0.1",
        f"{actor}.entropy_coeff={0.01 if regularized else 0}",
        f"{actor}.ppo_mini_batch_size={ROWS * world}",
        f"{actor}.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        f"{actor}.use_dynamic_bsz=false",
        # verl compiles its entropy for the unfused path; inductor's CPU build costs ~15 s a process
        f"{actor}.use_torch_compile=false",
        f"{actor}.fsdp_config.use_torch_compile=false",
        # float32 throughout, so that a gradient of 1e-4 relative means something (verl's default
        # is bf16 autocast); clipping off, so that the optimizer sees the loss's own gradient
        f"++{actor}.fsdp_config.mixed_precision={{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}}",
        f"{actor}.optim.clip_grad=1e9",
        "actor_rollout_ref.rollout.n=1",
        f"actor_rollout_ref.rollout.temperature={TEMPERATURE}",
    ]
    return keys


def _config(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    import verl.trainer.config

    with initialize_config_dir(config_dir=os.path.dirname(verl.trainer.config.__file__), version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides).actor_rollout_ref


def _batch(rank: int, old_log_probs: torch.Tensor | None):
    """A padded rollout batch as verl's trainer holds it: left-padded prompts, right-padded
    responses (one of a single token), old and reference log-probs near the policy's own, three
    sequences shifted off-policy so that both clip sides act and one sequence trains."""
    from verl import DataProto

    gen = torch.Generator().manual_seed(100 + rank)
    prompt_len = torch.tensor([5, 3, 4, 2])
    response_len = torch.tensor([6, 1, 4, 5])
    prompt_mask = torch.arange(PROMPT)[None] >= (PROMPT - prompt_len)[:, None]
    response_mask = torch.arange(RESPONSE)[None] < response_len[:, None]
    prompts = torch.full((ROWS, PROMPT), 60)
    responses = torch.full((ROWS, RESPONSE), 60)
    prompts[prompt_mask] = torch.randint(0, 60, (int(prompt_mask.sum()),), generator=gen)
    responses[response_mask] = torch.randint(0, 60, (int(response_mask.sum()),), generator=gen)
    attention = torch.cat([prompt_mask, response_mask], 1).long()
    tensors = dict(prompts=prompts, responses=responses, input_ids=torch.cat([prompts, responses], 1),
                   attention_mask=attention, position_ids=(attention.cumsum(1) - 1).clamp(min=0),
                   response_mask=response_mask.long())
    if old_log_probs is not None:
        old = old_log_probs + 0.1 * torch.randn(ROWS, RESPONSE, generator=gen)
        old[0] -= 0.4  # A > 0, ratio above 1 + eps: clipped above
        old[1:4:2] += 0.4  # A < 0, ratio below 1 - eps: clipped below; row 2 stays near on-policy
        advantages = torch.tensor([1.0, -0.5, 0.7, -1.2])[:, None].expand(ROWS, RESPONSE)
        tensors.update(old_log_probs=old, ref_log_prob=old_log_probs + 0.2 * torch.randn(ROWS, RESPONSE, generator=gen),
                       advantages=advantages * response_mask)
    return DataProto.from_dict(tensors=tensors, meta_info={"temperature": TEMPERATURE})


def _log_probs(worker, batch):
    """As verl's trainer computes old log-probs (RayPPOTrainer._compute_old_log_prob)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    data = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(data, calculate_entropy=True, compute_loss=False)
    out = worker.compute_log_prob(data)
    return (no_padding_2_padding(tu.get(out, "log_probs"), data).detach(),
            no_padding_2_padding(tu.get(out, "entropy"), data).detach())


def _update(worker, batch, entropy: bool, world: int):
    """One update_actor as RayPPOTrainer._update_actor calls it; returns verl's metrics and every
    parameter's full gradient at the optimizer step."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    data = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(data, calculate_entropy=entropy, distillation_use_topk=False, distillation_only=False,
                         global_batch_size=ROWS * world, mini_batch_size=ROWS * world, epochs=1, seed=42,
                         dataloader_kwargs={"shuffle": False}, compute_loss=True)
    engine = worker.actor.engine
    grads, step = {}, engine.optimizer.step

    def step_and_keep_grads(*args, **kwargs):
        for name, param in engine.module.named_parameters():
            grads[name] = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad.clone()
        return step(*args, **kwargs)

    engine.optimizer.step = step_and_keep_grads
    metrics = tu.get(worker.update_actor(data), "metrics")
    return {k: float(v[0]) for k, v in metrics.items() if k.startswith("actor/") or k in ("loss", "kl_loss")}, grads


def _build(model_dir, mode, agg, remove_padding, regularized, fused, world):
    from verl.workers.engine_workers import ActorRolloutRefWorker

    worker = ActorRolloutRefWorker(_config(_overrides(model_dir, mode, agg, remove_padding, regularized, fused, world)),
                                   role="actor")
    worker.init_model()
    return worker


def _step(model_dir, rank, old, mode, agg, remove_padding, regularized, fused, world):
    worker = _build(model_dir, mode, agg, remove_padding, regularized, fused, world)
    forward = type(worker.actor.engine.module).forward
    log_probs, entropy = _log_probs(worker, _batch(rank, None))
    metrics, grads = _update(worker, _batch(rank, old), regularized, world)
    return dict(log_probs=log_probs, entropy=entropy, metrics=metrics, grads=grads, forward=forward)


def _compare(got: dict, want: dict, mask: torch.Tensor) -> dict:
    errors = {"log_probs": float((got["log_probs"] - want["log_probs"])[mask].abs().max()),
              "entropy": float((got["entropy"] - want["entropy"])[mask].abs().max())}
    for key, value in want["metrics"].items():
        errors[key] = abs(got["metrics"][key] - value) / max(abs(value), 1e-6)
    errors["grad"] = worst(relative_errors(got["grads"], want["grads"]))
    return errors


def _batch_invariant_run(model_dir, rank, world) -> dict:
    """compute_log_prob of a fused gk_gspo worker built with the batch_invariant key; the
    `linear` of every fused-linear call it made (a spy on the call)."""
    from verl.workers.engine_workers import ActorRolloutRefWorker

    import gspo_kernels.integrations.verl as gk_verl
    from gspo_kernels.integrations import head

    seen, plain = [], head.fused_linear_selective_log_softmax

    def spy(*args, linear=None, **kwargs):
        seen.append(linear)
        return plain(*args, linear=linear, **kwargs)

    keys = _overrides(model_dir, "gk_gspo", "token-mean", True, False, True, world)
    keys.append("+actor_rollout_ref.model.fused_kernel_options.batch_invariant=true")
    worker = ActorRolloutRefWorker(_config(keys), role="actor")
    worker.init_model()
    head.fused_linear_selective_log_softmax = spy
    try:
        log_probs = _log_probs(worker, _batch(rank, None))[0]
    finally:
        head.fused_linear_selective_log_softmax = plain
    module = worker.actor.engine.module
    return {"calls": [repr(linear) for linear in seen], "module": type(module).__name__,
            "attribute": repr(getattr(module, gk_verl.LINEAR_ATTRIBUTE, None)), "log_probs": log_probs}


def _worker(rank: int, port: int, out: str, world: int) -> None:
    join(rank, world, port)
    os.environ["VERL_USE_EXTERNAL_MODULES"] = "gspo_kernels.integrations.verl"
    import verl_cpu_platform  # noqa: F401  (before verl picks its platform)

    import gspo_kernels.integrations.verl as gk_verl
    from gspo_kernels.testing.tiny import tiny_llama, tiny_tokenizer

    models = {}
    for tied in (False, True):  # each rank its own copy, saved before the group exists (transformers
        models[tied] = tempfile.mkdtemp()  # saves on the main process only once it does)
        tiny_llama(vocab=64, tied=tied).save_pretrained(models[tied])
        tiny_tokenizer().save_pretrained(models[tied])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = {"errors": {}, "fallback_warnings": [], "forwards": {}, "grad_norms": {}, "clipfrac": {}}
    mask = _batch(rank, None).batch["response_mask"].bool()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # verl's patch sets the forward on the model class, for the whole process, and does not
        # undo it: every unfused run goes first.
        old = {tied: _log_probs(_build(models[tied], "vanilla", "token-mean", False, False, False, world),
                                _batch(rank, None))[0] for tied in models}
        verl_runs = {}
        for fused in (False, True):
            for case in _cases(world):
                tied, remove_padding, regularized, mode, agg = case
                if not fused:
                    verl_runs[case] = _step(models[tied], rank, old[tied], mode, agg, remove_padding, regularized,
                                            False, world)
                ours = _step(models[tied], rank, old[tied], f"gk_{mode}", agg, remove_padding, regularized, fused,
                             world)
                name = "/".join([("tied" if tied else "untied"), ("rmpad" if remove_padding else "padded"),
                                 ("kl+entropy" if regularized else "plain"), mode, agg, "fused" if fused else "unfused"])
                result["errors"][name] = _compare(ours, verl_runs[case], mask)
                result["forwards"][name] = ours["forward"] is gk_verl.forward_with_gspo_kernels
                result["grad_norms"][name] = float(torch.stack([g.norm() for g in ours["grads"].values()]).norm())
                result["clipfrac"][name] = ours["metrics"]["actor/pg_clipfrac"]
        # +fused_kernel_options.batch_invariant=true through the worker: the model verl's engine
        # built and FSDP2 wrapped hands it to every fused-linear call of compute_log_prob
        result["batch_invariant"] = _batch_invariant_run(models[False], rank, world)
        want = verl_runs[PAIRWISE_CASES[0]]["log_probs"]
        result["batch_invariant"]["log_probs_error"] = float((result["batch_invariant"].pop("log_probs")
                                                              - want)[mask].abs().max())
        # what docs/trainers.md tells a verl user: the class keeps the fused forward
        later = _build(models[False], "vanilla", "token-mean", False, False, False, world)
        result["unfused_after_fused"] = type(later.actor.engine.module).forward is gk_verl.forward_with_gspo_kernels
    result["fallback_warnings"] = [str(w.message) for w in caught if "gspo_kernels" in str(w.message)]
    leave(rank, out, result)


@pytest.mark.parametrize("world", [1, 2])
def test_verl_actor_worker_against_verls_own_losses(world, tmp_path):
    result = run(_worker, world, tmp_path, world)
    errors = result["errors"]
    assert len(errors) == 2 * len(_cases(world))
    for i, j in itertools.combinations(range(5), 2):  # the subset holds every pair of two settings' values
        pairs = {(case[i], case[j]) for case in _cases(world)}
        assert pairs == {(a, b) for a, b in itertools.product(*({c[k] for c in ALL_CASES} for k in (i, j)))}
    assert result["fallback_warnings"] == []
    assert result["unfused_after_fused"]
    invariant = result["batch_invariant"]  # the key reached the model FSDP2 wrapped, and each call
    assert invariant["module"].startswith("FSDP") and invariant["attribute"] == repr(LinearConfig(batch_invariant=True))
    assert invariant["calls"] and set(invariant["calls"]) == {repr(LinearConfig(batch_invariant=True))}, invariant
    assert invariant["log_probs_error"] < 1e-5, invariant  # against verl's own unfused log-probs
    # the fused runs ran our forward, and only they did
    assert all(result["forwards"][name] == name.endswith("/fused") for name in errors), result["forwards"]
    # the batch clips some tokens or sequences but not all, in every case, and trains every case
    assert all(0 < c < 1 for c in result["clipfrac"].values()), result["clipfrac"]
    assert all(n > 1e-3 for n in result["grad_norms"].values()), result["grad_norms"]
    worst = {}
    for name, e in errors.items():
        bad = {k: v for k, v in e.items()
               if not v <= (1e-5 if k in ("log_probs", "entropy") else 1e-4)}  # NaN is bad too
        if bad:
            worst[name] = bad
    assert not worst, worst
