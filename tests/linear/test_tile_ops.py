"""The fused-linear tile kernels as registered custom ops, like every other backend: opcheck of
both ops (schema, fake, autograd registration) and torch.compile(fullgraph=True) of the loss
with fused=True, through Triton's interpreter on a CPU (compiled on a GPU)."""

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels import backends
from gspo_kernels.testing.problems import ProblemSpec, make_problem

from conftest import device_for

pytestmark = pytest.mark.skipif(not backends.tiles_available(torch.device(device_for("triton")))
                                if backends.triton_backend is not None else True,
                                reason="needs Triton (CUDA, or its interpreter on a CPU)")
NEEDS = [(True, True, True), (True, False, False), (False, True, True), (False, False, True)]


def _operands(dtype, with_bias, device):
    gen = torch.Generator().manual_seed(3)
    hidden = (torch.randn(10, 20, generator=gen) * 0.6).to(dtype).to(device)
    weight = (torch.randn(37, 20, generator=gen) * 0.6).to(dtype).to(device)
    bias = (torch.randn(37, generator=gen) * 0.2).to(dtype).to(device) if with_bias else None
    targets = torch.randint(0, 37, (10,), generator=gen).to(device)
    return hidden, weight, bias, targets


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck_tile_ops(dtype, with_bias):
    device = device_for("triton")
    hidden, weight, bias, targets = _operands(dtype, with_bias, device)
    ops = torch.ops.gspo_kernels
    torch.library.opcheck(ops.triton_tile_token_stats.default, (hidden, weight, bias, targets, 1.3))
    _, entropy, lse = ops.triton_tile_token_stats(hidden, weight, bias, targets, 1.3)
    grad_logp = torch.randn_like(lse)
    for i, need in enumerate(NEEDS):
        grad_entropy = torch.randn_like(lse) if i % 2 else None
        row_mask = torch.rand(lse.shape, device=device) < 0.7 if i % 3 else None
        eps = 1e-3 if i % 2 else 0.0
        invariant = not i % 2  # the batch-invariant kernels (no filtering with them)
        torch.library.opcheck(ops.triton_tile_grads.default,
                              (hidden, weight, bias, targets, lse, entropy, grad_logp, grad_entropy, row_mask, 1.3,
                               *need, eps, invariant))


def test_tile_grads_shapes_follow_need():
    device = device_for("triton")
    hidden, weight, bias, targets = _operands(torch.float32, True, device)
    _, entropy, lse = torch.ops.gspo_kernels.triton_tile_token_stats(hidden, weight, bias, targets, 1.0)
    args = (hidden, weight, bias, targets, lse, entropy, torch.ones_like(lse), None, None, 1.0, 0.0)  # inv_temperature, softcap
    d_hidden, d_weight, d_bias = torch.ops.gspo_kernels.triton_tile_grads(*args, False, True, False, 0.0)
    assert d_hidden.shape == (0,) and d_bias.shape == (0,)
    assert d_weight.shape == weight.shape and d_weight.dtype == torch.float32 and bool(d_weight.abs().sum() > 0)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_compiled_fused_loss_matches_eager(packed, seed):
    problem = make_problem(ProblemSpec(batch=3, seq_len=6, vocab=37, seed=seed % 1000, device=device_for("triton"),
                                       with_ref=True))
    if packed:
        problem = problem.to_packed()
    args, kwargs = problem.loss_args()
    kwargs.pop("temperature")
    rows = tuple(problem.logits.shape[:-1])
    gen = torch.Generator().manual_seed(seed % 1000)
    hidden0 = torch.randn(*rows, 20, generator=gen).to(problem.logits.device)
    weight0 = torch.randn(37, 20, generator=gen).to(problem.logits.device)
    bias0 = torch.randn(37, generator=gen).to(problem.logits.device)
    torch._dynamo.reset()

    def step(h, w, b):
        loss, metrics = gk.fused_linear_gspo_loss(h, w, *args[1:], bias=b, fused=True, level="sequence_token",
                                                  beta=0.05, entropy_coef=0.01, **kwargs)
        return loss, metrics["clip_frac"]

    results = []
    for fn in (torch.compile(step, fullgraph=True), step):
        leaves = [t.clone().requires_grad_() for t in (hidden0, weight0, bias0)]
        loss, clip_frac = fn(*leaves)
        loss.backward()
        results.append((loss.detach(), clip_frac, *(t.grad for t in leaves)))
    compiled, eager = results
    assert torch.isfinite(eager[0])
    for a, b in zip(compiled, eager):
        # float32 atomics in backward: the sums may land in another order on a GPU.
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), (a - b).abs().max()
