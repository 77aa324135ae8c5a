"""batch_invariant=True on the fused-linear path: a row's log-prob, entropy and `d hidden` row
are bitwise the same alone, at an offset, permuted, in sub-batches, padded or packed, as a
strided view and at any chunk size, on every backend and the tile path (fused=True, through
Triton's interpreter here); loss and every gradient bitwise the same from run to run; values
still match the float64 reference. The product blocks are shrunk so that these small problems
span several row blocks (one padded) and several vocab blocks."""

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.linear import invariant, products
from gspo_kernels.testing.problems import ProblemSpec, make_problem
from gspo_kernels.testing.verify import linear_operands, run_linear_case

from conftest import BACKENDS, device_for

HIDDEN, VOCAB, ROWS = 24, 100, 36
FP32, BF16 = torch.float32, torch.bfloat16


def _cases(interpreted_dtypes):
    """(path, dtype) pairs: (backend, fused) for every backend's chunked path and the Triton tile
    kernels; both dtypes where the kernels run natively, the given ones through Triton's
    interpreter (numpy speed: the dtypes rotate over the tests, to keep the suite fast)."""
    paths = [(b, False) for b in BACKENDS] + ([("triton", True)] if "triton" in BACKENDS else [])
    cases = []
    for backend, fused in paths:
        interpreted = backend == "triton" and device_for("triton") == "cpu"
        for dtype in (interpreted_dtypes[fused] if interpreted else (FP32, BF16)):
            name = f"{backend}{'-tiles' if fused else ''}-{str(dtype)[6:]}"
            cases.append(pytest.param((backend, fused), dtype, id=name))
    return cases


@pytest.fixture(autouse=True)
def small_product_blocks(monkeypatch):
    """16-row products and 64-column vocab blocks (and weight upcast blocks): 36 rows make three
    row blocks, the last one padded; 100 columns two vocab blocks, the last one narrower."""
    monkeypatch.setitem(invariant.INVARIANT_ROWS, "cpu", 16)
    monkeypatch.setitem(invariant.BLOCK_BYTES, "cpu", 4 * HIDDEN * 64)
    monkeypatch.setattr(products, "UPCAST_BLOCK_BYTES", 4 * HIDDEN * 64)


def _operands(dtype, device, rows=ROWS, seed=7):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, HIDDEN, generator=gen) * 0.6
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.6
    bias = torch.randn(VOCAB, generator=gen) * 0.2
    targets = torch.randint(0, VOCAB, (rows,), generator=gen)
    # Upstream gradients that belong to the row, wherever it lands.
    coef = torch.rand(rows, 2, generator=gen) + 0.1
    return [t.to(dtype).to(device) for t in (hidden, weight, bias)] + [targets.to(device), coef.to(device)]


def _stats(path, case, hidden, targets, coef, mask=None, **linear):
    """(logp, entropy, d hidden) of hidden `(..., H)` (any layout): the upstream gradient of a row
    is coef[row] for (logp, entropy), 0 outside the mask."""
    backend, fused = path
    _, weight, bias = case[:3]
    leaf = hidden.detach().clone().requires_grad_()
    view = leaf[:, :-1] if leaf.dim() == 3 and linear.pop("strided", False) else leaf
    logp, entropy = gk.fused_linear_selective_log_softmax(
        view, weight, targets, bias=bias, return_entropy=True, backend=backend, fused=fused, mask=mask,
        batch_invariant=linear.pop("batch_invariant", True), **linear)
    keep = torch.ones_like(logp) if mask is None else mask.to(logp.dtype)
    (keep * (logp * coef[..., 0] + entropy * coef[..., 1])).sum().backward()
    grad = leaf.grad[:, :-1] if view is not leaf else leaf.grad
    return logp.detach(), entropy.detach(), grad


def _assert_rows_equal(got, want, where):
    for name, a, b in zip(("logp", "entropy", "d hidden"), got, want):
        assert torch.equal(a, b), f"{name} differs {where}"


