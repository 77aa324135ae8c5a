"""fused_linear_gspo_loss and fused_linear_selective_log_softmax against the materialized
float64 reference (logits = hidden @ weight.T + bias in float64, then reference.gspo_loss):
the loss, and the gradients of hidden, weight and bias, on every backend."""

import math

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels import compat
from gspo_kernels.testing import reference
from gspo_kernels.config import LEVELS, LOSS_AGGS
from gspo_kernels.linear import api as linear_api, chunked, one_pass
from gspo_kernels.linear.plan import LinearPlan
from gspo_kernels.linear.plan import align_down, default_chunk_rows
from gspo_kernels.linear.sweeps import choose_sweep
from gspo_kernels.testing.problems import ProblemSpec, make_problem
from gspo_kernels.testing.verify import linear_operands, relative_error, run_linear_case

from conftest import BACKENDS, device_for

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HIDDEN = 24
# Options rotated through the grid: temperature, KL, entropy bonus.
OPTIONS = [{}, {"temperature": 0.7}, {"beta": 0.05}, {"entropy_coef": 0.02, "temperature": 1.3}]


@pytest.fixture(params=["one_pass", "rows", "vocab"])
def sweep(request, monkeypatch):
    """How the gradient is formed, checked to have run: the one-pass schedule where the loss
    allows it (fused_linear_gspo_loss's default; fused_linear_selective_log_softmax always takes
    two passes), or two passes with the backward's sweep forced (choose_sweep picks vocab at most
    of these sizes, N < V)."""
    if request.function.__name__ == "test_compiled_matches_eager" and not compat.COMPILE_FUSED_LINEAR:
        # skipped before it runs: nothing to record
        pytest.skip(f"torch.compile of fused linear is tested from torch 2.11 (compat.py); this is {torch.__version__}")
    calls = []

    def record(name):
        if not torch.compiler.is_compiling():  # a traced call may not mutate a list; eager ones record
            calls.append(name)

    if request.param == "one_pass":
        ran = one_pass.one_pass_loss

        def recorded(*args, **kwargs):
            record("one_pass")
            return ran(*args, **kwargs)

        monkeypatch.setattr(linear_api, "one_pass_loss", recorded)
        monkeypatch.setattr(chunked, "choose_sweep", lambda *args: record("two_pass") or choose_sweep(*args))
    else:
        monkeypatch.setattr(LinearPlan, "schedule", lambda self, config, batch: None)
        monkeypatch.setattr(chunked, "choose_sweep", lambda *args: record(request.param) or request.param)
    yield request.param
    assert calls, "no loss or backward ran the schedule"


def _compare(backend, dtype, level="sequence", loss_agg="seq-mean-token-mean", packed=False, chunk_size=5, seed=0,
             with_bias=True, weight_grad_fp32=True, **options):
    spec = ProblemSpec(batch=4, seq_len=7, vocab=37, dtype=dtype, with_ref=True, empty_sequence=True,
                       device=device_for(backend), seed=seed)
    problem = make_problem(spec)
    if packed:
        problem = problem.to_packed()
    operands = linear_operands(problem, HIDDEN, seed)
    if not with_bias:
        operands[2] = None
    result = run_linear_case(problem, backend, operands, chunk_size=chunk_size, weight_grad_fp32=weight_grad_fp32,
                             level=level, loss_agg=loss_agg, max_len=spec.seq_len, **options)
    assert result.passed, result.failures()


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_materialized_reference(backend, level, loss_agg, dtype, packed, seed):
    index = LEVELS.index(level) + LOSS_AGGS.index(loss_agg) + DTYPES.index(dtype) + packed
    _compare(backend, dtype, level, loss_agg, packed, chunk_size=5, seed=seed % 1000, **OPTIONS[index % len(OPTIONS)])


