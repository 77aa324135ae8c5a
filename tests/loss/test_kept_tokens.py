"""The engine's kept sets (kept_tokens, a KeptTokens): log-probs, entropies, the loss and the
gradients of the softmax over each row's set, on logits (every backend) and from hidden states
(the kept-rows products: C++ on a CPU, PyTorch ops elsewhere and for float64), against the float64
reference over the same sets; the bad inputs each refused with a message naming the row."""

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels import KeptTokens
from gspo_kernels.linear import kept_products
from gspo_kernels.token_stats import kept_softmax
from gspo_kernels.testing import reference

from conftest import BACKENDS, device_for


def _sets(targets: torch.Tensor, vocab: int, gen, sizes=(1, 9), empty_rows=()) -> KeptTokens:
    """Random sets of random sizes, each holding its row's target (rows in empty_rows: none)."""
    sets = []
    for row, target in enumerate(targets.reshape(-1).tolist()):
        if row in empty_rows:
            sets.append([])
            continue
        k = int(torch.randint(sizes[0], sizes[1] + 1, (), generator=gen))
        ids = torch.randperm(vocab, generator=gen)[:k].tolist()
        if target not in ids:
            ids[int(torch.randint(0, k, (), generator=gen))] = target
        sets.append(ids)
    return KeptTokens.from_lists(sets, vocab)


def _close(got, want, tol, what):
    err = (got.double().cpu() - want.double().cpu()).abs().max().item() if got.numel() else 0.0
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"


MAPS = [dict(), dict(temperature=0.7), dict(logit_softcap=2.5, logit_scale=1.5, temperature=1.3)]


