"""One verl actor update through verl 0.9.1's own actor worker (`ActorRolloutRefWorker`, role
actor, its FSDP2 engine and `apply_monkey_patch`), built from verl's Hydra `ppo_trainer` config
as tests/integrations/verl_tests/test_verl_actor.py builds it, in a world of one process: verl's own
`gspo` loss with its unfused forward against `gk_gspo` with the README's keys (`external_lib`,
`use_fused_kernels=True`, `impl_backend=gspo_kernels`). verl's mixed precision as it ships
(`param_dtype` bf16, bf16 autocast) or float32. Compares `compute_log_prob`'s log-probs and
entropies, the update's loss and every parameter's gradient at the optimizer step; peak memory of
each path's log-prob pass and update. Run by parity.py in a process of its own."""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist

from gspo_kernels.bench.ports import free_port
from parity_common import PeakMemory, rel, shifted_old, skipped, worst_grad

TEMPERATURE = 1.0
# bf16: both sides run the backbone under the same autocast with bf16 FSDP2 parameters; verl's
# own head makes bf16 logits (autocast) and returns bf16 log-probs and entropies, ours multiplies
# the same bf16 operands into float32 logits and returns float32. A bf16 value of magnitude
# log(V) is rounded to 2^-8 of itself (0.03 at 6). Log-probs are held to 2^-6 relative to
# max(|verl's value|, 1); entropies to 2^-5, as verl's own bf16 entropy rounds three times
# (logsumexp, the p * logits sum, their difference). Measured on a CPU: 5.6e-3 and 8.4e-3 at
# V = 4096, 6.0e-3 and 5.1e-3 at V = 32768. The loss and gradients: the TRL bf16 test's 2e-2 and
# 3e-2 (measured up to 2.7e-3 and 8.6e-3). float32: the verl actor test's bounds (relative 1e-5 on log-probs and entropies).
TOLERANCES = {"bf16": {"log_probs": 2**-6, "entropy": 2**-5, "loss": 2e-2, "grad": 3e-2},
              "float32": {"log_probs": 1e-5, "entropy": 1e-5, "loss": 1e-4, "grad": 1e-4}}


def _attention(device: torch.device) -> str:
    """verl's default flash_attention_2 where flash-attn is installed; else sdpa on a GPU and
    eager on a CPU (as the tests run it)."""
    if device.type == "cuda":
        return "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"
    return "eager"


def _overrides(model_dir: str, args, mode: str, fused: bool, attention: str) -> list[str]:
    actor = "actor_rollout_ref.actor"
    keys = [f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.model.external_lib=gspo_kernels.integrations.verl",
            # verl's default: padding-free micro-batches (transformers keeps packed sequences apart
            # by their position ids under sdpa and eager too; on a CPU, padded gave the same numbers)
            "actor_rollout_ref.model.use_remove_padding=True",
            f"actor_rollout_ref.model.use_fused_kernels={fused}",
            f"actor_rollout_ref.model.fused_kernel_options.impl_backend={'gspo_kernels' if fused else 'torch'}",
            f"+actor_rollout_ref.model.override_config.attn_implementation={attention}",
            f"{actor}.strategy=fsdp2", f"{actor}.policy_loss.loss_mode={mode}", f"{actor}.loss_agg_mode=token-mean",
            f"{actor}.clip_ratio_low=3e-4", f"{actor}.clip_ratio_high=4e-4",  # GSPO's
            f"{actor}.ppo_mini_batch_size={args.rows}", f"{actor}.ppo_micro_batch_size_per_gpu={args.rows}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.rows}",
            f"{actor}.use_dynamic_bsz=false",
            # verl compiles its unfused entropy by default; off on both sides (compile time, not the loss)
            f"{actor}.use_torch_compile=false", f"{actor}.fsdp_config.use_torch_compile=false",
            f"{actor}.optim.clip_grad=1e9",  # the optimizer sees the loss's own gradient
            "actor_rollout_ref.rollout.n=1", f"actor_rollout_ref.rollout.temperature={TEMPERATURE}"]
    if args.dtype == "float32":
        keys.append(f"++{actor}.fsdp_config.mixed_precision={{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}}")
    return keys


