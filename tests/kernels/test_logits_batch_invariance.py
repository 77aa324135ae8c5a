"""The logits path is batch-invariant on every backend: selective_log_softmax gives a row the
same log-prob, entropy and logits gradient bitwise alone, at an offset, permuted, in a
sub-batch, padded or packed and as a strided view (one program per row, a fixed vocab block
order). Through Triton's interpreter, bfloat16 only (numpy speed). Under torch.compile: see
docs/fused_linear.md, "Batch invariance" (measured, not tested here: a compile costs ~20 s)."""

import pytest
import torch

import gspo_kernels as gk

from conftest import BACKENDS, device_for

ROWS, VOCAB = 30, 300


def _case(dtype, device, rows=ROWS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, VOCAB, generator=gen) * 3).to(dtype).to(device)
    targets = torch.randint(0, VOCAB, (rows,), generator=gen).to(device)
    coef = (torch.rand(rows, 2, generator=gen) + 0.1).to(device)  # each row's upstream gradients
    return logits, targets, coef


def _stats(backend, logits, targets, coef, fn=None, strided=False):
    """(logp, entropy, d logits) with the upstream gradient coef[row] for (logp, entropy)."""
    def step(x, t, c):
        logp, entropy = gk.selective_log_softmax(x, t, return_entropy=True, backend=backend)
        return logp, entropy, (logp * c[..., 0] + entropy * c[..., 1]).sum()

    leaf = logits.detach().clone().requires_grad_()
    view = leaf[:, :-1] if strided else leaf
    logp, entropy, loss = (fn or step)(view, targets, coef)
    loss.backward()
    return logp.detach(), entropy.detach(), leaf.grad[:, :-1] if strided else leaf.grad


def _assert_equal(got, want, where):
    for name, a, b in zip(("logp", "entropy", "d logits"), got, want):
        assert torch.equal(a, b), f"{name} differs {where}"


CASES = [(b, d) for b in BACKENDS for d in (torch.float32, torch.bfloat16)
         if not (b == "triton" and device_for(b) == "cpu" and d == torch.float32)]


@pytest.mark.parametrize("backend, dtype", CASES, ids=[f"{b}-{str(d)[6:]}" for b, d in CASES])
def test_rows_do_not_depend_on_the_batch(backend, dtype):
    device = device_for(backend)
    logits, targets, coef = _case(dtype, device)
    whole = _stats(backend, logits, targets, coef)
    _assert_equal(_stats(backend, logits[11:12], targets[11:12], coef[11:12]), [t[11:12] for t in whole], "alone")
    extra = _case(dtype, device, rows=5, seed=1)
    shifted = _stats(backend, *(torch.cat([a, b]) for a, b in zip(extra, (logits, targets, coef))))
    _assert_equal([t[5:] for t in shifted], whole, "at an offset")
    order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(2)).to(device)
    _assert_equal(_stats(backend, logits[order], targets[order], coef[order]), [t[order] for t in whole], "permuted")
    _assert_equal(_stats(backend, logits[4:21], targets[4:21], coef[4:21]), [t[4:21] for t in whole], "sub-batch")
    # padded (3, 10) with the strided view of a (3, 11, V) batch: the last column left out
    wide = torch.cat([logits.reshape(3, 10, VOCAB), extra[0][:3, None]], 1)
    strided = _stats(backend, wide, targets.reshape(3, 10), coef.reshape(3, 10, 2), strided=True)
    _assert_equal([t.reshape(ROWS, *t.shape[2:]) for t in strided], whole, "padded, strided")
