"""Hypothesis strategies that draw whole FuzzCases: layout, sizes, dtypes, memory layouts, mask
forms, bad rows, the ratio plan and every GSPOConfig option, for one entry point and backend.

Lists are ordered simplest first because hypothesis shrinks towards the first element: a shrunk
failure then shows only the options, layouts and bad values it needs. The option tables are read
from gspo_kernels.config at draw time, so an objective or level added there is fuzzed at once.
"""

from __future__ import annotations

from dataclasses import fields

from hypothesis import strategies as st

from gspo_kernels import config as gk_config

from fuzz_case import FuzzCase, INJECTIONS
from fuzz_layouts import LOGITS_VIEWS, PER_TOKEN_LAYOUTS

PER_TOKEN_INPUTS = ("targets", "mask", "old", "ref", "rollout", "advantages")
# Objectives whose term a float32 inf ratio (positive advantage) cannot turn NaN: the clip (or
# the log-space clip, or VESPO's clamp of log w) bounds it. SAPO's gate would be 0 * inf.
OVERFLOW_SAFE = ("clip", "cispo", "gmpo", "vespo")


def _eps(draw, objective):
    if objective == "gmpo":  # log-space bounds (the paper: 0.4)
        return draw(st.sampled_from([(0.4, 0.4), (0.0, 0.4), (0.4, 0.0), (0.1, 0.2)]))
    if objective == "cispo":  # last: TRL's clip(r, max=epsilon_high) form
        return draw(st.sampled_from([(3e-4, 4e-4), (0.0, 0.28), (0.2, 0.0), (1 - 1e-9, 0.28)]))
    return (draw(st.sampled_from([3e-4, 0.0, 0.2])), draw(st.sampled_from([4e-4, 0.0, 0.28])))


@st.composite
def loss_options(draw, entry: str, packed: bool):
    """A valid GSPOConfig keyword dict (only GSPOConfig's own checks decide what is valid)."""
    objective = draw(st.sampled_from(gk_config.OBJECTIVES))
    level = draw(st.sampled_from(gk_config.OBJECTIVE_LEVELS[objective]))
    eps_low, eps_high = _eps(draw, objective)
    opts = {"objective": objective, "level": level, "eps_low": eps_low, "eps_high": eps_high}
    if entry != "policy_loss":  # the log-probs are given there: no temperature applies
        opts["temperature"] = draw(st.sampled_from([1.0, 0.7, 1.5]))
        opts["logit_scale"] = draw(st.sampled_from([1.0, 1.0, 0.3, 2.5]))  # a model's multiplier
        opts["logit_softcap"] = draw(st.sampled_from([None, None, 3.0, 30.0]))  # and soft-cap
    opts["loss_agg"] = draw(st.sampled_from(gk_config.LOSS_AGGS))
    if opts["loss_agg"] == "seq-mean-token-sum-norm":  # the horizon: required when packed
        opts["max_len"] = draw(st.integers(1, 12) if packed else st.one_of(st.none(), st.integers(1, 12)))
    opts["beta"] = draw(st.sampled_from([0.0, 0.05]))
    opts["kl_estimator"] = draw(st.sampled_from(gk_config.KL_ESTIMATORS))
    opts["kl_clamp"] = draw(st.sampled_from([None, 10.0, 0.02]))
    opts["use_bias_correction_kl"] = draw(st.booleans())
    opts["entropy_coef"] = draw(st.sampled_from([0.0, 0.01]))
    if objective == "clip":
        opts["delta"] = draw(st.sampled_from([None, round(1 + eps_high + 0.5, 6), round(1 + eps_high + 3.0, 6)]))
        opts["clip_ratio_c"] = draw(st.sampled_from([None, 3.0, 1.2]))
    if objective == "sapo" and draw(st.booleans()):
        opts.update(sapo_tau_pos=0.5, sapo_tau_neg=2.0)
    if objective == "vespo" and draw(st.booleans()):
        opts.update(vespo_k_pos=1.0, vespo_lambda_pos=2.0, vespo_k_neg=2.0, vespo_lambda_neg=1.0)
    correction = draw(st.sampled_from(gk_config.ROLLOUT_CORRECTIONS))
    opts["rollout_correction"] = correction
    if correction is not None:
        low, high = draw(st.sampled_from([(None, 2.0), (0.5, 2.0), (0.5, None), (None, 3.0)]))
        opts.update(rollout_is_min=low, rollout_is_max=high)
        opts["rollout_sequence_weight"] = draw(st.sampled_from(gk_config.ROLLOUT_SEQUENCE_WEIGHTS))
    opts["top_entropy_quantile"] = draw(st.sampled_from([1.0, 0.5, 0.2, 0.9]))
    opts["log_ratio_clamp"] = draw(st.sampled_from([(-20.0, 20.0), (None, None), (None, 10.0), (-5.0, 5.0)]))
    if entry == "gspo_loss":
        opts["inplace"] = draw(st.booleans())
    # Only what differs from GSPOConfig's defaults: the printed case then shows what matters.
    defaults = {f.name: f.default for f in fields(gk_config.GSPOConfig)}
    return {k: v for k, v in opts.items() if k not in defaults or defaults[k] != v}


