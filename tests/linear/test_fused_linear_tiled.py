"""fused=True: the Triton kernels that keep the logits in on-chip tiles (through Triton's
interpreter on a CPU), against the materialized float64 reference, with gradient filtering off
and on; what the filter skips; errors."""

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.backends import triton_backend
from gspo_kernels.backends.triton.tile_ops import TileConfig
from gspo_kernels.config import LEVELS, LOSS_AGGS
from gspo_kernels.testing.problems import ProblemSpec, make_problem
from gspo_kernels.testing.verify import linear_operands, relative_error, run_linear_case

from conftest import BACKENDS, device_for

pytestmark = pytest.mark.skipif("triton" not in BACKENDS, reason="needs Triton (CUDA, or its interpreter on a CPU)")
DEVICE = device_for("triton") if triton_backend is not None else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 2.0 ** -20  # the filtering threshold docs/fused_linear.md discusses ("Gradient filtering"; off by default)
# Options rotated through the grid: temperature, KL, entropy bonus. vocab 37 and hidden 20 are
# not multiples of the interpreter's 32-wide vocab tiles or 16-wide hidden tiles.
OPTIONS = [{}, {"temperature": 0.7}, {"beta": 0.05}, {"entropy_coef": 0.02, "temperature": 1.3}]


def _problem(dtype, packed=False, seed=0, vocab=37, batch=4, seq_len=7, logit_std=2.0):
    problem = make_problem(ProblemSpec(batch=batch, seq_len=seq_len, vocab=vocab, dtype=dtype, with_ref=True,
                                       empty_sequence=batch > 1, device=DEVICE, seed=seed, logit_std=logit_std))
    return problem.to_packed() if packed else problem


def _compare(dtype, level="sequence", loss_agg="seq-mean-token-mean", packed=False, eps=0.0, seed=0, with_bias=True,
             **options):
    problem = _problem(dtype, packed, seed)
    operands = linear_operands(problem, 20, seed)
    if not with_bias:
        operands[2] = None
    result = run_linear_case(problem, "triton", operands, fused=True, grad_filter_eps=eps, level=level,
                             loss_agg=loss_agg, max_len=7, **options)
    assert result.passed, result.failures()


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
@pytest.mark.parametrize("level", LEVELS)
def test_matches_materialized_reference(level, loss_agg, dtype, packed, seed):
    index = LEVELS.index(level) + LOSS_AGGS.index(loss_agg) + DTYPES.index(dtype) + packed
    # Filtering on in every other case: at these sizes no tile's probabilities all fall below eps,
    # so it must change nothing (test_filter_* below make it act).
    _compare(dtype, level, loss_agg, packed, eps=EPS if index % 2 else 0.0, seed=seed % 1000,
             with_bias=index % 3 != 0, **OPTIONS[index % len(OPTIONS)])


def _tail_grads(eps, tail=16.0, vocab=2000):
    """Gradients where all but the first 32 vocab entries sit `tail` nats down (a thin tail of
    total mass ~1.5e-5 per row at 16): whole tiles fall under the filter there."""
    problem = _problem(torch.float32, seed=5, vocab=vocab, batch=3, seq_len=6)
    hidden, weight, _ = linear_operands(problem, 20, 5)
    bias = torch.zeros(vocab, device=DEVICE)
    bias[32:] = -tail
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
    args, kwargs = problem.loss_args()
    kwargs.pop("temperature")
    loss, _ = gk.fused_linear_gspo_loss(leaves[0], leaves[1], *args[1:], bias=leaves[2], fused=True,
                                        grad_filter_eps=eps, entropy_coef=0.01, **kwargs)
    loss.backward()
    return [t.grad for t in leaves], (hidden, weight, bias), problem