@pytest.mark.parametrize("chunk_size", [1, 3, 28, 1000, None])
@pytest.mark.parametrize("backend", BACKENDS)
def test_chunk_sizes_and_no_bias(backend, chunk_size, seed, sweep):
    """Chunks that do not divide N (28 rows), one chunk for all, the default rule; no bias."""
    _compare(backend, torch.float32, chunk_size=chunk_size, seed=seed % 1000, with_bias=chunk_size != 3,
             beta=0.05, entropy_coef=0.01)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_hidden(backend, seed, sweep):
    """hidden[:, :-1], the usual shift of a causal LM's hidden states: gradients land in place."""
    device = device_for(backend)
    problem = make_problem(ProblemSpec(batch=3, seq_len=5, vocab=23, device=device, seed=seed % 1000))
    args, kwargs = problem.loss_args()
    kwargs.pop("temperature")
    full = torch.randn(3, 6, 16, device=device, requires_grad=True)
    weight = torch.randn(23, 16, device=device, requires_grad=True)
    loss, _ = gk.fused_linear_gspo_loss(full[:, :-1], weight, *args[1:], chunk_size=4, backend=backend, **kwargs)
    loss.backward()
    ref_full, ref_weight = full.detach().double().cpu().requires_grad_(), weight.detach().double().cpu().requires_grad_()
    ref_loss, _ = reference.gspo_loss(ref_full[:, :-1] @ ref_weight.t(), *[a.cpu() for a in args[1:]],
                                      **{k: v.cpu() for k, v in kwargs.items()})
    ref_loss.backward()
    assert relative_error(loss, ref_loss, floor=0.1) <= 1e-5
    assert torch.count_nonzero(full.grad[:, -1]) == 0
    assert relative_error(full.grad, ref_full.grad) <= 1e-5 and relative_error(weight.grad, ref_weight.grad) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_grad_in_the_weights_dtype(backend, dtype, seed, sweep):
    """weight_grad_fp32=False: d weight accumulated in 16 bits, one rounding per chunk."""
    _compare(backend, dtype, chunk_size=7, seed=seed % 1000, weight_grad_fp32=False, beta=0.05)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_row(backend, seed, sweep):
    device = device_for(backend)
    hidden = torch.randn(1, 8, device=device, requires_grad=True)
    weight = torch.randn(11, 8, device=device, requires_grad=True)
    target = torch.tensor([3], device=device)
    logp, entropy = gk.fused_linear_selective_log_softmax(hidden, weight, target, return_entropy=True,
                                                          backend=backend)
    (logp.sum() + 0.3 * entropy.sum()).backward()
    ref_h, ref_w = hidden.detach().double().cpu().requires_grad_(), weight.detach().double().cpu().requires_grad_()
    log_probs = torch.log_softmax(ref_h @ ref_w.t(), -1)
    ref_entropy = -(log_probs.exp() * log_probs).sum(-1)
    (log_probs[0, 3] + 0.3 * ref_entropy.sum()).backward()
    assert abs(logp.item() - log_probs[0, 3].item()) < 1e-5
    assert relative_error(hidden.grad, ref_h.grad) < 1e-5 and relative_error(weight.grad, ref_w.grad) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_selective_log_softmax_matches_the_unfused_one(backend, seed):
    device = device_for(backend)
    hidden = torch.randn(3, 9, 16, device=device)
    weight = torch.randn(50, 16, device=device)
    targets = torch.randint(0, 50, (3, 9), device=device)
    mask = torch.rand(3, 9, device=device) < 0.7
    fused = gk.fused_linear_selective_log_softmax(hidden, weight, targets, temperature=0.8, return_entropy=True,
                                                  chunk_size=4, backend=backend, mask=mask)
    unfused = gk.selective_log_softmax(hidden @ weight.t(), targets, temperature=0.8, return_entropy=True,
                                       backend=backend)
    for a, b in zip(fused, unfused):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_gradcheck_float64(sweep):
    problem = make_problem(ProblemSpec(batch=3, seq_len=4, vocab=6, dtype=torch.float64, with_ref=True,
                                       empty_sequence=True))
    args, kwargs = problem.loss_args()
    kwargs.pop("temperature")
    hidden = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(6, dtype=torch.float64, requires_grad=True)

    def f(h, w, b, schedule="auto"):
        loss, _ = gk.fused_linear_gspo_loss(h, w, *args[1:], bias=b, chunk_size=5, backend="torch", beta=0.1,
                                            entropy_coef=0.05, temperature=0.9, schedule=schedule, **kwargs)
        return loss

    if sweep != "one_pass":
        assert torch.autograd.gradcheck(f, (hidden, weight, bias), eps=1e-7, atol=1e-7, rtol=1e-4)
        return
    # gradcheck runs backward twice on one forward, which the one-pass schedule refuses (its
    # gradients are handed over once): its gradients are held to the gradchecked two passes'.
    grads = {}
    for schedule in ("one_pass", "two_pass"):
        leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
        f(*leaves, schedule=schedule).backward()
        grads[schedule] = [t.grad for t in leaves]
    assert torch.autograd.gradcheck(lambda *t: f(*t, schedule="two_pass"), (hidden, weight, bias), eps=1e-7,
                                    atol=1e-7, rtol=1e-4)
    for one, two in zip(grads["one_pass"], grads["two_pass"]):
        assert relative_error(one, two) <= 1e-12


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_compiled_matches_eager(backend, seed, sweep):
    if backend == "cpu" and not gk.backends.native_available():
        pytest.skip("extension gspo_kernels.backends._C not built")
    problem = make_problem(ProblemSpec(batch=3, seq_len=6, vocab=30, seed=seed))
    args, kwargs = problem.loss_args()
    weight = torch.randn(30, 12)
    torch._dynamo.reset()

    def step(h, w):
        return gk.fused_linear_gspo_loss(h, w, *args[1:], chunk_size=7, backend=backend, **kwargs)[0]

    results = []
    for fn in (torch.compile(step, fullgraph=True), step):
        h, w = torch.randn(3, 6, 12, generator=torch.Generator().manual_seed(1)).requires_grad_(), weight.clone()
        w.requires_grad_()
        loss = fn(h, w)
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad))
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_sweep_matches_materialized_reference(backend, level, dtype, packed, seed, monkeypatch):
    """The grid above runs the vocab sweep (N = 28 < V = 37); this one the rows sweep, every
    level x dtype x layout, the options rotating."""
    monkeypatch.setattr(chunked, "choose_sweep", lambda *args: "rows")
    index = LEVELS.index(level) + DTYPES.index(dtype) + packed
    agg = LOSS_AGGS[index % len(LOSS_AGGS)]
    _compare(backend, dtype, level, agg, packed, chunk_size=5, seed=seed % 1000, **OPTIONS[index % len(OPTIONS)])


