"""TRL's options mapped onto gspo_kernels': a GSPOConfig and a normalizer that reproduce TRL's
own numbers, and the LinearConfig of the fused-linear token stats (`batch_invariant`, a field of
the drop-in's GRPOConfig). Plain values in, plain values out, so the mapping is testable without
TRL installed; trainer.py reads the settings off a live GRPOTrainer (`TRLSettings.of`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...config import GSPOConfig, LinearConfig
from ...token_stats.kept_set import SamplingFilter

SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
# Inputs of vision-language models: the fused path feeds text models only.
MULTIMODAL_INPUTS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
               "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")
_ROLLOUT_MODES = {"token_truncate": "token-truncate", "token_mask": "token-mask",
                  "sequence_truncate": "sequence-truncate", "sequence_mask": "sequence-mask"}
# CISPO's weight is clip(r, max=epsilon_high) in TRL: no lower bound, which eps_low just below
# 1 gives (GSPOConfig needs eps_low < 1).
_CISPO_EPS_LOW = 1.0 - 1e-9


@dataclass(frozen=True)
class TRLSettings:
    """The GRPOTrainer attributes and GRPOConfig arguments that the loss depends on."""

    loss_type: str = "grpo"
    importance_sampling_level: str = "token"
    temperature: float = 1.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    use_bias_correction_kl: bool = False
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    vllm_correction: bool = False  # use_vllm and vllm_importance_sampling_correction
    vllm_mode: str = "sequence_mask"
    vllm_clip_min: float | None = None
    vllm_clip_max: float | None = None
    max_completion_length: int = 256
    batch_invariant: bool = False  # the drop-in's GRPOConfig field (absent from TRL's own: False)
    sampling_aware_logprobs: bool = False  # the drop-in's GRPOConfig field (absent from TRL's own: False)
    top_k: int | None = 0  # the generation's sampler (TRL: top_k 0 and top_p 1 apply nothing)
    top_p: float = 1.0
    min_p: float | None = None

    @staticmethod
    def of(trainer) -> "TRLSettings":
        args = trainer.args
        return TRLSettings(
            loss_type=trainer.loss_type, importance_sampling_level=trainer.importance_sampling_level,
            temperature=trainer.temperature, epsilon_low=trainer.epsilon_low, epsilon_high=trainer.epsilon_high,
            beta=trainer.beta, use_bias_correction_kl=bool(args.use_bias_correction_kl),
            off_policy_mask_threshold=trainer.off_policy_mask_threshold,
            top_entropy_quantile=trainer.top_entropy_quantile, delta=args.delta,
            sapo_temperature_pos=args.sapo_temperature_pos, sapo_temperature_neg=args.sapo_temperature_neg,
            vespo_k_pos=args.vespo_k_pos, vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg,
            vespo_lambda_neg=args.vespo_lambda_neg,
            vllm_correction=bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction),
            vllm_mode=trainer.vllm_importance_sampling_mode,
            vllm_clip_min=trainer.vllm_importance_sampling_clip_min,
            vllm_clip_max=trainer.vllm_importance_sampling_clip_max,
            max_completion_length=trainer.max_completion_length,
            batch_invariant=getattr(args, "batch_invariant", False),
            sampling_aware_logprobs=getattr(args, "sampling_aware_logprobs", False),
            # The generation's sampler: read only with sampling_aware_logprobs (stand-ins may lack it).
            top_k=getattr(trainer, "top_k", 0), top_p=getattr(trainer, "top_p", 1.0),
            min_p=getattr(trainer, "min_p", None))


def unsupported_setting(settings: TRLSettings) -> str | None:
    """Why the fused loss cannot compute TRL's loss for these settings, or None."""
    if settings.loss_type not in SUPPORTED_LOSS_TYPES:
        return f"loss_type={settings.loss_type!r} (supported: {', '.join(SUPPORTED_LOSS_TYPES)})"
    if settings.importance_sampling_level not in ("token", "sequence"):
        return f"importance_sampling_level={settings.importance_sampling_level!r}"
    if settings.vllm_correction and settings.vllm_mode not in _ROLLOUT_MODES:
        return f"vllm_importance_sampling_mode={settings.vllm_mode!r}"
    if settings.vllm_correction and settings.loss_type == "vespo":
        # TRL folds the sampler's token ratios into VESPO's sequence weight; our rollout correction
        # multiplies the policy term instead.
        return "loss_type='vespo' with vLLM importance sampling"
    return None