@pytest.mark.parametrize("path, dtype", _cases({False: [BF16], True: [FP32]}))
def test_rows_do_not_depend_on_the_batch(path, dtype):
    device = device_for(path[0])
    case = _operands(dtype, device)
    hidden, targets, coef = case[0], case[3], case[4]
    whole = _stats(path, case, hidden, targets, coef, chunk_size=7)
    picked = [0, 17, 35]
    for row in picked:  # alone, in one padded product
        alone = _stats(path, case, hidden[row:row + 1], targets[row:row + 1], coef[row:row + 1], chunk_size=5)
        _assert_rows_equal(alone, [t[row:row + 1] for t in whole], f"for row {row} alone")
    # at an offset: 9 other rows first, and a chunk size that divides nothing here
    extra = _operands(dtype, device, rows=9, seed=8)
    shifted = _stats(path, case, torch.cat([extra[0], hidden]), torch.cat([extra[3], targets]),
                     torch.cat([extra[4], coef]), chunk_size=13)
    _assert_rows_equal([t[9:] for t in shifted], whole, "at an offset of 9 rows")
    order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(3)).to(device)
    permuted = _stats(path, case, hidden[order], targets[order], coef[order], chunk_size=None)
    _assert_rows_equal(permuted, [t[order] for t in whole], "permuted")
    for part in (slice(0, 20), slice(20, ROWS)):  # sub-batches of 20 and 16
        sub = _stats(path, case, hidden[part], targets[part], coef[part], chunk_size=3)
        _assert_rows_equal(sub, [t[part] for t in whole], f"in sub-batch {part}")


def _differing_rows(path, case, batch_invariant):
    """Rows (of 0, 17, 35) whose log-prob, entropy or d hidden alone differ in bits from the batch's."""
    hidden, targets, coef = case[0], case[3], case[4]
    whole = _stats(path, case, hidden, targets, coef, chunk_size=7, batch_invariant=batch_invariant)
    differing = []
    for row in (0, 17, 35):
        alone = _stats(path, case, hidden[row:row + 1], targets[row:row + 1], coef[row:row + 1], chunk_size=5,
                       batch_invariant=batch_invariant)
        if not all(torch.equal(a, b[row:row + 1]) for a, b in zip(alone, whole)):
            differing.append(row)
    return differing


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_check_fails_without_batch_invariant(backend, row_count_products):
    """The control of the test above, on every machine: a logits product whose sum over H is split
    where the row count says (as a BLAS picks split-K by shape) makes the default path give rows
    alone other bits than in the batch, and the comparison sees it; batch_invariant=True under the
    same product gives the same bits, since its products always have one row count."""
    path = (backend, False)
    case = _operands(FP32, device_for(backend))
    assert _differing_rows(path, case, batch_invariant=False)
    assert _differing_rows(path, case, batch_invariant=True) == []


@pytest.mark.parametrize("path, dtype", _cases({False: [], True: [BF16]}))
def test_padded_and_strided_layouts(path, dtype):
    """The 36 rows as 4 sequences of 9 in a (4, 12, H) padded batch (3 padding rows each, of other
    values), and as its strided view hidden[:, :-1] of a (4, 13, H) tensor: the same bits as packed."""
    device = device_for(path[0])
    case = _operands(dtype, device)
    hidden, targets, coef = case[0], case[3], case[4]
    packed = _stats(path, case, hidden, targets, coef, chunk_size=8)
    filler = _operands(dtype, device, rows=4 * 4, seed=9)
    for width, strided in ((12, False), (13, True)):
        padded_h = torch.cat([hidden.reshape(4, 9, HIDDEN), filler[0].reshape(4, 4, HIDDEN)[:, :width - 9]], 1)
        padded_t = torch.cat([targets.reshape(4, 9), filler[3].reshape(4, 4)[:, :width - 9]], 1)
        padded_c = torch.cat([coef.reshape(4, 9, 2), filler[4].reshape(4, 4, 2)[:, :width - 9]], 1)
        if strided:  # the last column is what the view leaves out
            padded_t, padded_c = padded_t[:, :-1], padded_c[:, :-1]
        mask = torch.zeros(padded_t.shape, dtype=torch.bool, device=device)
        mask[:, :9] = True
        got = _stats(path, case, padded_h, padded_t, padded_c, mask=mask, chunk_size=11, strided=strided)
        _assert_rows_equal([t[:, :9].reshape(ROWS, *t.shape[2:]) for t in got], packed,
                           "strided" if strided else "padded")


