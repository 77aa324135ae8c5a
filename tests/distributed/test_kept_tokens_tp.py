"""The engine's kept sets under tensor parallelism (vocab slices, 2 gloo processes): each rank holds
the entries of its slice, and the merged log-probs, entropies, loss and gradients (this rank's
slice of d logits; d hidden summed over the group, this rank's rows of d weight and d bias) match
the float64 reference of the whole problem. Targets sit on both ranks' slices; one row's set lies
entirely on rank 1's slice (rank 0 holds none of it); slices of 31 and 30 columns.

Workers spawn as in dist_harness.py (file init, one thread each) and write their failures."""

from __future__ import annotations

import json
import os
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

VOCAB, ROWS, HIDDEN, SPLIT = 61, 12, 24, 31  # rank 0: [0, 31), rank 1: [31, 61)


def _problem():
    from gspo_kernels import KeptTokens

    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(ROWS, HIDDEN, generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN ** 0.5
    bias = 0.1 * torch.randn(VOCAB, generator=gen)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    sets = []
    for row, target in enumerate(targets.tolist()):
        if row == 3:  # the whole set on rank 1's slice
            target = int(targets[row] % 30) + SPLIT
            targets[row] = target
            ids = [SPLIT + i for i in torch.randperm(30, generator=gen)[:5].tolist()]
        else:
            ids = torch.randperm(VOCAB, generator=gen)[:9].tolist()
        if target not in ids:
            ids[0] = target
        sets.append(ids)
    return hidden, weight, bias, targets, KeptTokens.from_lists(sets, VOCAB)


def _close(got, want, tol, what, failures):
    err = float((got.double() - want.double()).abs().max())
    if not err <= tol:
        failures.append(f"{what}: max abs error {err:.3g} > {tol:.3g}")


def _check(rank: int) -> list[str]:
    import gspo_kernels as gk
    from gspo_kernels.testing import reference

    hidden, weight, bias, targets, kept = _problem()
    start, stop = (0, SPLIT) if rank == 0 else (SPLIT, VOCAB)
    group = dict(tp_group=dist.group.WORLD, vocab_start=start)
    up = torch.linspace(-1, 1, ROWS, dtype=torch.float64)
    failures = []
    # On logits: this rank's slice of them.
    logits = (hidden.double() @ weight.double().t() + bias.double())
    x = logits.float()[:, start:stop].clone().requires_grad_()
    logp, ent = gk.selective_log_softmax(x, targets, return_entropy=True, kept_tokens=kept, backend="torch", **group)
    (logp.double() * up + ent.double() * up.flip(0)).sum().backward()
    x64 = logits.clone().requires_grad_()
    logp64, ent64 = reference.selective_log_softmax(x64, targets, 1.0, True, kept_tokens=kept)
    (logp64 * up + ent64 * up.flip(0)).sum().backward()
    _close(logp, logp64, 2e-6, "logits: log-probs", failures)
    _close(ent, ent64, 2e-6, "logits: entropies", failures)
    _close(x.grad, x64.grad[:, start:stop], 2e-6, "logits: this slice's gradient", failures)
    # From hidden states: this rank's rows of the weight and bias; d hidden summed over the group.
    leaves = [hidden.clone().requires_grad_(), weight[start:stop].clone().requires_grad_(),
              bias[start:stop].clone().requires_grad_()]
    logp, ent = gk.fused_linear_selective_log_softmax(leaves[0], leaves[1], targets, bias=leaves[2],
                                                      return_entropy=True, kept_tokens=kept, temperature=0.9, **group)
    (logp.double() * up + ent.double() * up.flip(0)).sum().backward()
    leaves64 = [t.double().requires_grad_() for t in (hidden, weight, bias)]
    logp64, ent64 = reference.fused_linear_selective_log_softmax(*leaves64[:2], targets, bias=leaves64[2],
                                                                 return_entropy=True, kept_tokens=kept,
                                                                 temperature=0.9)
    (logp64 * up + ent64 * up.flip(0)).sum().backward()
    _close(logp, logp64, 2e-6, "hidden: log-probs", failures)
    _close(ent, ent64, 2e-6, "hidden: entropies", failures)
    _close(leaves[0].grad, leaves64[0].grad, 2e-6, "hidden: d hidden", failures)
    _close(leaves[1].grad, leaves64[1].grad[start:stop], 2e-6, "hidden: this slice's d weight", failures)
    _close(leaves[2].grad, leaves64[2].grad[start:stop], 2e-6, "hidden: this slice's d bias", failures)
    # The loss on logits.
    old, adv = -torch.rand(ROWS, generator=torch.Generator().manual_seed(2)) - 1, torch.randn(2)
    cu = torch.tensor([0, 5, ROWS])
    x = logits.float()[:, start:stop].clone().requires_grad_()
    loss, _ = gk.gspo_loss(x, targets, old, adv, cu_seqlens=cu, kept_tokens=kept, eps_low=0.2, eps_high=0.2, **group)
    loss.backward()
    x64 = logits.clone().requires_grad_()
    loss64, _ = reference.gspo_loss(x64, targets, old, adv, cu_seqlens=cu, kept_tokens=kept, eps_low=0.2,
                                    eps_high=0.2)
    loss64.backward()
    _close(loss, loss64, 2e-6, "loss", failures)
    _close(x.grad, x64.grad[:, start:stop], 2e-6, "loss: this slice's d logits", failures)
    return failures


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        failures = _check(rank)
    except Exception:
        failures = [traceback.format_exc(limit=8)]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(failures, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def test_kept_tokens_under_tensor_parallelism(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    failures = []
    for rank in range(2):
        failures += [f"rank {rank}: {m}" for m in json.loads((tmp_path / f"rank{rank}.json").read_text())]
    assert not failures, "\n".join(failures)
