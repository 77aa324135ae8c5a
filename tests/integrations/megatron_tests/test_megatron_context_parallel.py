"""Context parallelism on megatron-core's own groups (context parallel size 2, 2 gloo processes):
each rank holds Megatron's load-balanced chunks of every sequence, cut by megatron-core's own
get_batch_on_this_cp_rank (a sequence in 4 chunks; rank r holds chunks r and 3 - r), and gspo_loss, with the CP group read from megatron.core.parallel_state, gives on every
rank the whole problem's loss and this rank's rows of the whole gradient (float64 reference)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_world import megatron_worker  # noqa: E402
from trainer_world import run  # noqa: E402

S, B, V, CP = 8, 2, 11, 2
CLIP = dict(eps_low=0.05, eps_high=0.01)


def _problem():
    gen = torch.Generator().manual_seed(9)
    logits = 2 * torch.randn(S, B, V, generator=gen)
    labels = torch.randint(0, V, (B, S), generator=gen)
    mask = torch.rand(B, S, generator=gen) > 0.2
    mask[:, 0] = True
    lp = torch.log_softmax(logits.double().transpose(0, 1), -1).gather(-1, labels[..., None])[..., 0]
    old = (lp + 0.03 * torch.randn(B, S, generator=gen, dtype=torch.float64)).float()
    old[0] -= 0.05  # sequence 0 (A > 0) clips
    return logits, labels, mask, old, torch.tensor([1.0, -0.6])


def _cp_checks(rank):
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    from gspo_kernels.integrations import megatron as gm
    from gspo_kernels.testing import reference

    assert parallel_state.get_context_parallel_world_size() == CP
    logits, labels, mask, old, adv = _problem()
    whole = logits.double().transpose(0, 1).contiguous().requires_grad_()
    ref_loss, ref_metrics = reference.gspo_loss(whole, labels, old, adv, mask=mask, **CLIP)
    ref_loss.backward()
    # megatron's own cut of a batch (every tensor along dim 1, the sequence) for this CP rank.
    mine = get_batch_on_this_cp_rank({"logits": logits.transpose(0, 1).contiguous(), "labels": labels, "old": old,
                                      "mask": mask.float(), "ref_grad": whole.grad})
    shard = mine["logits"].transpose(0, 1).contiguous().requires_grad_()  # Megatron's [s_local, b, V]
    loss, metrics = gm.gspo_loss(shard, mine["labels"], mine["old"], adv, loss_mask=mine["mask"], **CLIP)
    loss.backward()
    want = mine["ref_grad"].transpose(0, 1)
    return {
        "loss": float((loss.double() - ref_loss).abs() / ref_loss.abs()),
        "grad": float((shard.grad.double() - want).norm() / want.norm()),
        "clip_frac": [float(metrics["clip_frac"]), float(ref_metrics["clip_frac"])],
        "rows": int(shard.shape[0]),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run(megatron_worker, CP, tmp_path_factory.mktemp("cp"), CP, 1, _cp_checks, CP)


def test_context_parallel_chunks_give_the_whole_loss_and_this_ranks_gradient(results):
    got, want = results["clip_frac"]
    assert 0.0 < want < 1.0 and abs(got - want) <= 1e-6, results
    assert results["rows"] == S // CP
    assert results["loss"] <= 1e-5 and results["grad"] <= 1e-5, results
