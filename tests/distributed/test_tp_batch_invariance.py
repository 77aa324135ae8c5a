"""batch_invariant=True with a tensor-parallel group (vocab slices, 2 and 3 gloo processes): a row's
log-prob, entropy and `d hidden` row are bitwise the same alone, at an offset, permuted and in
sub-batches, and two runs of the loss give bitwise the same loss and gradients (every rank's
`d weight` and `d bias` slices, the replicated `d hidden`), on every CPU backend's chunked path
and the Triton tile path (through its interpreter); the values still match one process's
within float tolerance. The product blocks are shrunk, as in tests/linear/test_batch_invariance.py,
so that each rank's slice (51 and 50 of 101 columns; 34, 34, 33) spans several vocab blocks and
36 rows several row blocks. On 3 ranks the cross-rank sums are the ones added in rank order
(distributed.collectives.sum_over_ranks): gloo's all_reduce gave a row other bits in another
batch there. The logits path (selective_log_softmax with tp_group, no option needed) is held
to the same per-row guarantee: its vocab merge adds in rank order too. docs/fused_linear.md,
"Batch invariance", says what holds and what does not.

The workers are spawned the way dist_harness.py spawns them (file init, one thread each); each
writes its failures, the parent merges them."""

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

HIDDEN, VOCAB, ROWS = 24, 101, 36
PICKED = (0, 17, 35)  # rows checked alone: their targets put on rank 0's slice, rank 1's, rank 0's


def _paths() -> list[tuple[str, bool, torch.dtype]]:
    """(backend, fused, dtype): the chunked path of every backend that runs on CPU tensors, both
    dtypes where it runs natively; the tile kernels in float32 (Triton's interpreter: numpy speed)."""
    from gspo_kernels import backends

    names = ["torch"] + (["cpu"] if backends.native_available() else [])
    paths = [(b, False, d) for b in names for d in (torch.float32, torch.bfloat16)]
    triton = backends.triton_backend
    if triton is not None and triton.INTERPRETED:
        paths.append(("triton", True, torch.float32))
    return paths


def _shrink_blocks() -> None:
    """16-row products, 16-column vocab blocks (and weight upcast blocks)."""
    from gspo_kernels.linear import invariant, products

    invariant.INVARIANT_ROWS["cpu"] = 16
    invariant.BLOCK_BYTES["cpu"] = 4 * HIDDEN * 16
    products.UPCAST_BLOCK_BYTES = 4 * HIDDEN * 16


def _operands(dtype, rows=ROWS, seed=7):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(rows, HIDDEN, generator=gen) * 0.6).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.6).to(dtype)
    bias = (torch.randn(VOCAB, generator=gen) * 0.2).to(dtype)
    targets = torch.randint(0, VOCAB, (rows,), generator=gen)
    coef = torch.rand(rows, 2, generator=gen) + 0.1  # upstream gradients that belong to the row
    return hidden, weight, bias, targets, coef


class _Rank:
    """This rank's vocab slice of the lm_head and the keywords the fused-linear calls take."""

    def __init__(self, rank: int, world: int, weight, bias):
        from gspo_kernels.testing.problem_split import even_parts

        self.start, stop = even_parts(VOCAB, world)[rank]
        self.weight, self.bias = weight[self.start:stop], bias[self.start:stop]
        self.full = (weight, bias)
        self.group = {"tp_group": dist.group.WORLD, "vocab_start": self.start}


def _stats(shard: _Rank, path, hidden, targets, coef, chunk_size, group=True):
    """(logp, entropy, d hidden) of rows `[n, H]` under the rank's slice (group=False: the whole
    vocabulary on this process alone)."""
    import gspo_kernels as gk

    backend, fused, _ = path
    leaf = hidden.detach().clone().requires_grad_()
    weight, bias = (shard.weight, shard.bias) if group else shard.full
    logp, entropy = gk.fused_linear_selective_log_softmax(
        leaf, weight, targets, bias=bias, return_entropy=True, backend=backend, fused=fused,
        batch_invariant=True, chunk_size=chunk_size, **(shard.group if group else {}))
    (logp * coef[:, 0] + entropy * coef[:, 1]).sum().backward()
    return logp.detach(), entropy.detach(), leaf.grad