@pytest.mark.parametrize("path, dtype", _cases({False: [FP32], True: [BF16]}))
def test_loss_and_gradients_reproducible_and_exact(path, dtype, seed):
    """Two runs of the loss: bitwise the same loss and gradients; both at today's tolerances
    against the float64 reference."""
    backend, fused = path
    problem = make_problem(ProblemSpec(batch=4, seq_len=7, vocab=VOCAB, dtype=dtype, with_ref=True,
                                       empty_sequence=True, device=device_for(backend), seed=seed % 1000))
    operands = linear_operands(problem, HIDDEN, seed % 1000)
    runs = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_() for t in operands]
        args, kwargs = problem.loss_args()
        kwargs.pop("temperature")
        loss, _ = gk.fused_linear_gspo_loss(leaves[0], leaves[1], *args[1:], bias=leaves[2], backend=backend,
                                            fused=fused, batch_invariant=True, chunk_size=6, beta=0.05,
                                            entropy_coef=0.02, **kwargs)
        loss.backward()
        runs.append([loss.detach()] + [t.grad for t in leaves])
    for name, a, b in zip(("loss", "d hidden", "d weight", "d bias"), *runs):
        assert torch.equal(a, b), name
    result = run_linear_case(problem, backend, operands, chunk_size=6, fused=fused, batch_invariant=True,
                             beta=0.05, entropy_coef=0.02)
    assert result.passed, result.failures()


def test_the_product_shape_does_not_follow_the_batch():
    """What makes it invariant: chunk sizes round up to whole row blocks, vocab blocks follow H only."""
    blocks = invariant.ProductBlocks.of(torch.device("cpu"), HIDDEN)
    assert (blocks.rows, blocks.vocab) == (16, 64)
    assert blocks.round_chunk(1) == 16 and blocks.round_chunk(16) == 16 and blocks.round_chunk(17) == 32
    assert blocks.vocab_slices(VOCAB) == [slice(0, 64), slice(64, 100)]
    gpu = invariant.ProductBlocks.of(torch.device("cuda"), 4096)
    assert (gpu.rows, gpu.vocab) == (512, 8192)


def test_filtering_is_refused():
    with pytest.raises(ValueError, match="not batch-invariant"):
        gk.LinearConfig(fused=True, grad_filter_eps=1e-6, batch_invariant=True)
    with pytest.raises(TypeError, match="batch_invariant must be a bool"):
        gk.LinearConfig(batch_invariant=1)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_cpu_upcasts_the_weight_a_block_at_a_time(batch_invariant, monkeypatch):
    """bf16 on a CPU without native bf16 products: no float32 copy of the whole weight is made in
    forward or in either sweep, only blocks of at most 64 rows (the shrunk block)."""
    from gspo_kernels.linear import chunked

    monkeypatch.setattr(products, "NATIVE_16BIT_MATMUL", set())
    upcast_rows = []
    plain = products.as_matmul_dtype

    def recording(t):
        if t.dtype == torch.bfloat16 and t.dim() == 2 and t.shape[0] > ROWS:
            upcast_rows.append(t.shape[0])  # weight rows (more than there are hidden rows)
        return plain(t)

    monkeypatch.setattr(products, "as_matmul_dtype", recording)
    hidden, weight, bias, targets, coef = _operands(torch.bfloat16, "cpu")
    for sweep in ("rows", "vocab"):
        monkeypatch.setattr(chunked, "choose_sweep", lambda *args, s=sweep: s)
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        logp = gk.fused_linear_selective_log_softmax(leaves[0], leaves[1], targets, bias=leaves[2], backend="torch",
                                                     chunk_size=ROWS, batch_invariant=batch_invariant)
        (logp * coef[:, 0]).sum().backward()
        assert leaves[1].grad is not None
    assert upcast_rows and max(upcast_rows) <= 64, upcast_rows