def _zones(draw, n, opts):
    high = opts.get("log_ratio_clamp", (-20.0, 20.0))[1]
    allowed = ["inside", "above", "below", "far_above", "far_below"]
    if high is None and opts.get("objective", "clip") in OVERFLOW_SAFE and not opts.get("use_bias_correction_kl"):
        allowed.append("overflow")
    return tuple(draw(st.sampled_from(allowed)) for _ in range(n))


@st.composite
def fuzz_cases(draw, entry: str, backend: str):
    packed = draw(st.booleans())
    span = st.tuples(st.integers(0, 3), st.integers(0, 6), st.integers(0, 2))
    # Padded allows B = 0 (an empty batch); packed needs S >= 1 (cu_seqlens has S + 1 >= 2 entries)
    # but allows N = 0 (every sequence empty).
    spans = tuple(draw(st.lists(span, min_size=1 if packed else 0, max_size=5)))
    n_seq = len(spans)
    fused = entry == "fused_linear"
    dtypes = ["float32", "bfloat16", "float16"] + (["float64"] if backend == "torch" else [])
    views = tuple((name, draw(st.sampled_from(PER_TOKEN_LAYOUTS))) for name in PER_TOKEN_INPUTS
                  if draw(st.booleans()))
    mask_forms = ["bool", "int64", "int32", "uint8", "none"]
    if entry == "selective_log_softmax":
        mask_forms = ["none", "bool", "int64"]
    case = dict(
        entry=entry, backend=backend, seed=draw(st.integers(0, 2**31 - 1)), packed=packed, spans=spans,
        pad_extra=0 if packed else draw(st.integers(0, 2)), holes=draw(st.booleans()),
        vocab=draw(st.integers(3, 70)), logits_dtype=draw(st.sampled_from(dtypes)),
        logit_std=draw(st.sampled_from([2.0, 0.5, 6.0])),
        logits_view=draw(st.sampled_from(LOGITS_VIEWS[:5] if fused else LOGITS_VIEWS)),
        index_dtype=draw(st.sampled_from(["int64", "int32"])), cu_dtype=draw(st.sampled_from(["int64", "int32"])),
        logprob_dtype=draw(st.sampled_from(["float32", "float64"])), mask_form=draw(st.sampled_from(mask_forms)),
        views=views,
    )
    # A sampled token whose logit is -inf (log-prob -inf) is left to padding rows: docs/semantics.md
    # gives no rule for it in the response (the reference's value there is inf or NaN by accident).
    injection = st.tuples(st.sampled_from(INJECTIONS), st.sampled_from(["response", "padding"])).filter(
        lambda kp: kp != ("target_banned", "response"))
    # The engine's kept sets (loss entries and selective_log_softmax; the latter without the
    # sampling options, which describe the set another way). A response row's target is in its set,
    # so no bad id is injected: in the response one is refused (tests/loss), and an expanded
    # targets view would carry a padding row's to the response.
    if entry != "policy_loss":
        case["kept_sets"] = draw(st.sampled_from(["none", "none", "random", "sampler", "singletons", "whole"]))
    if case.get("kept_sets", "none") != "none":
        injection = injection.filter(lambda kp: kp[0] not in ("id_neg", "id_big"))
    case["injections"] = tuple(draw(st.lists(injection, max_size=2)))
    if backend == "triton":
        case["triton_block_v"] = draw(st.sampled_from([None, 16]))
    if entry == "selective_log_softmax":
        case["return_entropy"] = draw(st.booleans())
        if draw(st.booleans()):
            case["options"] = {"temperature": draw(st.sampled_from([0.7, 1.5])), "inplace": draw(st.booleans()),
                               "logit_scale": draw(st.sampled_from([1.0, 0.3, 2.5])),
                               "logit_softcap": draw(st.sampled_from([None, 3.0, 30.0])),
                               # The sampler's kept set: random targets fall outside it too (-inf
                               # log-probs, documented); the loss entries leave it to tests/loss.
                               **draw(st.sampled_from([{}, {"sampling_top_k": 3}, {"sampling_top_p": 0.6},
                                                       {"sampling_min_p": 0.2},
                                                       {"sampling_top_k": 5, "sampling_top_p": 0.8}]
                                                      if case["kept_sets"] == "none" else [{}]))}
        return FuzzCase(**case)

    opts = draw(loss_options(entry, packed))
    case["options"] = opts
    case["on_policy"] = draw(st.booleans())
    case["zones"] = _zones(draw, n_seq, opts)
    case["token_spread"] = draw(st.sampled_from([0.0, 0.05, 1e-3, 0.5]))
    case["signs"] = tuple(draw(st.sampled_from([1, -1, 0])) for _ in range(n_seq))
    case["adv_per_token"] = draw(st.booleans())
    case["padding_garbage"] = draw(st.booleans())
    case["with_ref"] = opts.get("beta", 0.0) > 0 or draw(st.booleans())
    needs_rollout = opts.get("rollout_correction") is not None
    case["off_policy"] = draw(st.booleans())
    rollout_options = ["given", "given_with_nan"] if needs_rollout else ["none"]
    if case["off_policy"] and not needs_rollout:
        rollout_options = ["none", "given", "given_with_nan"]
    case["rollout"] = draw(st.sampled_from(rollout_options))
    case["normalizer"] = draw(st.sampled_from(["none", "float", "tensor"]))
    if opts.get("top_entropy_quantile", 1.0) < 1.0:
        case["entropy_threshold"] = draw(st.sampled_from(["none", "float", "tensor"]))
    if case["off_policy"] or case.get("entropy_threshold", "none") != "none":
        case["pick"] = draw(st.sampled_from([0.5, 0.0, 0.99, 0.3]))
    if entry == "policy_loss":  # pass the entropy (required by entropy_coef and top_entropy_quantile)
        needed = opts.get("entropy_coef", 0.0) != 0.0 or opts.get("top_entropy_quantile", 1.0) < 1.0
        case["return_entropy"] = needed or draw(st.booleans())
    if fused:
        case.update(hidden=draw(st.sampled_from([8, 4, 16])), bias=draw(st.booleans()),
                    chunk_size=draw(st.sampled_from([None, 1, 3, 5, 8])), batch_invariant=draw(st.booleans()),
                    weight_transposed=draw(st.booleans()),
                    schedule=draw(st.sampled_from(["auto", "two_pass"])))
        if backend == "triton":
            case["fused"] = draw(st.booleans())
    return FuzzCase(**case)