@pytest.mark.parametrize("rows", ["cpp", "torch-ops"])
@pytest.mark.parametrize("options", MAPS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_log_probs_entropies_and_gradient_on_logits(backend, dtype, options, rows, monkeypatch):
    """rows: the softmax over the sets in C++ (float32 on a CPU) or in the PyTorch ops a GPU runs."""
    if rows == "torch-ops":
        monkeypatch.setattr(kept_softmax, "_native", lambda z: False)
    gen = torch.Generator().manual_seed(1)
    logits = (2 * torch.randn(3, 5, 50, generator=gen)).to(dtype)
    targets = torch.randint(0, 50, (3, 5), generator=gen)
    kept = _sets(targets, 50, gen)
    up_logp, up_ent = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    device = device_for(backend)
    x = logits.to(device).clone().requires_grad_()
    logp, ent = gk.selective_log_softmax(x, targets.to(device), return_entropy=True, backend=backend,
                                         kept_tokens=kept.to(device), **options)
    ((logp * up_logp.to(device)).sum() + (ent * up_ent.to(device)).sum()).backward()
    x64 = logits.detach().double().requires_grad_()
    temperature = options.get("temperature", 1.0)
    rest = {k: v for k, v in options.items() if k != "temperature"}
    logp64, ent64 = reference.selective_log_softmax(x64, targets, temperature, True, kept_tokens=kept, **rest)
    ((logp64 * up_logp).sum() + (ent64 * up_ent).sum()).backward()
    _close(logp, logp64, 2e-6, "log-probs")
    _close(ent, ent64, 2e-6, "entropies")
    grad_tol = 2e-6 if dtype == torch.float32 else 8e-3 * x64.grad.abs().max().item()
    _close(x.grad, x64.grad, grad_tol, "d logits")
    outside = torch.ones(15, 50, dtype=torch.bool)
    outside[kept.row_index, kept.token_ids] = False
    assert (x.grad.reshape(15, 50).cpu()[outside] == 0).all(), "a logit outside its row's set got a gradient"


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_whole_vocabulary_gives_the_plain_result_and_a_singleton_log_prob_zero(backend):
    gen = torch.Generator().manual_seed(2)
    device = device_for(backend)
    logits = (3 * torch.randn(6, 40, generator=gen)).to(device)
    targets = torch.randint(0, 40, (6,), generator=gen).to(device)
    whole = KeptTokens.from_lists([list(range(40))] * 6, 40).to(device)
    x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got = gk.selective_log_softmax(x1, targets, 0.9, True, backend=backend, kept_tokens=whole)
    plain = gk.selective_log_softmax(x2, targets, 0.9, True, backend=backend)
    (got[0].sum() + got[1].sum()).backward()
    (plain[0].sum() + plain[1].sum()).backward()
    for a, b, what in ((got[0], plain[0], "logp"), (got[1], plain[1], "entropy"), (x1.grad, x2.grad, "grad")):
        _close(a, b, 2e-6, what)
    single = KeptTokens.from_lists([[t] for t in targets.tolist()], 40).to(device)
    x3 = logits.clone().requires_grad_()
    logp, ent = gk.selective_log_softmax(x3, targets, return_entropy=True, backend=backend, kept_tokens=single)
    (logp.sum() + ent.sum()).backward()
    assert (logp == 0).all() and (ent == 0).all() and (x3.grad == 0).all()


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_gspo_loss_with_kept_tokens_matches_the_reference(backend, packed):
    gen = torch.Generator().manual_seed(3)
    device = device_for(backend)
    if packed:
        logits = 2 * torch.randn(11, 30, generator=gen)
        targets = torch.randint(0, 30, (11,), generator=gen)
        shape_kw = dict(cu_seqlens=torch.tensor([0, 4, 11]))
        old, adv, mask = -torch.rand(11, generator=gen) - 1, torch.randn(2, generator=gen), None
        empty = ()
    else:
        logits = 2 * torch.randn(2, 6, 30, generator=gen)
        targets = torch.randint(0, 30, (2, 6), generator=gen)
        mask = torch.ones(2, 6, dtype=torch.bool)
        mask[1, 4:] = False  # padding: empty sets there, and a pad id
        targets[1, 4:] = -100
        shape_kw = dict(mask=mask)
        old, adv = -torch.rand(2, 6, generator=gen) - 1, torch.randn(2, generator=gen)
        empty = (10, 11)
    kept = _sets(targets.clamp(min=0), 30, gen, empty_rows=empty)
    options = dict(level="sequence", eps_low=0.2, eps_high=0.3, temperature=0.8, entropy_coef=0.01)
    x = logits.to(device).clone().requires_grad_()
    tensors = {k: v.to(device) for k, v in shape_kw.items()}
    loss, metrics = gk.gspo_loss(x, targets.to(device), old.to(device), adv.to(device), backend=backend,
                                 kept_tokens=kept.to(device), **tensors, **options)
    loss.backward()
    x64 = logits.detach().double().requires_grad_()
    loss64, metrics64 = reference.gspo_loss(x64, targets, old, adv, kept_tokens=kept, **shape_kw, **options)
    loss64.backward()
    _close(loss, loss64, 2e-6, "loss")
    _close(metrics["seq_ratio"], metrics64["seq_ratio"], 2e-6, "seq_ratio")
    _close(x.grad, x64.grad, 2e-6, "d logits")


def _linear_problem(rows, hidden, vocab, dtype, gen, bias=True, sizes=(1, 12)):
    h = torch.randn(rows, hidden, generator=gen).to(dtype)
    w = (torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    b = (0.1 * torch.randn(vocab, generator=gen)).to(dtype) if bias else None
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    return h, w, b, targets, _sets(targets, vocab, gen, sizes)


def _linear_grads(h, w, b, targets, kept, up, fn=gk.fused_linear_selective_log_softmax, **options):
    leaves = [t.detach().clone().requires_grad_() for t in (h, w) + ((b,) if b is not None else ())]
    logp, ent = fn(leaves[0], leaves[1], targets, bias=leaves[2] if b is not None else None, return_entropy=True,
                   kept_tokens=kept, **options)
    ((logp * up[0].to(logp.dtype)).sum() + (ent * up[1].to(ent.dtype)).sum()).backward()
    return (logp, ent) + tuple(t.grad for t in leaves)


# H = 100 and 160: not a multiple of the C++ products' SIMD steps (32, 64, 128 floats); bf16 at 160
# runs AVX512-BF16's dot instruction where the CPU has it.
@pytest.mark.parametrize("native", [True, False], ids=["cpp", "torch-ops"])
@pytest.mark.parametrize("dtype,hidden", [(torch.float32, 100), (torch.bfloat16, 160), (torch.float32, 7)],
                         ids=["fp32-H100", "bf16-H160", "fp32-H7"])
def test_fused_linear_from_hidden_states_matches_the_reference(dtype, hidden, native, monkeypatch):
    if native and not gk.backends.native_available():
        pytest.skip("the native extension is not built")
    if not native:
        monkeypatch.setattr(kept_products, "_native", lambda t: False)
    gen = torch.Generator().manual_seed(4)
    h, w, b, targets, kept = _linear_problem(37, hidden, 90, dtype, gen)
    up = (torch.randn(37, generator=gen), torch.randn(37, generator=gen))
    got = _linear_grads(h, w, b, targets, kept, up, temperature=0.8, logit_softcap=4.0)
    want = _linear_grads(h.double(), w.double(), b.double(), targets, kept, up,
                         fn=reference.fused_linear_selective_log_softmax, temperature=0.8, logit_softcap=4.0)
    for got_t, want_t, what in zip(got, want, ("logp", "entropy", "d hidden", "d weight", "d bias")):
        scale = max(1.0, want_t.abs().max().item())
        tol = (3e-5 if dtype == torch.float32 else 1e-2) * scale
        _close(got_t, want_t, tol, what)
    assert (got[3][~torch.isin(torch.arange(90), kept.token_ids)] == 0).all(), "an unkept weight row got a gradient"


def test_fused_linear_gspo_loss_with_kept_tokens_matches_the_reference():
    gen = torch.Generator().manual_seed(5)
    h, w, b, targets, kept = _linear_problem(2 * 7, 48, 64, torch.float32, gen)
    h, targets = h.reshape(2, 7, 48), targets.reshape(2, 7)
    old, adv = -torch.rand(2, 7, generator=gen) - 1, torch.randn(2, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (h, w, b)]
    loss, _ = gk.fused_linear_gspo_loss(*leaves[:2], targets, old, adv, bias=leaves[2], kept_tokens=kept, eps_low=0.2,
                                        eps_high=0.2)
    loss.backward()
    leaves64 = [t.double().requires_grad_() for t in (h, w, b)]
    loss64, _ = reference.fused_linear_gspo_loss(*leaves64[:2], targets, old, adv, bias=leaves64[2],
                                                 kept_tokens=kept, eps_low=0.2, eps_high=0.2)
    loss64.backward()
    _close(loss, loss64, 2e-6, "loss")
    for a, b64, what in zip(leaves, leaves64, ("d hidden", "d weight", "d bias")):
        _close(a.grad, b64.grad, 2e-6, what)


def test_kept_products_give_the_same_bits_whatever_the_threads_and_the_other_rows():
    if not gk.backends.native_available():
        pytest.skip("the native extension is not built")
    gen = torch.Generator().manual_seed(6)
    h, w, b, targets, kept = _linear_problem(64, 96, 200, torch.bfloat16, gen, sizes=(20, 60))
    up = (torch.randn(64, generator=gen), torch.randn(64, generator=gen))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _linear_grads(h, w, b, targets, kept, up)
        torch.set_num_threads(max(2, threads))
        many = _linear_grads(h, w, b, targets, kept, up)
    finally:
        torch.set_num_threads(threads)
    for a, c in zip(one, many):
        assert torch.equal(a, c)
    # A row alone: its log-prob, entropy and d hidden row are bitwise those of the batch.
    row = 17
    lo, hi = int(kept.offsets[row]), int(kept.offsets[row + 1])
    alone = KeptTokens(torch.tensor([0, hi - lo]), kept.token_ids[lo:hi], 200)
    single = _linear_grads(h[row:row + 1], w, b, targets[row:row + 1], alone, (up[0][row:row + 1], up[1][row:row + 1]))
    assert torch.equal(single[0], many[0][row:row + 1]) and torch.equal(single[1], many[1][row:row + 1])
    assert torch.equal(single[2], many[2][row:row + 1])


def test_bad_kept_sets_are_refused_naming_the_row():
    with pytest.raises(ValueError, match="row 1 holds id 5 twice"):
        KeptTokens.from_lists([[1, 2], [5, 3, 5]], 10)
    with pytest.raises(ValueError, match="row 0 holds id 10, outside the vocabulary"):
        KeptTokens.from_lists([[10]], 10)
    with pytest.raises(ValueError, match="fall at row 1"):
        KeptTokens(torch.tensor([0, 2, 1, 3]), torch.tensor([1, 2, 3]), 10)
    with pytest.raises(ValueError, match="end at nnz = 3"):
        KeptTokens(torch.tensor([0, 2, 2]), torch.tensor([1, 2, 3]), 10)
    with pytest.raises(TypeError, match="int64 or int32"):
        KeptTokens(torch.tensor([0.0, 1.0]), torch.tensor([1]), 10)
    logits = torch.randn(3, 10)
    kept = KeptTokens.from_lists([[1, 2], [], [4]], 10)
    with pytest.raises(ValueError, match="token row 1 is in the loss with target 3 and an empty kept set"):
        gk.selective_log_softmax(logits, torch.tensor([1, 3, 4]), kept_tokens=kept)
    with pytest.raises(ValueError, match="token row 2 is in the loss with target 5 and a kept set of 1 ids"):
        gk.selective_log_softmax(logits, torch.tensor([1, 3, 5]), kept_tokens=kept, mask=torch.tensor([1, 0, 1]))
    # Outside the mask an empty set and any target are fine.
    logp = gk.selective_log_softmax(logits, torch.tensor([1, -100, 4]), kept_tokens=kept, mask=torch.tensor([1, 0, 1]))
    assert torch.isfinite(logp[[0, 2]]).all()
    with pytest.raises(ValueError, match="kept_tokens has 3 rows .* the call has 2 token rows"):
        gk.selective_log_softmax(logits[:2], torch.tensor([1, 3]), kept_tokens=kept)
    with pytest.raises(ValueError, match="vocabulary of 10 ids; the logits have 12"):
        gk.selective_log_softmax(torch.randn(3, 12), torch.tensor([1, 3, 4]), kept_tokens=kept)
    with pytest.raises(ValueError, match="one way"):
        gk.selective_log_softmax(logits, torch.tensor([1, 2, 4]), kept_tokens=kept, sampling_top_k=3)
    with pytest.raises(TypeError, match="must be a gspo_kernels.KeptTokens"):
        gk.selective_log_softmax(logits, torch.tensor([1, 2, 4]), kept_tokens=[[1], [2], [4]])
    with pytest.raises(ValueError, match="row 1 has an id after a fill value"):
        KeptTokens.from_padded(torch.tensor([[1, 2, -1], [-1, 3, -1]]), 10)


def test_from_padded_and_from_lists_agree():
    padded = torch.tensor([[[4, 1, -1], [2, -1, -1]], [[-1, -1, -1], [0, 3, 5]]])
    a = KeptTokens.from_padded(padded, 6)
    b = KeptTokens.from_lists([[4, 1], [2], [], [0, 3, 5]], 6)
    assert torch.equal(a.offsets, b.offsets) and torch.equal(a.token_ids, b.token_ids)
    assert a.offsets.tolist() == [0, 2, 3, 3, 6] and a.row_index.tolist() == [0, 0, 1, 3, 3, 3]
    assert a.token_ids.tolist() == [1, 4, 2, 0, 3, 5]  # each row's ids held ascending


def test_from_responses_places_each_response_at_its_rows():
    class VllmMask:  # CSR per response, as vLLM's CompletionOutput.sampling_mask carries it
        token_ids, offsets = [3, 1, 4, 4], [0, 2, 3, 4]

    sglang = [[7], [2, 5]]  # a list per generated token, as SGLang's output_token_sampling_mask
    kept = KeptTokens.from_responses([VllmMask(), sglang, {"token_ids": [0], "offsets": [0, 1]}], starts=[1, 5, 8],
                                     rows=9, vocab_size=10)
    assert kept.offsets.tolist() == [0, 0, 2, 3, 4, 4, 5, 7, 7, 8]
    assert kept.token_ids.tolist() == [1, 3, 4, 4, 7, 2, 5, 0]  # each row's ids held ascending
    with pytest.raises(ValueError, match="a response of 2 tokens starting at row 8 does not fit in 9 token rows"):
        KeptTokens.from_responses([sglang], starts=[8], rows=9, vocab_size=10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_linear_kept_rows_on_cuda_match_the_reference():
    """The PyTorch products (the path on a GPU), bf16, against the float64 reference."""
    gen = torch.Generator().manual_seed(8)
    h, w, b, targets, kept = _linear_problem(300, 256, 1000, torch.bfloat16, gen, sizes=(1, 64))
    up = (torch.randn(300, generator=gen), torch.randn(300, generator=gen))
    moved = [t.cuda() for t in (h, w, b, targets)] + [kept.to("cuda")]
    got = _linear_grads(*moved, tuple(u.cuda() for u in up), temperature=0.8)
    want = _linear_grads(h.double(), w.double(), b.double(), targets, kept, up,
                         fn=reference.fused_linear_selective_log_softmax, temperature=0.8)
    for got_t, want_t, what in zip(got, want, ("logp", "entropy", "d hidden", "d weight", "d bias")):
        _close(got_t, want_t, 1e-2 * max(1.0, want_t.abs().max().item()), what)


def test_the_cpp_products_without_the_bf16_dot_instruction():
    """GSPO_CPU_BF16_DOT=0: bf16 through float32 FMAs (what a CPU without AVX512-BF16 runs), in a
    fresh process (the switch is read once), against the float64 reference."""
    if not gk.backends.native_available():
        pytest.skip("the native extension is not built")
    import os
    import subprocess
    import sys

    test = "tests/loss/test_kept_tokens.py::test_fused_linear_from_hidden_states_matches_the_reference"
    env = {**os.environ, "GSPO_CPU_BF16_DOT": "0"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test, "-k", "bf16 and cpp"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-2000:]


def test_kept_products_give_the_same_bits_whatever_the_tiles_and_blocks(monkeypatch):
    """The C++ products' tiles of rows, blocks of ids and d weight's blocks of rows are a speed
    choice (linear/kept_products.py): odd sizes that cut rows and sets anywhere give the bits of
    the defaults."""
    if not gk.backends.native_available():
        pytest.skip("the native extension is not built")
    gen = torch.Generator().manual_seed(8)
    h, w, b, targets, kept = _linear_problem(64, 96, 200, torch.bfloat16, gen, sizes=(20, 60))
    up = (torch.randn(64, generator=gen), torch.randn(64, generator=gen))
    default = _linear_grads(h, w, b, targets, kept, up)
    for tile_rows, block_ids, rows_a_block in ((3, 7, 5), (1, 1, 1), (64, 200, 64)):
        monkeypatch.setattr(kept_products, "row_tiles", lambda hidden, weight, t=(tile_rows, block_ids): t)
        monkeypatch.setattr(kept_products, "block_rows", lambda hidden, r=rows_a_block: r)
        for a, c in zip(default, _linear_grads(h, w, b, targets, kept, up)):
            assert torch.equal(a, c), (tile_rows, block_ids, rows_a_block)
