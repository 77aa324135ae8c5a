"""The one-pass schedule of fused_linear_gspo_loss (linear/one_pass.py): its gradient formed in
forward, group of whole sequences by group. It gives two passes' loss and gradients for every
option it takes, forms no gradient where none is wanted, refuses a second backward, scales by
any upstream gradient, and says which schedule ran; the calls it cannot take run two passes, or
are refused with the reason under schedule='one_pass'."""

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.inputs.sequence_groups import sequence_groups
from gspo_kernels.linear import one_pass, products
from gspo_kernels.testing.problems import ProblemSpec, make_problem
from gspo_kernels.testing.verify import relative_error

from conftest import BACKENDS, device_for


def _case(backend, packed=False, seed=0, dtype=torch.float32):
    device = device_for(backend)
    problem = make_problem(ProblemSpec(batch=5, seq_len=9, vocab=41, with_ref=True, empty_sequence=True,
                                       device=device, seed=seed))
    if packed:
        problem = problem.to_packed()
    args, kwargs = problem.loss_args()
    kwargs.pop("temperature")
    gen = torch.Generator().manual_seed(seed)
    rows = args[0].shape[:-1]
    hidden = (torch.randn(*rows, 12, generator=gen) * 0.7).to(device=device, dtype=dtype)
    weight = (torch.randn(41, 12, generator=gen) * 0.5).to(device=device, dtype=dtype)
    bias = (torch.randn(41, generator=gen) * 0.2).to(device=device, dtype=dtype)
    return (hidden, weight, bias), args[1:], kwargs


def _run(operands, args, kwargs, schedule, frozen=(), scale=None, **options):
    leaves = [t.clone().requires_grad_(i not in frozen) for i, t in enumerate(operands)]
    loss, metrics = gk.fused_linear_gspo_loss(leaves[0], leaves[1], *args, bias=leaves[2], schedule=schedule,
                                              **kwargs, **options)
    (loss if scale is None else loss * scale).backward()
    return loss.detach(), metrics, [t.grad for t in leaves]


OPTIONS = [
    dict(chunk_size=9),
    dict(chunk_size=4, beta=0.05, entropy_coef=0.02, temperature=0.8),
    dict(chunk_size=20, level="token", loss_agg="token-mean", logit_softcap=3.0),
    dict(chunk_size=9, level="sequence_token", loss_agg="seq-mean-token-sum-norm", max_len=9),
    dict(chunk_size=9, level="token", objective="cispo", loss_agg="token-sum"),
    dict(chunk_size=9, sampling_top_k=7, sampling_top_p=0.9),
    dict(chunk_size=9, top_entropy_quantile=0.5, entropy_threshold=1.5, objective="gmpo"),
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o))
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_pass_gives_two_passes_result(backend, packed, options, seed):
    operands, args, kwargs = _case(backend, packed, seed % 1000)
    one = _run(operands, args, kwargs, "one_pass", **options)
    two = _run(operands, args, kwargs, "two_pass", **options)
    assert one[1]["fused_linear_one_pass"].item() == 1.0 and two[1]["fused_linear_one_pass"].item() == 0.0
    assert relative_error(one[0], two[0], floor=0.1) <= 1e-6
    for name in ("token_logprobs", "entropy", "clip_frac"):
        a, b = one[1][name], two[1][name]
        # A target outside the sampler's kept set has a -inf log-prob on both schedules.
        assert torch.equal(torch.isinf(a), torch.isinf(b)), name
        finite = torch.isfinite(b)
        assert relative_error(a[finite], b[finite], floor=1e-6) <= 1e-6, name
    for a, b in zip(one[2], two[2]):
        assert relative_error(a, b) <= 1e-5


