"""The distributed keywords in one process: their errors, global_normalizer's, and a group of
one rank (gloo here; the GPU script runs the same check on NCCL), where every collective is
a no-op and the results must match the loss without groups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import gspo_kernels as gk
from gspo_kernels.testing.problems import ProblemSpec, make_problem
from gspo_kernels.testing.verify import linear_operands, run_group_of_one

from conftest import BACKENDS, device_for

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def _small():
    logits = torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    return logits, targets, torch.randn(2, 5) - 2.0, torch.randn(2)


def test_groups_need_an_initialized_process_group():
    # First in this file: the fixture below initializes torch.distributed for the later tests.
    if dist.is_initialized():
        pytest.skip("torch.distributed was initialized by another test")
    logits, targets, old, adv = _small()
    with pytest.raises(RuntimeError, match="not initialized"):
        gk.gspo_loss(logits, targets, old, adv, tp_group=object())
    with pytest.raises(RuntimeError, match="not initialized"):
        gk.gspo_loss(logits, targets, old, adv, cp_group=object())


def test_vocab_start_needs_tp_group():
    logits, targets, old, adv = _small()
    with pytest.raises(ValueError, match="needs tp_group"):
        gk.gspo_loss(logits, targets, old, adv, vocab_start=0)
    with pytest.raises(ValueError, match="needs tp_group"):
        gk.selective_log_softmax(logits, targets, vocab_start=3)


@pytest.fixture(scope="module")
def group_of_one(tmp_path_factory):
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    init = tmp_path_factory.mktemp("dist") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_bad_groups_and_slices(group_of_one):
    logits, targets, old, adv = _small()
    with pytest.raises(TypeError, match="ProcessGroup"):
        gk.gspo_loss(logits, targets, old, adv, tp_group="world")
    with pytest.raises(TypeError, match="ProcessGroup"):
        gk.gspo_loss(logits, targets, old, adv, cp_group=1)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="vocab_start"):
            gk.gspo_loss(logits, targets, old, adv, tp_group=group_of_one, vocab_start=bad)


def test_context_parallel_refuses_what_one_rank_cannot_know(group_of_one):
    logits, targets, old, adv = _small()
    with pytest.raises(ValueError, match="entropy_threshold"):
        gk.gspo_loss(logits, targets, old, adv, cp_group=group_of_one, top_entropy_quantile=0.2)
    gk.gspo_loss(logits, targets, old, adv, cp_group=group_of_one, top_entropy_quantile=0.2,
                 entropy_threshold=1.0)
    with pytest.raises(ValueError, match="max_len"):
        gk.gspo_loss(logits, targets, old, adv, cp_group=group_of_one, loss_agg="seq-mean-token-sum-norm")
    gk.gspo_loss(logits, targets, old, adv, cp_group=group_of_one, loss_agg="seq-mean-token-sum-norm", max_len=5)


def test_global_normalizer_errors(group_of_one):
    mask = torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="token-sum"):
        gk.distributed.global_normalizer(mask, "token-sum")
    with pytest.raises(ValueError, match="loss_agg"):
        gk.distributed.global_normalizer(mask, "mean")
    with pytest.raises(TypeError, match="bool"):
        gk.distributed.global_normalizer(mask.float(), "token-mean")
    with pytest.raises(ValueError, match="cu_seqlens"):
        gk.distributed.global_normalizer(mask.reshape(-1), "seq-mean-token-mean")
    with pytest.raises(ValueError, match="one per micro-batch"):
        gk.distributed.global_normalizer([mask, mask], "token-mean", cu_seqlens=[None])
    with pytest.raises(ValueError, match="empty list"):
        gk.distributed.global_normalizer([], "token-mean")


def test_global_normalizer_counts(group_of_one):
    mask = torch.tensor([[0, 1, 1], [0, 0, 0], [1, 0, 0]], dtype=torch.int32)
    assert float(gk.distributed.global_normalizer(mask, "token-mean", group_of_one)) == 3.0
    assert float(gk.distributed.global_normalizer(mask, "seq-mean-token-mean", group_of_one)) == 2.0
    cu = torch.tensor([0, 2, 2, 9])
    assert float(gk.distributed.global_normalizer(mask.reshape(-1), "seq-mean-token-sum", cu_seqlens=cu)) == 2.0
    empty = torch.zeros(2, 3, dtype=torch.bool)
    assert float(gk.distributed.global_normalizer(empty, "token-mean")) == 1.0  # as the loss clamps its count


@pytest.mark.parametrize("backend", [b for b in BACKENDS if device_for(b) == "cpu"])  # gloo: CPU tensors
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_group_of_one_matches_no_group(group_of_one, backend, packed):
    dtype = torch.float64 if backend == "torch" else torch.float32
    problem = make_problem(ProblemSpec(batch=3, seq_len=6, vocab=40, dtype=dtype, empty_sequence=True,
                                       temperature=0.8))
    if packed:
        problem = problem.to_packed()
    result = run_group_of_one(problem, backend, group_of_one, linear_operands(problem, hidden_size=8))
    assert result.passed, result.failures()
