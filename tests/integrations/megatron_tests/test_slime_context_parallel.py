"""slime's custom-loss contract at context parallel size 2 (2 gloo processes, megatron-core's own
groups). Each rank gets what slime hands its loss there (THUDM/slime 624b824): the logits of its
load-balanced chunks of every sample (slice_with_cp: a sample padded to a multiple of 4 and cut
in 4 chunks; rank r keeps chunks r and 3 - r), its chunks' response tokens of every per-token list,
the whole loss masks, and slime's chunked reducer. The ranks' losses and metrics add up to the
whole problem's (slime_oracle.py, float64, context parallel size 1), and each rank's logits
gradient is its rows of the whole one (pad rows: exactly zero)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_world import megatron_worker  # noqa: E402
from slime_oracle import RESPONSES, TOTALS, V, cp_response_index, reducer, slime_args, slime_loss, whole_problem  # noqa: E402,E501
from trainer_world import run  # noqa: E402

CP = 2
CASES = {
    "plain": slime_args(),
    "entropy_kl_tis_opsm": slime_args(entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.05, use_tis=True,
                                      use_opsm=True, opsm_delta=-0.01),
    "token_level_grpo": slime_args(advantage_estimator="grpo"),
}
PER_TOKEN = ("advantages", "log_probs", "ref_log_probs", "rollout_log_probs")


def _this_rank(batch, whole, rank):
    """(batch, logits [1, rows, V], whole row of each local row or -1 for pad, reducer) as slime
    hands them to its loss on context-parallel rank `rank`."""
    local = {k: batch[k] for k in ("unconcat_tokens", "total_lengths", "response_lengths", "loss_masks")}
    lists = {k: [] for k in PER_TOKEN}
    rows, source, masks, lengths, offset = [], [], [], [], 0
    pad = torch.randn(1, V, generator=torch.Generator().manual_seed(rank))
    for i, (total, response) in enumerate(zip(TOTALS, RESPONSES)):
        chunk = (total + 2 * CP - 1) // (2 * CP)
        positions = list(range(rank * chunk, (rank + 1) * chunk)) + \
            list(range((2 * CP - 1 - rank) * chunk, (2 * CP - rank) * chunk))
        for p in positions:
            rows.append(whole[offset + p] if p < total else pad[0])
            source.append(offset + p if p < total else -1)
        _, index = cp_response_index(total, response, rank, CP)
        for k in PER_TOKEN:
            lists[k].append(batch[k][i][index])
        masks.append(batch["loss_masks"][i][index])
        lengths.append(len(index))
        offset += total
    local.update(lists)
    denoms = [m.sum() for m in batch["loss_masks"]]
    return local, torch.stack(rows)[None], torch.tensor(source), reducer(masks, denoms, lengths)


def _cp_checks(rank):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from gspo_kernels.integrations.megatron.slime import gspo_loss_function

    assert parallel_state.get_context_parallel_world_size() == CP
    found = {}
    for name, args in CASES.items():
        batch, whole = whole_problem(pad=0)
        whole64 = whole.double().requires_grad_()
        want, want_metrics = slime_loss(args, batch, whole64, reducer(batch["loss_masks"]))
        want.backward()
        local, logits, source, reduce = _this_rank(batch, whole, rank)
        logits.requires_grad_()
        loss, report = gspo_loss_function(args, local, logits, reduce)
        loss.backward()
        real = source >= 0
        grad_want = whole64.grad[source[real]]
        grad_err = torch.tensor([float((logits.grad[0, real].double() - grad_want).norm() / whole64.grad.norm()),
                                 float(logits.grad[0, ~real].abs().max()) if (~real).any() else 0.0])
        dist.all_reduce(grad_err, op=dist.ReduceOp.MAX)
        keys = sorted(k for k in report if k in want_metrics)
        sums = torch.tensor([float(loss.detach())] + [float(report[k]) for k in keys], dtype=torch.float64)
        dist.all_reduce(sums)
        found[name] = {
            "loss": [float(sums[0]), float(want.detach())],
            "metrics": {k: [float(s), want_metrics[k]] for k, s in zip(keys, sums[1:])},
            "missing": sorted(set(want_metrics) - set(report)),
            "grad": float(grad_err[0]), "pad_grad": float(grad_err[1]),
        }
    return found


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run(megatron_worker, CP, tmp_path_factory.mktemp("slime_cp"), CP, 1, _cp_checks, CP)


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_add_up_to_slimes_whole_loss_and_gradient(results, case):
    found = results[case]
    got, want = found["loss"]
    assert abs(got - want) <= 1e-5 * abs(want), found
    assert found["grad"] <= 1e-5 and found["pad_grad"] == 0.0, found
    assert found["missing"] == [], found
    for key, (got, want) in found["metrics"].items():
        assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (key, got, want)