def _unequal(got, want, where: str) -> list[str]:
    return [f"{name} differs {where} (max {float((a.double() - b.double()).abs().max()):.3g})"
            for name, a, b in zip(("logp", "entropy", "d hidden"), got, want) if not torch.equal(a, b)]


def _check_rows(rank: int, world: int, path) -> tuple[list[str], dict]:
    hidden, weight, bias, targets, coef = _operands(path[2])
    shard = _Rank(rank, world, weight, bias)
    from gspo_kernels.testing.problem_split import even_parts

    slices = even_parts(VOCAB, world)
    for row, owner in zip(PICKED, (0, world - 1, 0)):  # targets on different ranks' slices
        targets[row] = slices[owner][0] + 3
    failures = []
    whole = _stats(shard, path, hidden, targets, coef, chunk_size=7)
    for row in PICKED:
        alone = _stats(shard, path, hidden[row:row + 1], targets[row:row + 1], coef[row:row + 1], chunk_size=5)
        failures += _unequal(alone, [t[row:row + 1] for t in whole], f"for row {row} alone")
    extra = _operands(path[2], rows=9, seed=8)
    shifted = _stats(shard, path, torch.cat([extra[0], hidden]), torch.cat([extra[3], targets]),
                     torch.cat([extra[4], coef]), chunk_size=13)
    failures += _unequal([t[9:] for t in shifted], whole, "at an offset of 9 rows")
    order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(3))
    permuted = _stats(shard, path, hidden[order], targets[order], coef[order], chunk_size=None)
    failures += _unequal(permuted, [t[order] for t in whole], "permuted")
    for part in (slice(0, 20), slice(20, ROWS)):
        sub = _stats(shard, path, hidden[part], targets[part], coef[part], chunk_size=3)
        failures += _unequal(sub, [t[part] for t in whole], f"in sub-batch {part}")
    # The same rows on one process: equal within float tolerance; how many bits the split moved
    # is recorded, not asserted (docs/fused_linear.md states it).
    single = _stats(shard, path, hidden, targets, coef, chunk_size=7, group=False)
    # logp and entropy are float32 sums whatever the operands' dtype: 1e-5 for both (measured 9.5e-7
    # at most, float32 and bf16, AVX-512 + AMX Xeon). d hidden is written in the operands' dtype: for
    # bf16 one rounding apart, at most 1 ulp (2**-7 relative at a binade's low end; 5.8e-3 measured).
    moved = {}
    for name, a, b in zip(("logp", "entropy", "d hidden"), whole, single):
        one_bf16_ulp = name == "d hidden" and path[2] == torch.bfloat16
        tol = dict(rtol=2 ** -7, atol=1e-6) if one_bf16_ulp else dict(rtol=1e-5, atol=1e-6)
        if not torch.allclose(a.double(), b.double(), **tol):
            failures.append(f"{name} off the single-process value: {float((a.double() - b.double()).abs().max()):.3g}")
        moved[name] = int((a != b).sum())
    return failures, moved


def _logits_stats(shard: _Rank, backend: str, logits, targets, coef):
    """The logits path (selective_log_softmax on this rank's vocab slice of `logits [n, V]`):
    (logp, entropy, d logits slice)."""
    import gspo_kernels as gk

    leaf = logits[:, shard.start:shard.start + shard.weight.shape[0]].detach().clone().requires_grad_()
    logp, entropy = gk.selective_log_softmax(leaf, targets, 0.9, return_entropy=True, backend=backend,
                                             **shard.group)
    (logp * coef[:, 0] + entropy * coef[:, 1]).sum().backward()
    return logp.detach(), entropy.detach(), leaf.grad


