"""One TRL GRPOTrainer loss step (GRPOTrainer._compute_loss forward + backward, as its
training_step runs it) with TRL's own trainer and with the gspo_kernels drop-in, on two copies
of one tiny random Llama and the same batch: GSPO's settings (importance_sampling_level
"sequence", loss_type "grpo", epsilon 3e-4 / 4e-4, beta 0.04), `bf16=True` (the trainer's
autocast) or float32. Returns the loss and worst gradient errors and each path's peak memory.
Run by parity.py in a process of its own; trl_timing.py times the same step."""

from __future__ import annotations

import copy
import tempfile
import warnings

import torch

from parity_common import PeakMemory, rel, shifted_old, skipped, worst_grad

# bf16=True: TRL's fused head multiplies the bf16 hidden states by the lm_head in bf16 under the
# trainer's autocast, the drop-in's in float32 (docs/trainers.md), so the two differ by the bf16
# rounding of the logits. tests/integrations/trl_tests/test_trl_adapted.py::test_bf16 measured 1.3e-4 on
# the loss and 7.2e-3 on gradients on a CPU and holds them to 2e-2 and 3e-2; the same bounds
# here. float32: the parity tests' own bounds.
THEIRS, OURS = "TRL's own", "gspo_kernels drop-in"
TOLERANCES = {"bf16": {"loss": 2e-2, "grad": 3e-2}, "float32": {"loss": 1e-5, "grad": 1e-4}}


def _batch(trainer, rows: int, prompt: int, completion: int, vocab: int, device) -> dict:
    """A generation batch as TRL hands it to the loss: left-padded prompts, completions of
    several lengths, old log-probs +-0.05 per sequence off TRL's own (half the rows clip, half
    train), reference log-probs near them."""
    import trl

    gen = torch.Generator().manual_seed(1)
    prompt_mask = torch.ones(rows, prompt, dtype=torch.long)
    prompt_mask[0, : prompt // 2] = 0
    lengths = torch.randint(completion // 2, completion + 1, (rows,), generator=gen)
    completion_mask = (torch.arange(completion) < lengths[:, None]).long()
    prompt_ids = torch.randint(0, vocab, (rows, prompt), generator=gen)
    completion_ids = torch.randint(0, vocab, (rows, completion), generator=gen)
    batch = {k: v.to(device) for k, v in dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                                               completion_ids=completion_ids, completion_mask=completion_mask).items()}
    with torch.no_grad():
        current, _, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), completion)
    shifts = torch.tensor([0.05, -0.05] * rows)[:rows]
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0] * rows)[:rows] * (0.5 + torch.rand(rows, generator=gen))
    mask = batch["completion_mask"]
    batch.update(advantages=advantages.to(device), num_items_in_batch=mask.sum().float(),
                 old_per_token_logps=shifted_old(current, mask, shifts, gen),
                 ref_per_token_logps=shifted_old(current, mask, torch.zeros(rows), gen))
    return batch


def _step(trainer, batch, device):
    """Loss and every gradient of one _compute_loss + backward, and the step's peak memory."""
    trainer.model.zero_grad(set_to_none=True)
    with PeakMemory(device) as memory:
        loss = trainer._compute_loss(trainer.model, batch)
        loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach().float().cpu(), grads, memory


def run(args) -> dict:
    try:
        import datasets  # noqa: F401  (the trainers' dataset)
        import trl
    except ImportError as error:
        return skipped("TRL", error)
    from gspo_kernels.integrations.trl import GRPOTrainer
    from gspo_kernels.testing.tiny import tiny_grpo_trainer, tiny_llama

    device = torch.device(args.device)
    bf16 = args.dtype == "bf16"
    base = tiny_llama(vocab=args.vocab, hidden=args.hidden, layers=args.layers)
    trainers = {}
    for name, cls in ((THEIRS, trl.GRPOTrainer), (OURS, GRPOTrainer)):
        trainer = tiny_grpo_trainer(cls, copy.deepcopy(base).to(device), tempfile.mkdtemp(), bf16=bf16,
                                    use_cpu=device.type == "cpu", importance_sampling_level="sequence",
                                    loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4,
                                    max_completion_length=args.completion)
        trainer.beta = 0.04  # after construction: with beta > 0 there, TRL would load a reference model by name
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        trainers[name] = trainer
    batch = _batch(trainers[THEIRS], args.rows, args.prompt, args.completion, args.vocab, device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for trainer in trainers.values():  # warm-up: Triton compiles, allocator caches fill
            _step(trainer, batch, device)
        (want_loss, want_grads, theirs), (loss, grads, ours) = (_step(t, batch, device) for t in trainers.values())
    fallbacks = sorted({str(w.message) for w in caught if "gspo_kernels:" in str(w.message)})
    name, grad_error = worst_grad(grads, want_grads)
    tol = TOLERANCES[args.dtype]
    return {"trainer": "TRL", "setting": f"GRPOTrainer loss step, trl {trl.__version__}, {args.dtype}, "
                                         f"{args.rows} x {args.completion} completion tokens, V = {args.vocab}",
            "memory": [theirs.row(THEIRS), ours.row(OURS)],
            "checks": [{"what": "loss", "error": rel(loss, want_loss), "tolerance": tol["loss"]},
                       {"what": f"worst gradient ({name})", "error": grad_error, "tolerance": tol["grad"]},
                       {"what": "fallback warnings", "error": len(fallbacks), "tolerance": 0}],
            "notes": fallbacks + [f"loss {float(loss):.6g} (TRL {float(want_loss):.6g}), "
                                  f"{len(grads)} parameters with gradients, clip_ratio/region_mean "
                                  f"{_clip_ratio(trainers[OURS])} (TRL {_clip_ratio(trainers[THEIRS])})"]}


def _clip_ratio(trainer):
    """The last step's clipped fraction as the trainer logged it."""
    values = trainer._metrics["train"].get("clip_ratio/region_mean")
    return None if not values else round(values[-1], 4)
