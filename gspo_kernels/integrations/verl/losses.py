"""gspo_kernels' policy losses in verl's registry: `loss_mode=gk_vanilla`, `gk_gspo`, `gk_sapo`,
`gk_cispo`, each taking verl's arguments and ActorConfig and computing verl's loss and metrics
with gspo_kernels.policy_loss (the package docstring lists what each mirrors). A setting verl
takes that our options refuse runs verl's own loss for it, with a warning once."""

from __future__ import annotations

import warnings

import torch
from verl.trainer.ppo.core_algos import get_policy_loss_fn, register_policy_loss

from ...config import GSPOConfig
from ...policy_loss import policy_loss
from ..announce import announce_fused


def _clip_range(config) -> tuple[float, float]:
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    return low, high


def _normalizer(loss_agg: str, info: dict):
    """verl's agg_loss denominators (global batch over dp_size) as our normalizer; None keeps
    ours, which is verl's local one."""
    dp_size = info.get("dp_size") or 1
    if loss_agg == "token-sum":
        return 1.0 / dp_size if dp_size != 1 else None
    total = info.get("batch_num_tokens") if loss_agg == "token-mean" else info.get("global_batch_size")
    if total is None:
        if dp_size > 1:
            raise ValueError(f"verl's loss_agg_mode={loss_agg!r} needs global_batch_info when dp_size > 1")
        return None
    return total / dp_size


def _mode_config(mode: str, config, loss_agg_mode: str, horizon: int) -> GSPOConfig:
    low, high = _clip_range(config)
    options = dict(eps_low=low, eps_high=high, loss_agg=loss_agg_mode)
    if mode == "vanilla":
        options.update(level="token", clip_ratio_c=config.get("clip_ratio_c", 3.0))
    elif mode == "gspo":  # verl's GSPO: s_i,t with a one-sided clamp (0.9.1 honours loss_agg_mode)
        options.update(level="sequence_token", log_ratio_clamp=(None, 10.0))
    elif mode == "sapo":
        options.update(level="token", objective="sapo", sapo_tau_pos=float(config.tau_pos),
                       sapo_tau_neg=float(config.tau_neg), eps_low=0.0, eps_high=0.0,
                       loss_agg="seq-mean-token-mean")
    elif mode == "cispo":
        options.update(level="token", objective="cispo")
    if options["loss_agg"] == "seq-mean-token-sum-norm":
        options["max_len"] = (config.global_batch_info.get("loss_scale_factor") or config.get("loss_scale_factor", None)
                              or horizon)
    return GSPOConfig(**options)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float((values * mask).sum() / (mask.sum() + 1e-8))


def _verl_metrics(mode: str, cfg: GSPOConfig, metrics: dict, old, log_prob, advantages, mask) -> dict:
    """verl's three policy metrics, by verl's formulas, from the detached inputs."""
    maskf = mask.float()
    log_ratio = (log_prob - old).detach()
    if mode != "gspo":
        log_ratio = log_ratio.clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    lower = 0.0
    if mode == "vanilla":
        clipped = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
        lower = _masked_mean(((torch.maximum(ratio, clipped) > cfg.clip_ratio_c) & (advantages < 0)).float(), maskf)
    clipfrac = 0.0 if mode == "sapo" else float(metrics["clip_frac"])
    return {"actor/pg_clipfrac": clipfrac, "actor/ppo_kl": _masked_mean(-log_ratio, maskf),
            "actor/pg_clipfrac_lower": lower}


_warned: set[str] = set()


def _make_loss(mode: str):
    def loss_fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                rollout_is_weights=None):
        assert config is not None, f"gk_{mode} needs verl's ActorConfig"
        try:
            cfg = _mode_config(mode, config, loss_agg_mode, response_mask.shape[-1])
        except ValueError as error:  # a setting verl takes that our options refuse (e.g. clip_ratio_low >= 1)
            reason = f"gk_{mode}: {error}"
            if reason not in _warned:
                _warned.add(reason)
                warnings.warn(f"gspo_kernels: {reason}; running verl's own {mode!r} loss for it", stacklevel=2)
            return get_policy_loss_fn(mode)(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                                            rollout_is_weights)
        announce_fused(f"verl's policy loss gk_{mode} runs gspo_kernels.policy_loss")
        mask = response_mask.bool()
        loss, metrics = policy_loss(log_prob.float(), old_log_prob.float(), advantages.float(), mask=mask,
                                    token_weights=rollout_is_weights,
                                    normalizer=_normalizer(cfg.loss_agg, dict(config.global_batch_info)),
                                    config=cfg)
        return loss, _verl_metrics(mode, cfg, metrics, old_log_prob, log_prob, advantages, mask)

    loss_fn.__name__ = f"compute_policy_loss_gk_{mode}"
    loss_fn.__doc__ = f"verl's {mode!r} policy loss, computed by gspo_kernels.policy_loss."
    return loss_fn


POLICY_LOSSES = {f"gk_{mode}": register_policy_loss(f"gk_{mode}")(_make_loss(mode))
                 for mode in ("vanilla", "gspo", "sapo", "cispo")}
