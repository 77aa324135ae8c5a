"""KeptTokens.target_positions: each row's entry holding its target, or -1. On CPU tensors it is
one C++ pass (kept_target_positions, csrc/cpu/kept_softmax.cpp); elsewhere PyTorch ops. Both
must give the same positions, for targets in the set, absent from it, negative (a pad id) or
beyond the vocabulary, and for empty rows."""

import pytest
import torch

from gspo_kernels import KeptTokens
from gspo_kernels.backends import native_backend


def test_the_cpp_pass_and_the_pytorch_ops_agree(monkeypatch):
    if native_backend.load_error() is not None:
        pytest.skip("the native extension is not built")
    gen = torch.Generator().manual_seed(3)
    vocab, rows = 50, 400
    sets = [torch.randperm(vocab, generator=gen)[:int(torch.randint(0, 12, (), generator=gen))].tolist()
            for _ in range(rows)]
    kept = KeptTokens.from_lists(sets, vocab)
    targets = torch.randint(-2, vocab + 2, (rows,), generator=gen)
    targets[::7] = -100
    targets[1::5] = torch.tensor([s[-1] if s else 0 for s in sets[1::5]])  # the last entry of a row is found
    native = kept.target_positions(targets)
    monkeypatch.setattr(native_backend, "load_error", lambda: "off for this test")
    ops = kept.target_positions(targets)
    assert torch.equal(native, ops)
    hits = native >= 0
    assert 50 < int(hits.sum()) < rows  # both kinds of row occur
    assert torch.equal(kept.token_ids[native[hits]], targets[hits])
    assert all(targets[r] not in sets[r] for r in (~hits).nonzero().flatten().tolist())
