"""What a Hugging Face causal LM does to its logits after the lm_head, read from its config, so
that a fused forward (which takes the hidden states and the head's weight, never the model's
logits) applies it too.

The kernels take the softmax of softcap_c(x * logit_scale) / temperature, softcap_c(y) =
c * tanh(y / c): the model's multiplier, then its soft-cap, then the trainer's temperature, the
order in which the models and the trainers apply them. The soft-cap is
`final_logit_softcapping` wherever a model has it (Gemma 2, 3, 3n, 4, VaultGemma, nanochat,
Mistral Large 4, MuseSpark: `logits / c`, tanh, `* c`, after any multiplier). A multiplier's
direction differs between models that share an attribute name, so it is read per model type,
from each model's code in transformers 5.24:

    cohere, cohere2, cohere2_moe           logits * config.logit_scale
    hyperclovax                            logits * config.logits_scaling
    muse_spark, muse_glimmer               logits * config.output_multiplier (then the soft-cap)
    granite, granite_swa, granitemoe, granitemoe_swa, granitemoeshared, granitemoehybrid
                                           logits / config.logits_scaling
    minicpm3                               hidden_states / config.logits_scaling (before a bias-free head)

A model with one of these attributes not in the table is reported as unsupported (its
direction is not known here): the trainers' drop-ins then run their own code for it.
"""

from __future__ import annotations

_MULTIPLY, _DIVIDE = "multiply", "divide"
_SCALES = {
    "cohere": ("logit_scale", _MULTIPLY), "cohere2": ("logit_scale", _MULTIPLY),
    "cohere2_moe": ("logit_scale", _MULTIPLY), "hyperclovax": ("logits_scaling", _MULTIPLY),
    "granite": ("logits_scaling", _DIVIDE), "granite_swa": ("logits_scaling", _DIVIDE),
    "granitemoe": ("logits_scaling", _DIVIDE), "granitemoe_swa": ("logits_scaling", _DIVIDE),
    "granitemoeshared": ("logits_scaling", _DIVIDE), "granitemoehybrid": ("logits_scaling", _DIVIDE),
    "minicpm3": ("logits_scaling", _DIVIDE),
    "muse_spark_text": ("output_multiplier", _MULTIPLY), "muse_glimmer_text": ("output_multiplier", _MULTIPLY),
}
_SCALE_NAMES = ("logit_scale", "logits_scaling", "output_multiplier", "lm_head_multiplier")


def _text_config(model_config):
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


def logit_scale_of(model_config) -> float:
    """The multiplier the model puts on its logits (1.0 when it puts none or is not in the table)."""
    text = _text_config(model_config)
    known = _SCALES.get(getattr(text, "model_type", None))
    if known is None:
        return 1.0
    name, direction = known
    value = getattr(text, name, None)
    if value is None:
        return 1.0
    return float(value) if direction == _MULTIPLY else 1.0 / float(value)


def logit_softcap_of(model_config) -> float | None:
    """The model's final_logit_softcapping (None when it has none)."""
    cap = getattr(_text_config(model_config), "final_logit_softcapping", None)
    return None if cap is None else float(cap)


def unsupported_logit_transform(model_config) -> str | None:
    """The model's logit transform that the fused kernels do not apply, if any."""
    text = _text_config(model_config)
    known = _SCALES.get(getattr(text, "model_type", None), (None, None))[0]
    for name in _SCALE_NAMES:
        if name != known and getattr(text, name, None) not in (None, 1, 1.0):
            return f"{name} of model type {getattr(text, 'model_type', None)!r}, whose direction is not known here"
    return None
