"""gspo_kernels.integrations.megatron.slime.gspo_loss_function under slime's custom-loss contract,
at tensor parallel size 2 (2 gloo processes, megatron-core's own groups).

slime is not on PyPI and cannot be installed here, so the test builds slime's batch and calls
the function exactly as slime's loss_function does, `func(args, batch, logits,
sum_of_sample_mean)` with `logits` this rank's `[1, T, V/tp]` float32 shard
(slime/backends/megatron_utils/loss.py at THUDM/slime 624b824). The expected values are slime's
own formulas (slime_oracle.py), in float64 on the whole logits: loss, every metric slime
reports, and the shard's gradient.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_world import megatron_worker  # noqa: E402
from slime_oracle import RESPONSES, V, reducer, slime_args, slime_loss, whole_problem  # noqa: E402
from trainer_world import run  # noqa: E402

TP = 2

# name: (args, per-rollout denominators)
CASES = {
    "plain": (slime_args(), False),
    "entropy_and_kl": (slime_args(entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.05), False),
    "rollout_denominators": (slime_args(), True),
    "tis": (slime_args(use_tis=True), False),
    "mismatch_metrics": (slime_args(get_mismatch_metrics=True), False),
    "opsm": (slime_args(use_opsm=True, opsm_delta=-0.01), False),
    "tis_opsm_dual_clip_rollout_old": (slime_args(use_tis=True, use_opsm=True, opsm_delta=-0.01, eps_clip_c=1.5,
                                                  use_rollout_logprobs=True), False),
    "token_level_grpo_tis": (slime_args(advantage_estimator="grpo", use_tis=True), False),
}
REFUSED = {
    "custom_tis_function_path": ("custom_tis_function_path", "m.f"),
    "custom_pg_loss_reducer_function_path": ("custom_pg_loss_reducer_function_path", "m.f"),
    "rollout_top_p": ("rollout_top_p", 0.9),
    "cispo": ("advantage_estimator", "cispo"),
}


def _denominators(batch, per_rollout):
    if not per_rollout:
        return None
    sums = [m.sum() for m in batch["loss_masks"]]  # samples 0 and 1 one rollout group, 2 and 3 another
    return [sums[0] + sums[1], sums[0] + sums[1], sums[2] + sums[3], sums[2] + sums[3]]


def _slime_checks(rank):
    from gspo_kernels.integrations.megatron.slime import gspo_loss_function

    found, width = {}, V // TP
    for name, (args, per_rollout) in CASES.items():
        batch, whole = whole_problem()
        reduce = reducer(batch["loss_masks"], _denominators(batch, per_rollout))
        whole64 = whole.double().requires_grad_()
        want, want_metrics = slime_loss(args, batch, whole64, reduce)
        want.backward()
        shard = whole[None, :, rank * width:(rank + 1) * width].clone().requires_grad_()
        loss, report = gspo_loss_function(args, batch, shard, reduce)
        loss.backward()
        grad_want = whole64.grad[None, :, rank * width:(rank + 1) * width]
        found[name] = {
            "loss": float((loss.detach().double() - want.detach()).abs() / want.detach().abs()),
            "grad": float((shard.grad.double() - grad_want).norm() / grad_want.norm()),
            "metrics": {k: [float(report[k]), v] for k, v in want_metrics.items() if k in report},
            "keys": sorted(report),
            "want_keys": sorted(want_metrics),
        }
    for name, (key, value) in REFUSED.items():
        batch, whole = whole_problem()
        try:
            gspo_loss_function(slime_args(**{key: value}), batch, whole[None, :, :width],
                               reducer(batch["loss_masks"]))
            found["refused_" + name] = "no error"
        except NotImplementedError as exc:
            found["refused_" + name] = str(exc)
    return found


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run(megatron_worker, TP, tmp_path_factory.mktemp("slime"), TP, TP, _slime_checks)


@pytest.mark.parametrize("case", list(CASES))
def test_slime_contract_gives_slimes_loss_metrics_and_gradient(results, case):
    found = results[case]
    assert found["loss"] <= 1e-5 and found["grad"] <= 1e-5, found
    assert found["keys"] == found["want_keys"], found
    for key, (got, want) in found["metrics"].items():
        assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (key, got, want)


def test_the_cases_exercise_what_they_name(results):
    metrics = {name: {k: v[1] for k, v in results[name]["metrics"].items()} for name in CASES}
    # slime's pg_clipfrac is a sum of per-sample means: some samples clip, not all.
    assert 0.0 < metrics["plain"]["pg_clipfrac"] < len(RESPONSES) - 1
    assert metrics["tis"]["tis_clipfrac"] > 0.0 and metrics["opsm"]["opsm_clipfrac"] > 0.0
    assert metrics["tis"]["pg_loss"] != metrics["plain"]["pg_loss"]
    assert metrics["mismatch_metrics"]["pg_loss"] == metrics["tis"]["pg_loss"]  # slime applies TIS for either flag


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_slime_options_are_refused_by_name(results, name):
    message = results["refused_" + name]
    assert message.startswith("gspo_kernels' slime loss does not implement"), message
    flag = {"custom_tis_function_path": "--custom-tis-function-path", "rollout_top_p": "--rollout-top-p",
            "custom_pg_loss_reducer_function_path": "--custom-pg-loss-reducer-function-path", "cispo": "cispo"}[name]
    assert flag in message


@pytest.mark.parametrize("bounds", [(0.0, 2.0), (-1.0, 2.0), (0.5, float("inf")), (0.0, float("inf")), (0.99, 1.02)])
def test_tis_takes_every_range_slime_clamps_to(bounds):
    """The package's token-truncate correction under slime's TIS bounds gives slime's
    clamp(exp(old - rollout), tis_clip_low, tis_clip) for every non-empty range slime accepts (a
    bound at or below 0, or +inf, clamps nothing); an empty range is refused by name."""
    from types import SimpleNamespace

    from gspo_kernels.integrations.megatron import slime

    low, high = bounds
    rollout = torch.tensor([-1.0, -2.0, -0.5, -0.1])
    old = torch.tensor([-0.2, -3.0, -0.5, -4.0])
    report = {}
    weights = slime._tis(SimpleNamespace(tis_clip_low=low, tis_clip=high), {"rollout_log_probs": [rollout]}, old,
                         report, lambda x: x.sum())
    assert torch.equal(weights, torch.exp(old - rollout).clamp(low, high))
    assert "empty range" in slime._refusal(SimpleNamespace(use_tis=True, tis_clip_low=high, tis_clip=high), 1)
