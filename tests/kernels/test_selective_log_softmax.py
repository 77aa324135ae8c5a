"""The stage-1 op on its own: values, entropy and gradient against plain PyTorch in float64."""

import pytest
import torch

import gspo_kernels as gk

from conftest import BACKENDS, device_for


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(3, 5, 257), (11, 130)], ids=["padded", "packed"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_values_and_gradient(backend, shape, dtype, small_blocks):
    device = device_for(backend)
    logits = (torch.randn(shape) * 3).to(dtype).to(device)
    targets = torch.randint(0, shape[-1], shape[:-1], device=device, dtype=torch.int32)
    w_logp, w_ent = torch.randn(shape[:-1], device=device), torch.randn(shape[:-1], device=device)

    x = logits.clone().requires_grad_()
    logp, entropy = gk.selective_log_softmax(x, targets, temperature=1.3, return_entropy=True, backend=backend)
    ((logp * w_logp).sum() + (entropy * w_ent).sum()).backward()

    x64 = logits.double().requires_grad_()
    log_probs = torch.log_softmax(x64 / 1.3, -1)
    ref_logp = log_probs.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    ref_entropy = -(log_probs.exp() * log_probs).sum(-1)
    ((ref_logp * w_logp.double()).sum() + (ref_entropy * w_ent.double()).sum()).backward()

    assert logp.dtype == torch.float32 and logp.shape == targets.shape
    assert torch.allclose(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
    assert torch.allclose(entropy.double(), ref_entropy, rtol=1e-5, atol=1e-5)
    grad_tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert x.grad.dtype == dtype
    assert (x.grad.double() - x64.grad).norm() <= grad_tol * x64.grad.norm()


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_only_skips_the_entropy_term(backend):
    device = device_for(backend)
    logits = torch.randn(4, 6, 50, device=device)
    targets = torch.randint(0, 50, (4, 6), device=device)
    x = logits.clone().requires_grad_()
    gk.selective_log_softmax(x, targets, backend=backend).sum().backward()
    x64 = logits.double().requires_grad_()
    torch.log_softmax(x64, -1).gather(-1, targets.unsqueeze(-1)).sum().backward()
    assert torch.allclose(x.grad.double(), x64.grad, atol=1e-6)