def _check_logits_rows(rank: int, world: int, backend: str) -> list[str]:
    """The logits path needs no option: its vocab merge adds the ranks' sums in rank order."""
    hidden, weight, bias, targets, coef = _operands(torch.float32)
    shard = _Rank(rank, world, weight, bias)
    logits = (hidden @ weight.T + bias).to(torch.bfloat16)
    whole = _logits_stats(shard, backend, logits, targets, coef)
    failures = []
    for row in PICKED:
        alone = _logits_stats(shard, backend, logits[row:row + 1], targets[row:row + 1], coef[row:row + 1])
        failures += _unequal(alone, [t[row:row + 1] for t in whole], f"(logits path) for row {row} alone")
    order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(5))
    permuted = _logits_stats(shard, backend, logits[order], targets[order], coef[order])
    failures += _unequal(permuted, [t[order] for t in whole], "(logits path) permuted")
    for part in (slice(0, 20), slice(20, ROWS)):
        sub = _logits_stats(shard, backend, logits[part], targets[part], coef[part])
        failures += _unequal(sub, [t[part] for t in whole], f"(logits path) in sub-batch {part}")
    return failures


def _check_loss_reproducible(rank: int, world: int, path) -> list[str]:
    import gspo_kernels as gk

    backend, fused, dtype = path
    hidden, weight, bias, targets, _ = _operands(dtype)
    shard = _Rank(rank, world, weight, bias)
    gen = torch.Generator().manual_seed(11)
    batch, length = 4, ROWS // 4
    mask = torch.arange(length)[None] < torch.tensor([9, 4, 0, 7])[:, None]  # an empty sequence
    old = -torch.rand(batch, length, generator=gen) * 3 - 1.5
    advantages = torch.randn(batch, generator=gen)
    runs = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_() for t in (hidden.reshape(batch, length, HIDDEN), shard.weight,
                                                                shard.bias)]
        loss, _ = gk.fused_linear_gspo_loss(leaves[0], leaves[1], targets.reshape(batch, length), old, advantages,
                                            bias=leaves[2], mask=mask, backend=backend, fused=fused,
                                            batch_invariant=True, chunk_size=6, beta=0.05, entropy_coef=0.02,
                                            ref_logprobs=old + 0.1, **shard.group)
        loss.backward()
        runs.append([loss.detach()] + [t.grad for t in leaves])
    return [f"{name} differs between two runs" for name, a, b in
            zip(("loss", "d hidden", "d weight", "d bias"), *runs) if not torch.equal(a, b)]


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    _shrink_blocks()
    results = {}
    for path in _paths():
        name = f"{path[0]}{'-tiles' if path[1] else ''}-{str(path[2])[6:]}"
        try:
            failures, moved = _check_rows(rank, world, path)
            failures += _check_loss_reproducible(rank, world, path)
            if not path[1] and path[2] == torch.float32:
                failures += _check_logits_rows(rank, world, path[0])
        except Exception:  # recorded, so one broken path does not hide the others
            failures, moved = [traceback.format_exc(limit=6)], {}
        results[name] = {"failures": failures, "moved": moved}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    # os._exit: gloo's threads can abort a normal interpreter exit after the group is gone
    # ("terminate called without an active exception", 1 run in 4 here); the results are on disk.
    os._exit(0)


def run_tp_world(world: int, out_dir: str) -> dict:
    """Spawns `world` workers; returns {path: {"failures": [...] over the ranks, "moved": rank 0's}}."""
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world, os.path.join(out_dir, "init"), out_dir), nprocs=world, join=True)
    merged = {}
    for rank in range(world):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            for name, result in json.load(f).items():
                entry = merged.setdefault(name, {"failures": [], "moved": result["moved"]})
                entry["failures"] += [f"rank {rank}: {m}" for m in result["failures"]]
    return merged


@pytest.mark.parametrize("world", [2, 3])
def test_rows_invariant_and_runs_reproducible_under_tp(world, tmp_path):
    results = run_tp_world(world, str(tmp_path))
    assert set(results) == {f"{b}{'-tiles' if f else ''}-{str(d)[6:]}" for b, f, d in _paths()}
    failures = {name: r["failures"] for name, r in results.items() if r["failures"]}
    assert not failures, json.dumps(failures, indent=1)