def gspo_config(settings: TRLSettings) -> GSPOConfig:
    """GSPOConfig that computes TRL's per-token policy term for these settings (ValueError for
    one our options refuse)."""
    options = dict(level=settings.importance_sampling_level, temperature=settings.temperature,
                   eps_low=settings.epsilon_low, eps_high=settings.epsilon_high, beta=settings.beta,
                   kl_estimator="k3", use_bias_correction_kl=settings.use_bias_correction_kl,
                   off_policy_mask_threshold=settings.off_policy_mask_threshold,
                   top_entropy_quantile=settings.top_entropy_quantile,
                   log_ratio_clamp=(None, None))  # TRL exponentiates its log-ratios unclamped
    if settings.loss_type == "cispo":
        if not settings.epsilon_high >= 1.0:  # in TRL's terms: ours would say eps_high = epsilon_high - 1 < 0
            raise ValueError(f"loss_type='cispo' caps the importance ratio at epsilon_high = {settings.epsilon_high}, "
                             "below 1 (TRL sets epsilon_high to epsilon when it is left unset), so every ratio "
                             "above it is cut; the fused loss takes a cap >= 1: set GRPOConfig.epsilon_high")
        options.update(objective="cispo", eps_low=_CISPO_EPS_LOW, eps_high=settings.epsilon_high - 1.0)
    elif settings.loss_type == "sapo":
        options.update(objective="sapo", sapo_tau_pos=settings.sapo_temperature_pos,
                       sapo_tau_neg=settings.sapo_temperature_neg)
    elif settings.loss_type == "vespo":
        # Its weight is the sequence's product ratio at either level; importance_sampling_level
        # (kept in `level`) picks the ratio use_bias_correction_kl multiplies the KL by, as in TRL.
        options.update(objective="vespo", vespo_k_pos=settings.vespo_k_pos,
                       vespo_lambda_pos=settings.vespo_lambda_pos, vespo_k_neg=settings.vespo_k_neg,
                       vespo_lambda_neg=settings.vespo_lambda_neg)
    else:
        options.update(objective="clip", delta=settings.delta)
    # luspo (GSPO's length-unbiased form): each row's token sum, averaged over the rows.
    options["loss_agg"] = {"grpo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean",
                           "luspo": "seq-mean-token-sum"}.get(settings.loss_type, "token-mean")
    if settings.vllm_correction:
        # TRL's weights: exp(old - sampler) per token, or exp of the sum per sequence (a product),
        # truncated into or masked outside [clip_min, clip_max].
        options.update(rollout_correction=_ROLLOUT_MODES[settings.vllm_mode], rollout_sequence_weight="product",
                       rollout_is_min=settings.vllm_clip_min, rollout_is_max=settings.vllm_clip_max)
    return GSPOConfig(**options)


def linear_config(settings: TRLSettings) -> LinearConfig:
    """The LinearConfig of the fused-linear token stats (the log-prob passes and the loss) for
    these settings; TypeError for a batch_invariant that is not a bool."""
    value = settings.batch_invariant
    if not isinstance(value, bool):
        raise TypeError(f"GRPOConfig.batch_invariant must be True or False; got {value!r}")
    return LinearConfig(batch_invariant=value)


def sampling_filter(settings: TRLSettings) -> SamplingFilter | None:
    """The generation's kept set (TRL's top_k, top_p, min_p) when the drop-in's
    sampling_aware_logprobs asks for it, else None (TRL's full-softmax log-probs); TypeError for
    a flag that is not a bool."""
    if not isinstance(settings.sampling_aware_logprobs, bool):
        raise TypeError(f"GRPOConfig.sampling_aware_logprobs must be True or False; got "
                        f"{settings.sampling_aware_logprobs!r}")
    if not settings.sampling_aware_logprobs:
        return None
    top_k = settings.top_k if settings.top_k is not None and settings.top_k > 0 else None
    top_p = settings.top_p if settings.top_p is not None and settings.top_p < 1.0 else None
    min_p = settings.min_p if settings.min_p else None
    return SamplingFilter(top_k, top_p, min_p)


@dataclass(frozen=True)
class StepCounts:
    """Where in TRL's step the loss runs: what its denominators depend on besides the mask."""

    training: bool
    accumulation_steps: int  # the trainer's current gradient-accumulation steps
    num_processes: int
    steps_per_generation: int
    num_items_in_batch: torch.Tensor | None = None  # dapo, cispo: tokens of the generation batch


def normalizer(settings: TRLSettings, counts: StepCounts, mask: torch.Tensor) -> torch.Tensor | float:
    """TRL's denominator for this loss type, gradient accumulation included: a sequence
    mean divides by every row of the batch, empty completions included."""
    accumulation = counts.accumulation_steps if counts.training else 1
    rows = mask.size(0)
    if settings.loss_type in ("grpo", "sapo", "luspo"):
        return float(rows * accumulation)
    if settings.loss_type == "bnpo":
        return mask.sum().clamp(min=1.0).float() * accumulation
    if settings.loss_type == "dr_grpo":
        return float(rows * settings.max_completion_length * accumulation)
    # dapo, cispo: num_items_in_batch spans the generation batch, over every process
    count = counts.num_items_in_batch.clamp(min=1.0).float() / counts.num_processes
    if counts.training:
        count = count * counts.accumulation_steps / counts.steps_per_generation
    return count
