"""TRL drop-in: `from gspo_kernels.integrations.trl import GRPOTrainer` instead of TRL's.

The subclass takes TRL's arguments unchanged. Its training loss runs the model's backbone,
then gspo_kernels' fused-linear token stats on the completion's hidden states and the
lm_head weight (log-probs and entropies, both differentiable, no logits kept), then
gspo_kernels' stage 2 (policy_loss) and TRL's entropy bonus; its no-grad log-prob passes
(old and reference policies) use the same fused-linear token stats. Every TRL
option is read from the trainer when the loss runs and mapped onto a GSPOConfig and a
normalizer that reproduce TRL's own numbers (options.py); an option this path cannot honour
sends that call to TRL's own code, with one warning naming it.

`GRPOConfig` is TRL's with the drop-in's own field, `batch_invariant` (passed to the fused-linear
token stats as LinearConfig.batch_invariant).

Tested against trl 1.16 (tests/integrations/); docs/trainers.md states the range.
"""

from __future__ import annotations

import types
import warnings
from dataclasses import dataclass, field

import torch
import trl
from accelerate.utils import is_peft_model

from ...config import GSPOConfig, LinearConfig
from ...token_stats.kept_set import SamplingFilter
from ...policy_loss import policy_loss
from ..announce import announce_fused
from ..head import head_token_stats
from ..model_logits import logit_scale_of, logit_softcap_of, unsupported_logit_transform
from . import options, rollout_kept
from .metrics import log_trl_metrics
from .options import MULTIMODAL_INPUTS, StepCounts, TRLSettings

if getattr(trl, "__file__", None) is None:  # a folder named trl on sys.path, not the package
    raise ImportError(f"the TRL drop-in needs TRL (pip install trl); 'import trl' found only a folder of that name: "
                      f"{list(trl.__path__)}")


@dataclass
class GRPOConfig(trl.GRPOConfig):
    """trl.GRPOConfig plus the drop-in's own option (also a command-line flag through TRL's parser).

    batch_invariant: the fused-linear head gives each completion token the same log-prob and
    entropy bits whatever batch its sequence is in (LinearConfig.batch_invariant,
    docs/fused_linear.md), in the training loss and the old and reference log-prob passes alike.
    The model body, which makes the hidden states, is not covered: it is batch-invariant only if
    the model runs in a batch-invariant mode of its own. A plain trl.GRPOConfig reads as False.

    sampling_aware_logprobs: the log-probs and entropies (training loss, old and reference
    passes) of the distribution the generation sampled from: the softmax renormalised over the
    tokens this config's top_k, top_p and min_p keep (token_stats/kept_set.py). Off (the
    default): TRL's full-softmax log-probs, as TRL's own trainer."""

    batch_invariant: bool = field(default=False, metadata={
        "help": "gspo_kernels: bitwise batch-invariant log-probs and entropies from the fused-linear lm_head "
                "(LinearConfig.batch_invariant); the model body is not covered."})
    sampling_aware_logprobs: bool = field(default=False, metadata={
        "help": "gspo_kernels: log-probs and entropies of the distribution the generation sampled from, the "
                "softmax renormalised over the tokens top_k, top_p and min_p keep (as vLLM's processed "
                "logprobs), in every log-prob pass; off: TRL's full-softmax ones."})


@dataclass(frozen=True)
class _StatsRequest:
    """What the patched forward computes instead of logits: the completion's token stats."""

    targets: torch.Tensor  # (B, C) completion ids
    mask: torch.Tensor  # (B, C) bool: the rows in the loss
    temperature: float
    logit_scale: float  # the model's own multiplier on its logits (model_logits.py)
    logit_softcap: float | None  # the model's own soft-cap (model_logits.py)
    head_in_fp32: bool
    linear: LinearConfig  # how the fused-linear call runs (options.linear_config)
    sampling: SamplingFilter | None = None  # the generation's kept set (options.sampling_filter)
    kept_tokens: object = None  # the engine's own sets of these rows (a KeptTokens), or None


