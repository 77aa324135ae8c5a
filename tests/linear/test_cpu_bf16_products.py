"""Fused linear on a CPU with native bf16 (AVX512-BF16 or AMX), forced on whatever this CPU has
(torch multiplies bf16 correctly without those units, only slower): the products take the bf16
operands as they are and torch returns them rounded to bf16, so the logits are the bf16 logits a
trainer's lm_head writes. The reference is the float64 loss on those same logits, with the
gradient of the exact product (each gradient product carries one bf16 rounding of dz and of its
result); every schedule and sweep, bias or none, a frozen head."""

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.linear import chunked, products
from gspo_kernels.linear.plan import LinearPlan
from gspo_kernels.testing import reference
from gspo_kernels.testing.problems import ProblemSpec, make_problem
from gspo_kernels.testing.verify import relative_error


@pytest.fixture(autouse=True)
def bf16_products(monkeypatch):
    monkeypatch.setattr(products, "cpu_has_native_bf16", lambda: True)


def _operands(seed, with_bias):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(4, 16, 32, generator=gen) * 0.6).bfloat16()
    weight = (torch.randn(96, 32, generator=gen) * 0.4).bfloat16()
    bias = (torch.randn(96, generator=gen) * 0.2).bfloat16() if with_bias else None
    return hidden, weight, bias


@pytest.mark.parametrize("weight_grad_fp32", [None, True])
@pytest.mark.parametrize("frozen", [False, True], ids=["full_head", "frozen_head"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("schedule", ["one_pass", "rows", "vocab"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_matches_the_loss_on_bf16_logits(backend, schedule, with_bias, frozen, weight_grad_fp32, monkeypatch, seed):
    """weight_grad_fp32=None sums `d weight` in bf16 inside each product here (the products are
    rounded to bf16 anyway); True sums the rounded products in float32."""
    if backend == "cpu" and not gk.backends.native_available():
        pytest.skip("extension gspo_kernels.backends._C not built")
    if schedule != "one_pass":
        monkeypatch.setattr(chunked, "choose_sweep", lambda *args: schedule)
    problem = make_problem(ProblemSpec(batch=4, seq_len=16, vocab=96, with_ref=True, seed=seed % 1000))
    args, kwargs = problem.loss_args()
    kwargs.pop("temperature")
    operands = _operands(seed % 1000, with_bias)
    leaves = [None if t is None else t.clone().requires_grad_(not (frozen and i == 1)) for i, t in enumerate(operands)]
    loss, metrics = gk.fused_linear_gspo_loss(leaves[0], leaves[1], *args[1:], bias=leaves[2], chunk_size=16,
                                              backend=backend, beta=0.05, entropy_coef=0.02,
                                              weight_grad_fp32=weight_grad_fp32, schedule="one_pass" if schedule == "one_pass" else "two_pass", **kwargs)
    loss.backward()
    refs = [None if t is None else t.detach().double().requires_grad_() for t in operands]
    h16, w16, b16 = operands
    logits16 = (h16 @ w16.t() if b16 is None else torch.addmm(b16, h16.reshape(-1, 32), w16.t()).view(4, 16, 96))
    exact = refs[0] @ refs[1].t() + (0 if refs[2] is None else refs[2])
    logits = logits16.double() + (exact - exact.detach())  # the bf16 values, the exact product's gradient
    ref_loss, ref_metrics = reference.gspo_loss(logits, *args[1:], beta=0.05, entropy_coef=0.02, **kwargs)
    ref_loss.backward()
    assert relative_error(loss, ref_loss, floor=0.1) <= 1e-5
    assert relative_error(metrics["token_logprobs"], ref_metrics["token_logprobs"], floor=1e-6) <= 1e-5
    for i, (leaf, ref) in enumerate(zip(leaves, refs)):
        if leaf is None or (frozen and i == 1):
            continue
        assert leaf.grad is not None and relative_error(leaf.grad, ref.grad) <= 2e-2, i
    if frozen:
        assert leaves[1].grad is None


def test_the_logits_are_bf16_and_two_passes_agree_with_one():
    """The chunk's logits are bf16 (the path ran), and the two schedules give the same loss from
    the same products, and gradients one bf16 rounding apart."""
    from gspo_kernels.linear.products import Operands

    hidden, weight, bias = _operands(3, True)
    assert Operands(weight, bias).logits(hidden[0]).dtype == torch.bfloat16
    problem = make_problem(ProblemSpec(batch=4, seq_len=16, vocab=96, seed=3))
    args, kwargs = problem.loss_args()
    kwargs.pop("temperature")
    runs = {}
    for schedule in ("one_pass", "two_pass"):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        loss, _ = gk.fused_linear_gspo_loss(leaves[0], leaves[1], *args[1:], bias=leaves[2], chunk_size=16,
                                            schedule=schedule, **kwargs)
        loss.backward()
        runs[schedule] = [loss.detach()] + [t.grad for t in leaves]
    assert relative_error(runs["one_pass"][0], runs["two_pass"][0], floor=0.1) <= 1e-6
    for one, two in zip(runs["one_pass"][1:], runs["two_pass"][1:]):
        assert relative_error(one, two) <= 1e-2


def test_plan_counts_bf16_logits_in_its_budget():
    """The default chunk holds twice as many bf16 rows as float32 ones: the budget is in bytes."""
    hidden, weight = torch.zeros(4096, 8, dtype=torch.bfloat16), torch.zeros(32768, 8, dtype=torch.bfloat16)
    plan = LinearPlan.of(gk.LinearConfig(), (1.0, 0.0), "torch", hidden, weight)
    assert plan.chunk == 512


def test_an_upstream_gradient_scales_in_float32():
    """A bf16 `d weight` (summed in bf16 here) scaled by the loss's upstream gradient in float32,
    rounded once (1/3 rounded to bf16 first would be 0.33398)."""
    hidden, weight, _ = _operands(5, False)
    problem = make_problem(ProblemSpec(batch=4, seq_len=16, vocab=96, seed=5))
    args, kwargs = problem.loss_args()
    kwargs.pop("temperature")
    grads = []
    for scale in (1.0, 1.0 / 3.0):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight)]
        loss, metrics = gk.fused_linear_gspo_loss(*leaves, *args[1:], chunk_size=16, **kwargs)
        assert metrics["fused_linear_one_pass"].item() == 1.0
        (loss * scale).backward()
        grads.append(leaves[1].grad)
    assert grads[0].dtype == torch.bfloat16
    assert torch.equal(grads[1], (grads[0].float() * torch.tensor(1.0 / 3.0)).bfloat16())
