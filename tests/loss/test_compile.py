"""torch.compile(fullgraph=True) traces the whole loss: no graph breaks, hence no host syncs."""

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.testing.problems import ProblemSpec, make_problem

from conftest import device_for


CASES = [("torch", False), ("torch", True), ("triton", False), ("triton", True), ("cpu", False)]
GSPO_TOKEN = dict(level="sequence_token", beta=0.05, entropy_coef=0.01)
# The stage-2 family in one graph: sync-free quantile, rollout weights, off-policy mask.
FAMILY = dict(objective="sapo", level="token", beta=0.05, use_bias_correction_kl=True,
              rollout_correction="sequence-mask", rollout_is_min=0.4, top_entropy_quantile=0.5,
              off_policy_mask_threshold=0.5, loss_agg="token-sum")


@pytest.mark.parametrize("family", [False, True], ids=["gspo_token", "family"])
@pytest.mark.parametrize("backend, packed", CASES, ids=[f"{b}-{'packed' if p else 'padded'}" for b, p in CASES])
def test_compiled_loss_matches_eager(backend, packed, family, seed):
    if backend == "triton" and gk.backends.triton_backend is None:
        pytest.skip("triton not installed")
    if backend == "cpu" and not gk.backends.native_available():
        pytest.skip("extension gspo_kernels.backends._C not built")
    problem = make_problem(ProblemSpec(seed=seed, device=device_for(backend), with_ref=True, with_rollout=family))
    if packed:
        problem = problem.to_packed()
    options = dict(FAMILY if family else GSPO_TOKEN, backend=backend)
    torch._dynamo.reset()

    @torch.compile(fullgraph=True)
    def step(logits, *rest, **kwargs):
        loss, metrics = gk.gspo_loss(logits, *rest, **kwargs, **options)
        return loss, metrics["clip_frac"]

    grads = []
    for fn in (step, lambda *a, **k: (gk.gspo_loss(*a, **k, **options)[0], None)):
        x = problem.logits.detach().clone().requires_grad_()
        args, kwargs = problem.loss_args(x)
        loss, _ = fn(*args, **kwargs)
        loss.backward()
        grads.append((loss.detach(), x.grad))
    (loss_c, grad_c), (loss_e, grad_e) = grads
    assert torch.allclose(loss_c, loss_e, rtol=1e-5, atol=1e-7)
    assert torch.allclose(grad_c, grad_e, rtol=1e-4, atol=1e-8)