@pytest.mark.parametrize("frozen", [(1, 2), (0,)], ids=["frozen_head", "hidden_frozen"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_only_the_wanted_gradients(backend, frozen, monkeypatch):
    """A frozen lm_head forms no `d weight` product (2NVH saved); hidden states that take no
    gradient form no `d hidden` product; each gradient still matches two passes'."""
    calls = {"weight": 0, "hidden": 0}
    add_weight, hidden_grad = products.Operands.add_weight_grad, products.Operands.hidden_grad

    def counted_weight(self, *args, **kwargs):
        calls["weight"] += 1
        return add_weight(self, *args, **kwargs)

    def counted_hidden(self, *args, **kwargs):
        calls["hidden"] += 1
        return hidden_grad(self, *args, **kwargs)

    monkeypatch.setattr(products.Operands, "add_weight_grad", counted_weight)
    monkeypatch.setattr(products.Operands, "hidden_grad", counted_hidden)
    operands, args, kwargs = _case(backend)
    one = _run(operands, args, kwargs, "one_pass", frozen=frozen, chunk_size=9)
    assert calls["weight" if 1 in frozen else "hidden"] == 0
    assert calls["hidden" if 1 in frozen else "weight"] > 0
    two = _run(operands, args, kwargs, "two_pass", frozen=frozen, chunk_size=9)
    for i, (a, b) in enumerate(zip(one[2], two[2])):
        assert (a is None) == (i in frozen) == (b is None)
        if a is not None:
            assert relative_error(a, b) <= 1e-5


def test_no_gradient_under_no_grad(monkeypatch):
    """A log-prob or evaluation pass under no_grad runs stage 3 on no group, and gives the loss."""
    calls = []
    grad = one_pass.slice_logits_grad
    monkeypatch.setattr(one_pass, "slice_logits_grad", lambda *a, **k: calls.append(1) or grad(*a, **k))
    operands, args, kwargs = _case("torch")
    with torch.no_grad():
        loss, metrics = gk.fused_linear_gspo_loss(*operands[:2], *args, bias=operands[2], chunk_size=9,
                                                  schedule="one_pass", **kwargs)
    assert not calls and not loss.requires_grad and metrics["fused_linear_one_pass"].item() == 1.0
    with_grad = _run(operands, args, kwargs, "one_pass", chunk_size=9)
    assert calls and relative_error(loss, with_grad[0], floor=0.1) <= 1e-7


def test_upstream_gradient_scales_and_a_second_backward_is_refused():
    operands, args, kwargs = _case("torch")
    plain = _run(operands, args, kwargs, "one_pass", chunk_size=9)
    scaled = _run(operands, args, kwargs, "one_pass", scale=-2.5, chunk_size=9)
    for a, b in zip(plain[2], scaled[2]):
        assert relative_error(b, -2.5 * a) <= 1e-6
    leaves = [t.clone().requires_grad_() for t in operands]
    loss, _ = gk.fused_linear_gspo_loss(leaves[0], leaves[1], *args, bias=leaves[2], chunk_size=9, **kwargs)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_calls_one_pass_cannot_take():
    operands, args, kwargs = _case("torch")
    call = dict(bias=operands[2], schedule="one_pass", **kwargs)
    cases = [
        (dict(chunk_size=2), "longer than 4 x 2 rows"),
        (dict(chunk_size=9, top_entropy_quantile=0.5), "quantile over the whole batch"),
        (dict(chunk_size=9, batch_invariant=True), "batch_invariant"),
    ]
    for options, reason in cases:
        with pytest.raises(ValueError, match=reason):
            gk.fused_linear_gspo_loss(*operands[:2], *args, **call, **options)
        auto = dict(call, schedule="auto")
        _, metrics = gk.fused_linear_gspo_loss(*operands[:2], *args, **auto, **options)
        assert metrics["fused_linear_one_pass"].item() == 0.0
    with pytest.raises(ValueError, match="schedule must be one of"):
        gk.LinearConfig(schedule="fast")


def test_groups_hold_whole_sequences():
    problem = make_problem(ProblemSpec(batch=4, seq_len=5, vocab=11, seed=0)).to_packed()
    args, kwargs = problem.loss_args()
    cu = torch.tensor([0, 3, 3, 10, 12, 20])
    from gspo_kernels.config import GSPOConfig
    from gspo_kernels.inputs.batch import CallInputs, prepare_batch
    from gspo_kernels.inputs.checks import TokenLayout

    layout = TokenLayout(torch.Size([20]), torch.device("cpu"))
    batch = prepare_batch(GSPOConfig(), layout, torch.zeros(20, dtype=torch.long), torch.zeros(20), torch.zeros(5),
                          CallInputs(cu_seqlens=cu))
    groups = sequence_groups(batch, 5, 8)
    assert [(g.rows.start, g.rows.stop) for g in groups] == [(0, 3), (3, 10), (10, 12), (12, 20)]
    assert [g.batch.segments.cu_seqlens.tolist() for g in groups] == [[0, 3, 3], [0, 7], [0, 2], [0, 8]]
    assert sequence_groups(batch, 5, 7) is None  # the 8-row sequence is longer than allowed
