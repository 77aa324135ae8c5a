"""The TRL option mapping (integrations/trl/options.py) on plain values, without TRL installed:
which GSPOConfig and normalizer each loss type gets, which settings fall back, and the
LinearConfig that GRPOConfig.batch_invariant gives the fused-linear token stats."""

import types

import pytest
import torch

from gspo_kernels.config import LinearConfig
from gspo_kernels.integrations.trl.options import (SUPPORTED_LOSS_TYPES, StepCounts, TRLSettings, gspo_config,
                                                   linear_config, normalizer, unsupported_setting)


def test_clip_losses_map_onto_the_clip_objective():
    for loss_type, agg in (("grpo", "seq-mean-token-mean"), ("bnpo", "token-mean"), ("dr_grpo", "token-mean"),
                           ("dapo", "token-mean")):
        cfg = gspo_config(TRLSettings(loss_type=loss_type, importance_sampling_level="sequence", epsilon_low=3e-4,
                                      epsilon_high=4e-4, delta=1.5, beta=0.04, temperature=0.7))
        assert (cfg.objective, cfg.loss_agg, cfg.level) == ("clip", agg, "sequence")
        assert (cfg.eps_low, cfg.eps_high, cfg.delta, cfg.beta, cfg.temperature) == (3e-4, 4e-4, 1.5, 0.04, 0.7)
        assert cfg.log_ratio_clamp == (None, None) and cfg.kl_estimator == "k3"


def test_luspo_sums_each_row_and_averages_the_rows():
    cfg = gspo_config(TRLSettings(loss_type="luspo", importance_sampling_level="sequence", delta=2.0))
    assert (cfg.objective, cfg.loss_agg, cfg.level, cfg.delta) == ("clip", "seq-mean-token-sum", "sequence", 2.0)
    mask = torch.ones(4, 3, dtype=torch.bool)
    counts = StepCounts(training=True, accumulation_steps=3, num_processes=1, steps_per_generation=1)
    assert normalizer(TRLSettings(loss_type="luspo"), counts, mask) == 12.0


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_vespo_maps_onto_its_objective(level):
    # The level is importance_sampling_level's: VESPO's weight is the sequence's at either
    # level, but the ratio the KL's bias correction multiplies by is the level's.
    cfg = gspo_config(TRLSettings(loss_type="vespo", importance_sampling_level=level, vespo_k_pos=1.5,
                                  vespo_lambda_neg=2.5, beta=0.04, use_bias_correction_kl=True))
    assert (cfg.objective, cfg.level, cfg.loss_agg) == ("vespo", level, "token-mean")
    assert (cfg.beta, cfg.use_bias_correction_kl) == (0.04, True)
    assert (cfg.vespo_k_pos, cfg.vespo_lambda_pos, cfg.vespo_k_neg, cfg.vespo_lambda_neg) == (1.5, 3.0, 3.0, 2.5)


def test_cispo_and_sapo():
    cispo = gspo_config(TRLSettings(loss_type="cispo", epsilon_high=5.0))
    assert cispo.objective == "cispo" and cispo.eps_high == 4.0 and 1.0 - cispo.eps_low < 1e-8
    # TRL's own default for an unset epsilon_high is epsilon (0.2): the refusal speaks TRL's names.
    with pytest.raises(ValueError, match="loss_type='cispo' caps the importance ratio at epsilon_high = 0.2.*"
                                         "set GRPOConfig.epsilon_high"):
        gspo_config(TRLSettings(loss_type="cispo", epsilon_high=0.2))
    sapo = gspo_config(TRLSettings(loss_type="sapo", sapo_temperature_pos=0.9, sapo_temperature_neg=1.2))
    assert (sapo.objective, sapo.sapo_tau_pos, sapo.sapo_tau_neg, sapo.loss_agg) == (
        "sapo", 0.9, 1.2, "seq-mean-token-mean")


def test_vllm_correction_maps_onto_rollout_correction():
    cfg = gspo_config(TRLSettings(vllm_correction=True, vllm_mode="token_truncate", vllm_clip_min=0.5,
                                  vllm_clip_max=3.0))
    assert (cfg.rollout_correction, cfg.rollout_sequence_weight, cfg.rollout_is_min, cfg.rollout_is_max) == (
        "token-truncate", "product", 0.5, 3.0)
    assert gspo_config(TRLSettings()).rollout_correction is None


def test_unsupported_settings_are_named():
    assert unsupported_setting(TRLSettings()) is None
    assert "loss_type='made_up'" in unsupported_setting(TRLSettings(loss_type="made_up"))
    assert "importance_sampling_level" in unsupported_setting(TRLSettings(importance_sampling_level="sequence_token"))
    assert "vllm_importance_sampling_mode" in unsupported_setting(TRLSettings(vllm_correction=True, vllm_mode="odd"))
    assert unsupported_setting(TRLSettings(vllm_correction=False, vllm_mode="odd")) is None
    assert set(SUPPORTED_LOSS_TYPES) == {"grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"}
    assert unsupported_setting(TRLSettings(loss_type="vespo")) is None
    assert "vLLM" in unsupported_setting(TRLSettings(loss_type="vespo", vllm_correction=True, vllm_mode="token_mask"))
    with pytest.raises(ValueError, match="eps_low"):  # the trainer turns this into a warned fallback
        gspo_config(TRLSettings(epsilon_low=1.5))


def test_normalizers():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    train = StepCounts(training=True, accumulation_steps=2, num_processes=2, steps_per_generation=4,
                       num_items_in_batch=torch.tensor(24.0))
    evaluation = StepCounts(training=False, accumulation_steps=2, num_processes=2, steps_per_generation=4,
                            num_items_in_batch=torch.tensor(24.0))
    assert normalizer(TRLSettings(loss_type="grpo"), train, mask) == 8.0  # every row, times the accumulation
    assert normalizer(TRLSettings(loss_type="grpo"), evaluation, mask) == 4.0
    assert float(normalizer(TRLSettings(loss_type="bnpo"), train, mask)) == 12.0
    assert normalizer(TRLSettings(loss_type="dr_grpo", max_completion_length=5), train, mask) == 40.0
    # dapo: the generation batch's tokens per process, times accumulation / steps_per_generation
    assert float(normalizer(TRLSettings(loss_type="dapo"), train, mask)) == 24.0 / 2 * 2 / 4
    assert float(normalizer(TRLSettings(loss_type="cispo"), evaluation, mask)) == 12.0


def test_batch_invariant_maps_onto_the_linear_config():
    assert linear_config(TRLSettings()) == LinearConfig()  # TRL's own GRPOConfig has no such field: off
    assert linear_config(TRLSettings(batch_invariant=False)).batch_invariant is False
    assert linear_config(TRLSettings(batch_invariant=True)) == LinearConfig(batch_invariant=True)
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match=f"GRPOConfig.batch_invariant must be True or False; got {bad!r}"):
            linear_config(TRLSettings(batch_invariant=bad))
