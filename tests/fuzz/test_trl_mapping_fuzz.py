"""Differential fuzz of the TRL drop-in's option mapping against TRL 1.16's own loss code (issue 24).

Issue 24's item 5 lived in gspo_kernels/integrations/trl/options.py (vespo mapped to
level="sequence" whatever importance_sampling_level said): the loss agreed, only the gradients
told. This property draws TRL settings and a batch (TRLCase) and checks that gspo_kernels' loss
and its gradients with respect to the per-token log-probs and entropies equal those of
`trl.GRPOTrainer._compute_loss` itself, run on a stand-in trainer (trl_oracle.py says how, and
what is not covered): through `gk.policy_loss(config=gspo_config(TRLSettings.of(trainer)),
normalizer=<the drop-in's>)` and through the drop-in's own `_compute_loss`.

Drawn: every loss type the drop-in supports, both importance-sampling levels, beta 0 or > 0 (with
reference log-probs), use_bias_correction_kl, epsilon_low/high from 0 to large (cispo's cap from
below 1, which the drop-in hands to TRL, to 5), delta (None or above 1 + epsilon_high; TRL
ignores it outside the clipped types, so must the mapping), top_entropy_quantile 1 or below
(entropies drawn, ties at the quantile too), the off-policy mask (threshold None, 0 or above;
old log-probs or sampler log-probs, some NaN as vLLM's unscorable tokens), on-policy steps (no
old log-probs) and old log-probs equal to the current ones (exact ties on eps 0 bounds), the
entropy bonus, temperature, sapo/vespo parameters (non-default ones for every loss type, which
only sapo/vespo may read), completion masks with padding and empty completions, tool masks,
training or eval, gradient accumulation, steps_per_generation, processes and num_items_in_batch
(the denominators), B 1-4 sequences of T 1-8 tokens, float64.

Budget: TRL_EXAMPLES below in the ci profile (derandomized: the same examples every run; ~8 s of
examples, ~20 s with the imports of trl and transformers, on a 2-core CPU), LONG_FACTOR
(fuzz_profiles) times as many in the long profile (GSPO_FUZZ_PROFILE=long; ~2.5 min). A failure
ends in a one-line repro (trl_oracle.py with the case's repr).

Caught: issue 24's item 5 put back (vespo at level="sequence"): the ci profile fails, shrunk to
vespo, token level, beta 0.04, use_bias_correction_kl, on-policy, one row of 2 tokens, the loss
equal and the log-prob gradient 1.07e-3 apart. Found by the long profile (open when written):
dapo/bnpo/cispo/vespo pass a float32 normalizer tensor (options.normalizer, as TRL's own is), and
stage 2 takes its reciprocal in float32 (W = 1 / normalizer), where TRL divides the float64 sum
by it: the policy term is off by up to ~6e-8 relative, which exceeds 1e-6 of the loss when the
entropy bonus cancels most of it (repro in trl_oracle.py's terms: dapo, entropy_coef=0.01,
num_items_in_batch=56, seed=66180915, rows=3, tokens=4, zero_advantages, on-policy, eval).
"""

import pytest

from conftest import import_installed
from hypothesis import assume, event, given, note, settings
from hypothesis import strategies as st

import_installed("trl")

from fuzz_profiles import LONG_FACTOR, PROFILE  # noqa: E402
from gspo_kernels.integrations.trl.options import SUPPORTED_LOSS_TYPES  # noqa: E402
from trl_oracle import OLD_SPREAD, SAMPLING, TRLCase, build, check, near_kink, refused  # noqa: E402

# Examples in the ci profile (fuzz_profiles' CI_EXAMPLES has no share for this test); the long
# profile runs LONG_FACTOR times as many.
TRL_EXAMPLES = 1000
TRL_SETTINGS = settings(settings.get_profile(PROFILE),
                        max_examples=TRL_EXAMPLES * (LONG_FACTOR if PROFILE == "long" else 1))

CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


class LossMismatch(AssertionError):
    """gspo_kernels' loss or gradients differ from TRL's (hypothesis tells bugs apart by type)."""


class DropInFellBack(AssertionError):
    pass


@st.composite
def trl_cases(draw) -> TRLCase:
    loss_type = draw(st.sampled_from(SUPPORTED_LOSS_TYPES), label="loss_type")
    if loss_type == "cispo":  # its epsilon_high is the cap of the ratio; below 1 the drop-in refuses it
        epsilon_high = draw(st.sampled_from([1.0, 1.28, 2.0, 5.0, 0.2]))
    else:
        epsilon_high = draw(st.sampled_from([0.2, 0.0, 1e-3, 0.28, 1.0, 4.0]))
    delta = draw(st.one_of(st.none(), st.sampled_from([1e-3, 0.5, 3.0]).map(lambda d: 1.0 + epsilon_high + d)))
    sapo = draw(st.sampled_from([(1.0, 1.05), (0.5, 2.0)]))
    vespo = draw(st.sampled_from([(2.0, 3.0, 3.0, 2.0), (1.5, 2.5, 4.0, 1.0)]))
    tokens = draw(st.integers(1, 8))
    return TRLCase(
        loss_type=loss_type,
        importance_sampling_level=draw(st.sampled_from(["token", "sequence"])),
        epsilon_low=draw(st.sampled_from([0.2, 0.0, 1e-3, 0.5, 0.9])),
        epsilon_high=epsilon_high,
        beta=draw(st.sampled_from([0.0, 0.04, 0.5])),
        use_bias_correction_kl=draw(st.booleans()),
        delta=delta,
        top_entropy_quantile=draw(st.sampled_from([1.0, 0.8, 0.5, 0.2])),
        off_policy_mask_threshold=draw(st.sampled_from([None, 0.0, 0.01, 0.5])),
        entropy_coef=draw(st.sampled_from([0.0, 0.01, 0.3])),
        temperature=draw(st.sampled_from([1.0, 0.7])),
        sapo_temperature_pos=sapo[0], sapo_temperature_neg=sapo[1],
        vespo_k_pos=vespo[0], vespo_lambda_pos=vespo[1], vespo_k_neg=vespo[2], vespo_lambda_neg=vespo[3],
        max_completion_length=tokens + draw(st.integers(0, 8)),
        training=draw(st.booleans()),
        accumulation_steps=draw(st.integers(1, 4)),
        steps_per_generation=draw(st.integers(1, 4)),
        num_processes=draw(st.integers(1, 2)),
        num_items_in_batch=draw(st.integers(0, 64)),
        rows=draw(st.integers(1, 4)),
        tokens=tokens,
        seed=draw(st.integers(0, 2**32 - 1)),
        old=draw(st.sampled_from(list(OLD_SPREAD))),
        sampling=draw(st.sampled_from(SAMPLING)),
        tool_mask=draw(st.booleans()),
        entropy_ties=draw(st.booleans()),
        zero_advantages=draw(st.booleans()),
    )


@TRL_SETTINGS
@given(case=trl_cases())
def test_trl_mapping_matches_trls_own_loss(case):
    why = refused(case)
    if why is not None:
        event("skipped: the drop-in runs TRL's own code")
    assume(why is None)  # the drop-in runs TRL's own code there: nothing to compare
    kink = near_kink(case, build(case))
    if kink is not None:
        event("skipped: near a kink")
    assume(kink is None)
    event(f"loss_type={case.loss_type}")
    try:
        failures, report = check(case)
    except AssertionError as error:  # the stand-in's _gspo_fallback
        raise DropInFellBack(f"{error}\nrepro: {case.repro()}") from None
    if failures:
        note(f"report: {report}")
        raise LossMismatch("\n".join(failures) + f"\nrepro: {case.repro()}")
