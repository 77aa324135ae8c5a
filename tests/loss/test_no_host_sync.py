"""On a GPU the loss path (forward and backward) makes no host-device synchronisation."""

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.testing.problems import ProblemSpec, make_problem

from conftest import BACKENDS, device_for

GPU_BACKENDS = [b for b in BACKENDS if device_for(b) == "cuda"]


@pytest.mark.skipif(not GPU_BACKENDS, reason="needs a GPU backend (a CUDA device)")
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("backend", GPU_BACKENDS or ["none"])
def test_no_sync_in_forward_and_backward(backend, packed, seed):
    problem = make_problem(ProblemSpec(device="cuda", seed=seed, with_ref=True, empty_sequence=True))
    if packed:
        problem = problem.to_packed()  # cu_seqlens on the GPU: checked by a device-side assert

    def step():
        logits = problem.logits.detach().clone().requires_grad_()
        args, kwargs = problem.loss_args(logits)
        loss, _ = gk.gspo_loss(*args, **kwargs, backend=backend, beta=0.05, entropy_coef=0.01)
        loss.backward()

    step()  # warm-up: kernel compilation may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