def _install_stats_forward(model) -> None:
    """Wraps the model's forward so that `model(..., gspo_stats=request)` runs the backbone and
    returns the completion's (log-probs, entropies) from fused_linear_selective_log_softmax.

    It is called through the model as the trainer holds it (DDP, FSDP, accelerate wrappers),
    so their forward hooks and gradient synchronisation run as for any forward; the lm_head is
    called inside it (head.py), so its own wrapper's hooks run too."""
    previous = model.forward

    def forward(self, *args, gspo_stats: _StatsRequest | None = None, **kwargs):
        if gspo_stats is None:
            return previous(*args, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        completion = gspo_stats.targets.shape[1]
        hidden = hidden[:, -completion - 1:-1]  # the positions that predict the completion
        # Through the head's own call, so that a sharded head is unsharded (FSDP2) or gathered
        # (ZeRO-3) for it, as for its forward.
        return head_token_stats(self.get_output_embeddings(), hidden, gspo_stats.targets,
                                temperature=gspo_stats.temperature, logit_scale=gspo_stats.logit_scale,
                                logit_softcap=gspo_stats.logit_softcap, sampling=gspo_stats.sampling,
                                kept_tokens=gspo_stats.kept_tokens, mask=gspo_stats.mask,
                                dtype=torch.float32 if gspo_stats.head_in_fp32 else None, linear=gspo_stats.linear)

    model.forward = types.MethodType(forward, model)


class GRPOTrainer(trl.GRPOTrainer):
    """trl.GRPOTrainer whose log-probs, entropies and policy loss come from gspo_kernels."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        options.linear_config(TRLSettings.of(self))  # a bad batch_invariant fails here, not at the first step
        options.sampling_filter(TRLSettings.of(self))  # and so does a bad sampling_aware_logprobs
        self._gspo_warned: set[str] = set()
        self._gspo_in_fallback = False
        self._gspo_rollout = rollout_kept.RolloutKeptSets()
        _install_stats_forward(self.model.get_base_model() if is_peft_model(self.model) else self.model)
        if self.ref_model is not None:
            _install_stats_forward(self.ref_model)

    # --- the engine's kept sets, when the rollout gives them (rollout_kept.py) ---------------

    def _generate(self, prompts):
        out = super()._generate(prompts)
        self._gspo_rollout.take(out[5])  # extra_fields: the rollout_func's keys beyond TRL's own
        return out

    def _generate_and_score_completions(self, inputs):
        try:
            output = super()._generate_and_score_completions(inputs)
            kept_ids = self._gspo_rollout.padded(output["completion_ids"].size(0), output["completion_ids"].size(1),
                                                 output["completion_ids"].device)
            if kept_ids is not None:
                output[rollout_kept.FIELD] = kept_ids
            return output
        finally:
            self._gspo_rollout.clear()

    # --- what the fused path cannot do -----------------------------------------------------

    def _gspo_unsupported(self, model, inputs) -> str | None:
        if self.aux_loss_enabled:
            return "the MoE router auxiliary loss"
        if self.use_adaptive_entropy:
            return "use_adaptive_entropy (TRL's entropy-coefficient controller)"
        if any(inputs.get(key) is not None for key in MULTIMODAL_INPUTS):
            return "multimodal inputs"
        return options.unsupported_setting(TRLSettings.of(self)) or self._gspo_unsupported_model(model)

    def _gspo_unsupported_model(self, model) -> str | None:
        unwrapped = self.accelerator.unwrap_model(model)
        peft_config = getattr(unwrapped, "peft_config", None)
        if peft_config and any(getattr(c, "is_prompt_learning", False) for c in peft_config.values()):
            return "PEFT prompt learning (its virtual tokens enter through the PEFT wrapper)"
        transform = unsupported_logit_transform(unwrapped.config)
        if transform is not None:
            return f"a model whose logits are transformed ({transform})"
        return None

    def _gspo_plan(self, model, inputs) -> tuple[GSPOConfig | None, str | None]:
        """(the GSPOConfig for this call, None), or (None, why TRL's own code must run it)."""
        reason = self._gspo_unsupported(model, inputs)
        if reason is not None:
            return None, reason
        try:
            return self._trl_config(), None
        except ValueError as error:  # a setting TRL takes that our options refuse
            return None, f"these settings ({error})"

    def _gspo_fallback(self, reason: str) -> None:
        if reason not in self._gspo_warned:
            self._gspo_warned.add(reason)
            invariant = (" (batch_invariant does not reach TRL's code: these log-probs are TRL's)"
                         if TRLSettings.of(self).batch_invariant else "")
            warnings.warn(f"gspo_kernels: {reason} is not supported by the fused loss; this trainer runs TRL's own "
                          f"loss code for it{invariant}", stacklevel=3)

    def _gspo_stats(self, model, input_ids, attention_mask, completion_len: int, kept_ids=None):
        """(log-probs, entropies) of the completion tokens, through the model's patched forward.
        kept_ids: the engine's kept sets of the completion tokens, `(B, C, k)` padded with -1
        (rollout_kept.py), or None."""
        model_config = self.accelerator.unwrap_model(model).config
        mask = attention_mask[:, -completion_len:] != 0
        sampling = options.sampling_filter(TRLSettings.of(self))
        kept = None
        if kept_ids is not None:
            kept, mask = rollout_kept.as_kept_tokens(kept_ids, mask, model_config.vocab_size, sampling)
        request = _StatsRequest(input_ids[:, -completion_len:], mask, self.temperature, logit_scale_of(model_config),
                                logit_softcap_of(model_config), bool(self.args.cast_lm_head_to_fp32),
                                options.linear_config(TRLSettings.of(self)), sampling, kept)
        with self.accelerator.autocast():  # the trainer's mixed precision for the backbone, as TRL runs it
            return model(input_ids=input_ids, attention_mask=attention_mask, gspo_stats=request)

    # --- log-probs without a gradient (old and reference policies) ------------------------

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        if self._gspo_in_fallback or compute_aux_loss or any(v is not None for v in multimodal.values()) or \
                self._gspo_unsupported_model(model) is not None:
            self._gspo_rollout.refuse_unfused("TRL's own log-prob code")
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
        batch_size = batch_size or input_ids.size(0)
        kept_ids = self._gspo_rollout.padded(input_ids.size(0), logits_to_keep, input_ids.device)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            logp, entropy = self._gspo_stats(model, input_ids[rows], attention_mask[rows], logits_to_keep,
                                             None if kept_ids is None else kept_ids[rows])
            mask = attention_mask[rows, -logits_to_keep:] != 0
            # TRL's convention: zeros outside the completion.
            logps.append(torch.where(mask, logp, torch.zeros_like(logp)))
            entropies.append(torch.where(mask, entropy, torch.zeros_like(entropy)))
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None

    # --- the loss --------------------------------------------------------------------------

    def _trl_config(self) -> GSPOConfig:
        """GSPOConfig that computes TRL's per-token policy term for this trainer's options."""
        return options.gspo_config(TRLSettings.of(self))

    def _trl_normalizer(self, inputs, mask: torch.Tensor) -> torch.Tensor | float:
        """TRL's denominator for this loss type (options.normalizer), at this point of the step."""
        counts = StepCounts(training=self.model.training, accumulation_steps=self.current_gradient_accumulation_steps,
                            num_processes=self.accelerator.num_processes,
                            steps_per_generation=self.args.steps_per_generation,
                            num_items_in_batch=inputs.get("num_items_in_batch"))
        return options.normalizer(TRLSettings.of(self), counts, mask)

    def _entropy_threshold(self, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """TRL's top-entropy threshold: the quantile over every process's completion tokens."""
        local = entropy[mask].float()  # boolean indexing syncs, as TRL's own gather does
        sentinel = -1e9  # entropies are >= 0: padding can never pass for one
        gathered = self.accelerator.gather(self.accelerator.pad_across_processes(local, dim=0, pad_index=sentinel))
        gathered = gathered[gathered != sentinel]
        if gathered.numel() == 0:
            return torch.tensor(float("inf"), device=entropy.device)
        return torch.quantile(gathered, 1 - self.top_entropy_quantile)

    def _compute_loss(self, model, inputs):
        config, reason = self._gspo_plan(model, inputs)
        if reason is not None:
            if inputs.get(rollout_kept.FIELD) is not None:
                raise ValueError(f"gspo_kernels: the rollout gave the engine's kept sets ({rollout_kept.FIELD}), which "
                                 f"only the fused loss reads, but {reason} is not supported by it")
            self._gspo_fallback(reason)
            self._gspo_in_fallback = True  # TRL's code throughout, its log-prob pass included
            try:
                return super()._compute_loss(model, inputs)
            finally:
                self._gspo_in_fallback = False
        linear = options.linear_config(TRLSettings.of(self))
        announce_fused(f"TRL GRPOTrainer runs fused: loss_type={self.loss_type!r} on the fused-linear lm_head "
                       f"({'Triton tile kernels' if linear.fused else 'chunked'}"
                       f"{', batch-invariant' if linear.batch_invariant else ''}), no logits")
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        mask = inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
        mask = mask != 0
        # Stage 1 (fused linear: no logits) with both outputs differentiable, then stage 2 on them,
        # so that TRL's entropy bonus can be added on its own terms. The stats mask is the
        # completion's (tool tokens keep their log-probs for the metrics, as in TRL).
        logp, entropy = self._gspo_stats(model, input_ids, attention_mask, completion_ids.size(1),
                                         inputs.get(rollout_kept.FIELD))
        threshold = self._entropy_threshold(entropy.detach(), mask) if config.top_entropy_quantile < 1.0 else None
        rollout = inputs.get("sampling_per_token_logps") if config.rollout_correction or \
            config.off_policy_mask_threshold is not None else None
        loss, metrics = policy_loss(
            logp, inputs.get("old_per_token_logps"), inputs["advantages"], mask=mask, entropy=entropy,
            ref_logprobs=inputs.get("ref_per_token_logps") if self.beta != 0.0 else None,
            rollout_logprobs=rollout, normalizer=self._trl_normalizer(inputs, mask), entropy_threshold=threshold,
            config=config)
        if self.entropy_coef != 0.0:
            loss = self._with_entropy_bonus(loss, entropy, mask, threshold)
        log_trl_metrics(self, metrics, inputs, mask)
        return loss

    def _with_entropy_bonus(self, loss, entropy, mask, threshold):
        """TRL's bonus: a token mean of the entropy over the tokens the policy term acts on,
        divided by the accumulation steps whatever the loss type, times entropy_coef."""
        mode = "train" if self.model.training else "eval"
        acting = mask if threshold is None else mask & (entropy.detach() >= threshold)
        acting_f = acting.float()
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        bonus = (entropy * acting_f).sum() / acting_f.sum().clamp(min=1.0) / accumulation
        self._metrics[mode]["policy_loss"].append(
            self.accelerator.gather(loss.detach() * accumulation if self.loss_type not in ("dapo", "cispo", "vespo")
                                    else loss.detach()).nanmean().item())
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return loss - self.entropy_coef * bonus