def test_filter_drops_only_what_its_bound_allows():
    """Filtering skips the tail's tiles (the gradients move) and moves them by less than the
    probability mass it may drop: at most eps per row and skipped tile."""
    exact, operands, problem = _tail_grads(0.0)
    filtered, _, _ = _tail_grads(EPS)
    width = TileConfig.default(torch.float32).block_v  # 32 in the interpreter
    tiles = -(-problem.logits.shape[-1] // width)
    bound = tiles * EPS
    for name, a, b in zip(("hidden", "weight"), exact[:2], filtered[:2]):
        err = relative_error(b, a)
        assert 0 < err < 10 * bound, (name, err, bound)
    assert relative_error(filtered[2], exact[2]) < 1e-6  # d bias is never filtered
    # Off means exact: against the float64 reference on the same thin-tailed logits.
    result = run_linear_case(problem, "triton", list(operands), fused=True, grad_filter_eps=0.0, entropy_coef=0.01)
    assert result.passed, result.failures()


def test_selective_log_softmax_matches_chunked_path(seed):
    problem = _problem(torch.float32, packed=True, seed=seed % 1000)
    hidden, weight, bias = linear_operands(problem, 20, 1)
    targets = problem.target_ids
    outs = []
    for fused in (False, True):
        leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
        logp, entropy = gk.fused_linear_selective_log_softmax(
            leaves[0], leaves[1], targets, bias=leaves[2], temperature=0.9, return_entropy=True,
            backend="triton", fused=fused, grad_filter_eps=0.0, mask=problem.mask)
        weights = torch.linspace(0.5, 1.5, logp.numel(), device=logp.device)
        torch.where(problem.mask, logp * weights + 0.2 * entropy, torch.zeros_like(logp)).sum().backward()
        outs.append([logp.detach(), entropy.detach()] + [t.grad for t in leaves])
    for i, (name, a, b) in enumerate(zip(("logp", "entropy", "d hidden", "d weight", "d bias"), *outs)):
        keep = problem.mask if i < 2 else slice(None)  # per-token outputs: the rows in the loss
        assert relative_error(b[keep], a[keep]) < 1e-5, name


def test_one_row_and_strided_hidden():
    problem = _problem(torch.float32, batch=1, seq_len=1)
    operands = linear_operands(problem, 20, 2)
    result = run_linear_case(problem, "triton", operands, fused=True, grad_filter_eps=EPS)
    assert result.passed, result.failures()
    padded = _problem(torch.float32)
    hidden, weight, bias = linear_operands(padded, 20, 4)
    wide = torch.randn(hidden.shape[0], hidden.shape[1] + 1, hidden.shape[2], device=DEVICE)
    wide[:, :-1] = hidden
    leaf = wide.clone().requires_grad_()
    args, kwargs = padded.loss_args()
    loss, _ = gk.fused_linear_gspo_loss(leaf[:, :-1], weight, *args[1:], bias=bias, fused=True, **kwargs)
    loss.backward()
    assert leaf.grad[:, -1].abs().max() == 0 and leaf.grad[:, :-1].abs().max() > 0


def test_errors():
    problem = _problem(torch.float32)
    hidden, weight, bias = linear_operands(problem, 20, 0)
    args, kwargs = problem.loss_args()
    kwargs.pop("temperature")
    with pytest.raises(ValueError, match="Triton kernels"):
        gk.fused_linear_gspo_loss(hidden, weight, *args[1:], fused=True, backend="torch", **kwargs)
    for bad in (-0.1, 1.0, "0"):
        with pytest.raises(ValueError, match="grad_filter_eps"):
            gk.fused_linear_gspo_loss(hidden, weight, *args[1:], fused=True, grad_filter_eps=bad, **kwargs)
    with pytest.raises(TypeError, match="fused"):
        gk.fused_linear_gspo_loss(hidden, weight, *args[1:], fused="yes", **kwargs)


@pytest.mark.parametrize("eps", [0.0, EPS], ids=["unfiltered", "filtered"])
def test_row_rule_matches_the_chunked_path(eps):
    """A NaN hidden row outside the loss, an out-of-range target in it, a row with no upstream
    gradient: the tile kernels give what the chunked path gives, NaN where it has NaN."""
    problem = _problem(torch.float32, packed=True, seed=9)
    hidden, weight, bias = linear_operands(problem, 20, 9)
    targets = problem.target_ids.clone()
    mask = problem.mask.clone()
    mask[1] = False
    hidden = hidden.clone()
    hidden[1] = float("nan")  # outside the loss
    mask[4] = True
    targets[4] = weight.shape[0] + 3  # in the loss, out of range: NaN
    results = []
    for fused in (False, True):
        leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
        logp, entropy = gk.fused_linear_selective_log_softmax(
            leaves[0], leaves[1], targets, bias=leaves[2], return_entropy=True, backend="triton", fused=fused,
            grad_filter_eps=eps if fused else 0.0, mask=mask)  # the chunked path takes no filter
        upstream = torch.where(mask, torch.ones_like(logp), torch.zeros_like(logp))
        upstream[6] = 0.0  # in the loss with no gradient: zeros
        torch.where(mask, logp * upstream + 0.1 * entropy * upstream, torch.zeros_like(logp)).sum().backward()
        results.append([logp.detach(), leaves[0].grad, leaves[1].grad, leaves[2].grad])
    for name, a, b in zip(("logp", "d hidden", "d weight", "d bias"), *results):
        assert torch.equal(torch.isnan(a), torch.isnan(b)), name
        assert torch.allclose(a.nan_to_num(), b.nan_to_num(), rtol=1e-4, atol=1e-6), name