def _worker(model_dir: str, args, mode: str, fused: bool, attention: str):
    from hydra import compose, initialize_config_dir
    import verl.trainer.config
    from verl.workers.engine_workers import ActorRolloutRefWorker

    with initialize_config_dir(config_dir=os.path.dirname(verl.trainer.config.__file__), version_base=None):
        config = compose(config_name="ppo_trainer", overrides=_overrides(model_dir, args, mode, fused, attention))
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, role="actor")
    worker.init_model()
    return worker


def _batch(args, old_log_probs=None):
    """A padded rollout batch as verl's trainer holds it: left-padded prompts, right-padded
    responses of several lengths; with old log-probs +-0.05 per sequence off the policy's (half
    the rows clip, half train) and advantages."""
    from verl import DataProto

    gen = torch.Generator().manual_seed(7)
    rows, prompt, response = args.rows, args.prompt, args.completion
    prompt_len = torch.randint(prompt // 2, prompt + 1, (rows,), generator=gen)
    response_len = torch.randint(response // 2, response + 1, (rows,), generator=gen)
    prompt_mask = torch.arange(prompt)[None] >= (prompt - prompt_len)[:, None]
    response_mask = torch.arange(response)[None] < response_len[:, None]
    prompts = torch.randint(0, args.vocab, (rows, prompt), generator=gen) * prompt_mask
    responses = torch.randint(0, args.vocab, (rows, response), generator=gen) * response_mask
    attention = torch.cat([prompt_mask, response_mask], 1).long()
    tensors = dict(prompts=prompts, responses=responses, input_ids=torch.cat([prompts, responses], 1),
                   attention_mask=attention, position_ids=(attention.cumsum(1) - 1).clamp(min=0),
                   response_mask=response_mask.long())
    if old_log_probs is not None:
        shifts = torch.tensor([0.05, -0.05] * rows)[:rows]
        advantages = torch.tensor([1.0, 1.0, -1.0, -1.0] * rows)[:rows] * (0.5 + torch.rand(rows, generator=gen))
        tensors.update(old_log_probs=shifted_old(old_log_probs, response_mask, shifts, gen),
                       advantages=advantages[:, None] * response_mask)
    return DataProto.from_dict(tensors=tensors, meta_info={"temperature": TEMPERATURE})


def _log_probs(worker, batch, device):
    """As RayPPOTrainer._compute_old_log_prob asks for them; with the pass's peak memory."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    data = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(data, calculate_entropy=True, compute_loss=False)
    with PeakMemory(device) as memory:
        out = worker.compute_log_prob(data)
    log_probs = tu.get(out, "log_probs")
    return (no_padding_2_padding(log_probs, data).detach().float().cpu(),
            no_padding_2_padding(tu.get(out, "entropy"), data).detach().float().cpu(), memory, str(log_probs.dtype))


def _update(worker, batch, args, device):
    """One update_actor as RayPPOTrainer._update_actor calls it: verl's metrics, every
    parameter's full gradient at the optimizer step, and the peak memory up to that step (the
    forward and backward; the gradient copies and the optimizer's state come after)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    data = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(data, calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
                         global_batch_size=args.rows, mini_batch_size=args.rows, epochs=1, seed=42,
                         dataloader_kwargs={"shuffle": False}, compute_loss=True)
    engine = worker.actor.engine
    grads, step = {}, engine.optimizer.step
    memory = PeakMemory(device)

    def step_and_keep_grads(*a, **kw):
        memory.mark()
        for name, param in engine.module.named_parameters():
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            grads[name] = grad.detach().float().cpu()
        return step(*a, **kw)

    engine.optimizer.step = step_and_keep_grads
    with memory:
        metrics = tu.get(worker.update_actor(data), "metrics")
    return {k: float(v[0]) for k, v in metrics.items() if k.startswith("actor/") or k == "loss"}, grads, memory


def _run_path(model_dir, args, mode, fused, attention, device, old=None):
    worker = _worker(model_dir, args, mode, fused, attention)
    forward = type(worker.actor.engine.module).forward
    log_probs, entropy, lp_memory, lp_dtype = _log_probs(worker, _batch(args), device)
    if old is None:
        old = log_probs
    metrics, grads, memory = _update(worker, _batch(args, old), args, device)
    del worker
    return dict(log_probs=log_probs, entropy=entropy, metrics=metrics, grads=grads, forward=forward,
                lp_memory=lp_memory, memory=memory, old=old, lp_dtype=lp_dtype)


def _max_rel(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor) -> float:
    """The largest elementwise error relative to max(|want|, 1), over the response tokens."""
    return float(((got - want).abs() / want.abs().clamp(min=1.0))[mask].max())


def run(args) -> dict:
    device = torch.device(args.device)
    # As a verl user's Ray workers see it: set before verl is imported.
    os.environ["VERL_USE_EXTERNAL_MODULES"] = "gspo_kernels.integrations.verl"
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        if device.type == "cpu":
            # verl 0.9.1 has no CPU platform: the tests' registration, before verl picks its platform
            sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "integrations", "verl_tests"))
            import verl_cpu_platform  # noqa: F401
        import hydra  # noqa: F401  (verl's config)
        import verl
        from verl.workers.engine_workers import ActorRolloutRefWorker  # noqa: F401
    except ImportError as error:
        return skipped("verl", error)
    import gspo_kernels.integrations.verl as gk_verl
    from gspo_kernels.testing.tiny import tiny_llama, tiny_tokenizer

    model_dir = tempfile.mkdtemp()
    tiny_llama(vocab=args.vocab, hidden=args.hidden, layers=args.layers).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    attention = _attention(device)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # verl's patch sets the forward on the model class for the whole process: its own path first.
            want = _run_path(model_dir, args, "gspo", False, attention, device)
            got = _run_path(model_dir, args, "gk_gspo", True, attention, device, old=want["old"])
        fallbacks = sorted({str(w.message) for w in caught if "gspo_kernels" in str(w.message)})
    finally:
        dist.barrier()
        dist.destroy_process_group()
    mask = _batch(args).batch["response_mask"].bool()
    name, grad_error = worst_grad(got["grads"], want["grads"])
    tol = TOLERANCES[args.dtype]
    fused_ran = got["forward"] is gk_verl.forward_with_gspo_kernels and want["forward"] is not gk_verl.forward_with_gspo_kernels
    loss_key = "actor/pg_loss" if "actor/pg_loss" in want["metrics"] else "loss"
    return {"trainer": "verl",
            "setting": f"actor update (ActorRolloutRefWorker, FSDP2, world 1), verl {verl.__version__}, {args.dtype}, "
                       f"{attention}, {args.rows} x {args.completion} response tokens, V = {args.vocab}",
            "memory": [want["lp_memory"].row("verl's own: compute_log_prob"), want["memory"].row("verl's own: update"),
                       got["lp_memory"].row("gk_gspo fused: compute_log_prob"), got["memory"].row("gk_gspo fused: update")],
            "checks": [{"what": "log-probs (max relative)", "error": _max_rel(got["log_probs"], want["log_probs"], mask),
                        "tolerance": tol["log_probs"]},
                       {"what": "entropies (max relative)", "error": _max_rel(got["entropy"], want["entropy"], mask),
                        "tolerance": tol["entropy"]},
                       {"what": f"loss ({loss_key})", "error": rel(torch.tensor(got["metrics"][loss_key]),
                                                               torch.tensor(want["metrics"][loss_key])),
                        "tolerance": tol["loss"]},
                       {"what": f"worst gradient ({name})", "error": grad_error, "tolerance": tol["grad"]},
                       {"what": "fused forward ran only in the gk_gspo path", "error": 0 if fused_ran else 1, "tolerance": 0},
                       {"what": "fallback warnings", "error": len(fallbacks), "tolerance": 0}],
            "notes": fallbacks + [f"log-probs returned in {got['lp_dtype']} (verl's own: {want['lp_dtype']})",
                                  f"pg_clipfrac {got['metrics'].get('actor/pg_clipfrac')} (verl "
                                  f"{want['metrics'].get('actor/pg_clipfrac')}), loss {got['metrics'][loss_key]:.6g} "
                                  f"(verl {want['metrics'][loss_key]:.6g})"]}