@pytest.mark.parametrize("frozen", ["weight", "hidden", "bias"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_some_operands_frozen(backend, frozen, seed, sweep):
    """Only some operands want a gradient (a frozen lm_head, frozen hidden states): the others
    still match, and the frozen one gets none."""
    device = device_for(backend)
    problem = make_problem(ProblemSpec(batch=3, seq_len=6, vocab=29, device=device, with_ref=True, seed=seed % 1000))
    args, kwargs = problem.loss_args()
    kwargs.pop("temperature")
    gen = torch.Generator().manual_seed(seed % 1000)
    operands = {"hidden": torch.randn(3, 6, 16, generator=gen), "weight": torch.randn(29, 16, generator=gen) * 0.5,
                "bias": torch.randn(29, generator=gen) * 0.2}
    leaves = {k: v.clone().to(device).requires_grad_(k != frozen) for k, v in operands.items()}
    loss, _ = gk.fused_linear_gspo_loss(leaves["hidden"], leaves["weight"], *args[1:], bias=leaves["bias"],
                                        chunk_size=4, backend=backend, beta=0.05, entropy_coef=0.02, **kwargs)
    loss.backward()
    refs = {k: v.double().requires_grad_(k != frozen) for k, v in operands.items()}
    ref_loss, _ = reference.gspo_loss(refs["hidden"] @ refs["weight"].t() + refs["bias"],
                                      *[a.cpu() for a in args[1:]], beta=0.05, entropy_coef=0.02,
                                      **{k: v.cpu() for k, v in kwargs.items()})
    ref_loss.backward()
    assert leaves[frozen].grad is None
    for name, leaf in leaves.items():
        if name != frozen:
            assert relative_error(leaf.grad, refs[name].grad) <= 1e-5, name


def test_cpu_bf16_products_can_be_turned_off(monkeypatch):
    from gspo_kernels.linear import products as linear_products

    monkeypatch.setenv("GSPO_CPU_BF16_PRODUCTS", "0")
    assert not linear_products.cpu_has_native_bf16()
    monkeypatch.delenv("GSPO_CPU_BF16_PRODUCTS")
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    assert not linear_products.cpu_has_native_bf16()


def test_sweep_rule():
    """Vocab blocks when their float32 d hidden accumulator (N x H) is smaller than the rows
    sweep's d weight one (V x H, float32 or the weight's dtype); none needed for one gradient."""
    bf16, fp32 = torch.bfloat16, torch.float32
    assert choose_sweep(16384, 151936, True, True, True, bf16) == "vocab"
    assert choose_sweep(200000, 151936, True, True, True, bf16) == "rows"
    assert choose_sweep(100000, 151936, True, True, False, bf16) == "rows"  # 4 N > 2 V
    assert choose_sweep(50000, 151936, True, True, False, bf16) == "vocab"
    assert choose_sweep(50000, 151936, True, True, False, fp32) == "vocab"
    assert choose_sweep(16, 100, True, False, True, fp32) == "rows"  # frozen weight: no accumulator
    assert choose_sweep(1000, 100, False, True, True, fp32) == "vocab"  # frozen hidden: none either


def test_module_form_takes_the_lm_head():
    problem = make_problem(ProblemSpec(batch=2, seq_len=5, vocab=20))
    args, kwargs = problem.loss_args()
    kwargs.pop("temperature")  # an option, fixed in the module
    lm_head = torch.nn.Linear(8, 20)
    hidden = torch.randn(2, 5, 8)
    loss_fn = gk.FusedLinearGSPOLoss(chunk_size=3, level="token")
    loss, _ = loss_fn(hidden, lm_head, *args[1:], **kwargs)
    loss.backward()
    direct, _ = gk.fused_linear_gspo_loss(hidden, lm_head.weight, *args[1:], bias=lm_head.bias, level="token", **kwargs)
    assert math.isclose(loss.item(), direct.item(), rel_tol=1e-6)
    assert lm_head.weight.grad is not None and lm_head.bias.grad is not None


def test_default_chunk_rule():
    assert default_chunk_rows(4096, 32768, torch.device("cpu")) == 256
    assert default_chunk_rows(10, 32768, torch.device("cpu")) == 10
    assert default_chunk_rows(4096, 151936, torch.device("cuda")) == 384  # 441 rounded to cuBLAS-friendly 128s
    assert default_chunk_rows(100, 151936, torch.device("cuda")) == 100
    # the vocab sweep's blocks too: 441 rows over N = 16384 at V = 151936 gave 4089 columns
    assert align_down(4089, torch.device("cuda")) == 3968 and align_down(4089, torch.device("cpu")) == 4089
    assert align_down(100, torch.device("cuda")) == 100
    assert default_chunk_rows(5, 10**9, torch.device("cpu")) == 1


def test_bad_operands():
    problem = make_problem(ProblemSpec(batch=2, seq_len=5, vocab=20))
    args, kwargs = problem.loss_args()
    h, w = torch.randn(2, 5, 8), torch.randn(20, 8)
    cases = [
        ((torch.randn(2, 5, 8, 1), w), {}, ValueError, "hidden must be"),
        ((h, torch.randn(20, 7)), {}, ValueError, "weight must be \\(V, H\\) with H = 8"),
        ((h, torch.randn(20, 8, 1)), {}, ValueError, "weight must be \\(V, H\\)"),
        ((h, torch.randn(0, 8)), {}, ValueError, "empty vocab"),
        ((h[:, :4], w), {}, ValueError, "target_ids must have shape"),
        ((h, w.bfloat16()), {}, TypeError, "weight is torch.bfloat16 but hidden is torch.float32"),
        ((h, w), {"bias": torch.randn(19)}, ValueError, "bias must have shape \\(20,\\)"),
        ((h, w), {"bias": torch.randn(20).half()}, TypeError, "bias is torch.float16"),
        ((h, w), {"chunk_size": 0}, ValueError, "chunk_size must be a positive int"),
        ((h, w), {"chunk_size": 2.5}, ValueError, "chunk_size must be a positive int"),
        ((h, w), {"weight_grad_fp32": "no"}, TypeError, "weight_grad_fp32 must be a bool"),
        ((h.int(), w), {}, TypeError, "hidden must be float32"),
        (("h", w), {}, TypeError, "hidden must be a torch.Tensor"),
    ]
    for (hidden, weight), extra, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            gk.fused_linear_gspo_loss(hidden, weight, *args[1:], **kwargs, **extra)


@pytest.mark.parametrize("weight_grad_fp32", [True, False])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_native_16bit_products_path(backend, weight_grad_fp32, monkeypatch, seed, sweep):
    """The GPU path (16-bit operands, float32 results) run on a CPU: without out_dtype there the
    logits are the 16-bit products upcast, as an lm_head writes them; the reference gets the same
    logits, and the gradients carry one 16-bit rounding of dz."""
    from gspo_kernels.linear import products as linear_products

    if backend == "cpu" and not gk.backends.native_available():
        pytest.skip("extension gspo_kernels.backends._C not built")
    monkeypatch.setattr(linear_products, "NATIVE_16BIT_MATMUL", {"cpu"})
    problem = make_problem(ProblemSpec(batch=3, seq_len=6, vocab=29, with_ref=True, seed=seed % 1000))
    args, kwargs = problem.loss_args()
    kwargs.pop("temperature")
    gen = torch.Generator().manual_seed(seed % 1000)
    operands = [(torch.randn(3, 6, 16, generator=gen) * 0.6).bfloat16(),
                (torch.randn(29, 16, generator=gen) * 0.6).bfloat16(), (torch.randn(29, generator=gen) * 0.2).bfloat16()]
    leaves = [t.clone().requires_grad_() for t in operands]
    loss, _ = gk.fused_linear_gspo_loss(*leaves[:2], *args[1:], bias=leaves[2], chunk_size=4, backend=backend,
                                        weight_grad_fp32=weight_grad_fp32, beta=0.05, **kwargs)
    loss.backward()
    refs = [t.detach().double().requires_grad_() for t in operands]
    logits16 = (operands[0] @ operands[1].t()).double()  # the 16-bit products, as the fallback forms them
    logits = logits16 + (refs[0] @ refs[1].t() - (refs[0] @ refs[1].t()).detach()) + refs[2]
    ref_loss, _ = reference.gspo_loss(logits, *args[1:], beta=0.05, **kwargs)
    ref_loss.backward()
    assert relative_error(loss, ref_loss, floor=0.1) <= 1e-5
    for leaf, ref in zip(leaves, refs):
        assert relative_error(leaf.grad, ref.grad) <= 2e-2


@pytest.mark.parametrize("backend", [b for b in BACKENDS if device_for(b) == "cpu"])
@pytest.mark.parametrize("sweep", ["rows", "vocab", "invariant"])
def test_a_bad_row_leaves_its_padding_neighbour_exactly_zero(backend, sweep, monkeypatch):
    """bf16 on a CPU: `d hidden` of the rows outside the mask is exactly 0 beside a NaN row of the
    loss. oneDNN's bf16 kernels on an AMX Xeon multiplied rows in pairs and turned row 27 (padding)
    NaN from row 28's NaN `dz` (35 rows, V = 33, H = 8; each row's NaN reached the row above it:
    the differential fuzz's long profile drew it); products._cpu_bf16_rows_product keeps a bad row's
    NaN to itself, told the bad rows by GradInputs.nan_rows. The rows the row rule makes NaN: a NaN
    hidden row (28), an out-of-range target (30) and a NaN upstream gradient (32), each beside
    padding (27, 31, 33). Every backward sweep; bf16 products on where the CPU has them."""
    monkeypatch.setenv("GSPO_CPU_BF16_PRODUCTS", "1")
    if sweep != "invariant":
        monkeypatch.setattr(chunked, "choose_sweep", lambda *args: sweep)
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(35, 8, generator=gen) * 0.5).bfloat16()
    hidden[28] = math.nan  # the first row of the mask, beside padding row 27
    weight = (torch.randn(33, 8, generator=gen) * 0.5).bfloat16()
    targets = torch.randint(0, 33, (35,), generator=gen)
    targets[30] = 33
    mask = torch.zeros(35, dtype=torch.bool)
    mask[28:31] = mask[32] = True
    upstream = torch.ones(35)
    upstream[32] = math.nan
    leaf = hidden.clone().requires_grad_()
    logp = gk.fused_linear_selective_log_softmax(leaf, weight, targets, mask=mask, backend=backend,
                                                 batch_invariant=sweep == "invariant", schedule="two_pass")
    (logp * upstream).nansum().backward()
    bad = torch.isnan(leaf.grad).any(-1)
    assert bad.nonzero().flatten().tolist() == [28, 30, 32]
    assert torch.equal(leaf.grad[~mask], torch.zeros_like(leaf.grad[~mask]))
    assert torch.isfinite(leaf.grad[29]).all() and leaf.grad[29].abs().sum() > 0


def test_cpu_bf16_rows_product_keeps_nan_to_its_rows():
    from gspo_kernels.linear.products import _cpu_bf16_rows_product

    gen = torch.Generator().manual_seed(1)
    for rows in (2, 35, 64):
        dz = torch.randn(rows, 33, generator=gen)
        dz[1, 3] = math.nan
        dz[rows - 1, 0] = math.inf
        dz[0] = 0.0
        weight = torch.randn(33, 8, generator=gen).bfloat16()
        out = _cpu_bf16_rows_product(dz.bfloat16(), weight)
        bad = torch.isnan(out).all(-1)
        assert bad[1] and bad[rows - 1] and not torch.isnan(out[~bad]).any()
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        good = ~bad
        assert torch.equal(out[good], (dz.bfloat16().nan_to_num(0.0, 0.0, 0.0) @ weight)[good])
