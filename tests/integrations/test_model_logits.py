"""model_logits: the multiplier and the refusals read from real transformers configs."""

import pytest

transformers = pytest.importorskip("transformers")

from gspo_kernels.integrations.model_logits import logit_scale_of, logit_softcap_of, unsupported_logit_transform  # noqa: E402,E501


@pytest.mark.parametrize("config, scale", [
    (lambda: transformers.LlamaConfig(), 1.0),
    (lambda: transformers.CohereConfig(logit_scale=0.0625), 0.0625),
    (lambda: transformers.Cohere2Config(logit_scale=0.25), 0.25),
    (lambda: transformers.GraniteConfig(logits_scaling=8.0), 0.125),
    (lambda: transformers.GraniteMoeConfig(logits_scaling=4.0), 0.25),
    # MiniCPM3's logits_scaling is hidden_size / dim_model_base (a property of its config).
    (lambda: transformers.MiniCPM3Config(hidden_size=640, num_attention_heads=40, dim_model_base=320), 0.5),
    (lambda: transformers.Gemma2Config(), 1.0),
])
def test_the_multiplier_follows_each_models_code(config, scale):
    assert logit_scale_of(config()) == scale


def test_what_the_kernels_cannot_apply_is_named():
    assert unsupported_logit_transform(transformers.LlamaConfig()) is None
    assert unsupported_logit_transform(transformers.CohereConfig(logit_scale=0.0625)) is None
    assert unsupported_logit_transform(transformers.GraniteConfig(logits_scaling=8.0)) is None
    assert unsupported_logit_transform(transformers.Gemma2Config(final_logit_softcapping=30.0)) is None
    # An attribute on a model type whose code this package has not read: its direction is unknown.
    unknown = transformers.LlamaConfig()
    unknown.logits_scaling = 3.0
    assert "logits_scaling of model type 'llama'" in unsupported_logit_transform(unknown)
    assert logit_scale_of(unknown) == 1.0


def test_the_soft_cap_is_read_where_a_model_has_one():
    assert logit_softcap_of(transformers.Gemma2Config(final_logit_softcapping=30.0)) == 30.0
    assert logit_softcap_of(transformers.Gemma2Config(final_logit_softcapping=None)) is None
    assert logit_softcap_of(transformers.LlamaConfig()) is None
