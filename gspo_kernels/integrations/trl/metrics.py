"""TRL's loss metrics under TRL's names, from the fused loss's detached outputs."""

from __future__ import annotations

import torch
import trl

from ...sequence.objectives import vespo_phi


def log_trl_metrics(trainer, metrics: dict, inputs, mask: torch.Tensor) -> None:
    """The metrics TRL's loss logs, from the loss's detached outputs, by TRL's formulas:
    means over every process's response tokens (or, for a per-sequence value, over every
    row), and per-sequence clip fractions reduced by min / max."""
    mode = "train" if trainer.model.training else "eval"
    zero = torch.zeros((), device=mask.device)
    # TRL's per-token tensors hold zeros outside the completion.
    logp = torch.where(mask, metrics["token_logprobs"], zero)
    entropy = torch.where(mask, metrics["entropy"], zero)
    old = inputs.get("old_per_token_logps")
    old = logp if old is None else torch.where(mask, old, zero)
    maskf = mask.float()
    rows = mask.size(0)
    if trainer.importance_sampling_level == "sequence":
        ratio = metrics["seq_ratio"].unsqueeze(1)  # one value per row
    else:
        ratio = torch.exp(logp - old)
    advantages = inputs["advantages"]
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages

    def global_mean(values: torch.Tensor) -> float:
        if values.size(1) == 1:
            local = torch.stack([values.sum(), torch.tensor(float(rows), device=values.device)])
        else:
            local = torch.stack([(values * maskf).sum(), maskf.sum()])
        total = trainer.accelerator.reduce(local, reduction="sum")
        return (total[0] / total[1].clamp(min=1.0)).item()

    def per_row(values: torch.Tensor) -> torch.Tensor:
        return values.squeeze(1) if values.size(1) == 1 else (values * maskf).sum(-1) / maskf.sum(-1)

    if trainer.beta != 0.0:
        log_gap = inputs["ref_per_token_logps"] - logp
        kl = torch.exp(log_gap) - log_gap - 1
        if trainer.args.use_bias_correction_kl:
            kl = kl * ratio
        trainer._metrics[mode]["kl"].append(global_mean(kl))
    trainer._metrics[mode]["entropy"].append(global_mean(entropy))
    if trainer.loss_type == "vespo":
        args = trainer.args
        log_w = ((logp - old) * maskf).clamp(-20.0, 20.0).sum(-1, keepdim=True)  # one weight per row
        phi = vespo_phi(log_w, advantages, args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg,
                        args.vespo_lambda_neg)
        trainer._metrics[mode]["vespo/phi_seq_mean"].append(global_mean(phi))
    elif trainer.loss_type == "cispo":
        clipped = ((ratio > trainer.epsilon_high) & (advantages > 0)).float()
        trainer._metrics[mode]["cispo_clip_ratio"].append(global_mean(clipped))
    elif trainer.loss_type != "sapo":
        low = ((ratio < 1 - trainer.epsilon_low) & (advantages < 0)).float()
        high = ((ratio > 1 + trainer.epsilon_high) & (advantages > 0)).float()
        trainer._metrics[mode]["clip_ratio/low_mean"].append(global_mean(low))
        trainer._metrics[mode]["clip_ratio/high_mean"].append(global_mean(high))
        trainer._metrics[mode]["clip_ratio/region_mean"].append(global_mean(torch.maximum(low, high)))
        gathered_low = trainer.accelerator.gather(per_row(low))
        gathered_high = trainer.accelerator.gather(per_row(high))
        trainer._metrics[mode]["clip_ratio/low_min"].append(trl.trainer.utils.nanmin(gathered_low).item())
        trainer._metrics[mode]["clip_ratio/high_max"].append(trl.trainer.utils.nanmax(gathered_high).item())
