"""The Triton launchers registered as torch custom ops pass torch.library.opcheck (run through
Triton's interpreter on a CPU, compiled on a GPU)."""

import pytest
import torch

from gspo_kernels import backends

from conftest import BACKENDS, device_for

tb = backends.triton_backend
pytestmark = pytest.mark.skipif("triton" not in BACKENDS, reason="triton not installed, or not runnable here "
                                "(the test header says why)")


@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck_triton_ops(dtype, with_entropy, with_mask):
    device = device_for("triton")
    full = torch.randn(2, 5, 97, device=device).to(dtype)
    logits = full[:, :-1]  # strided rows
    targets = torch.randint(0, 97, (8,), device=device)
    ops = torch.ops.gspo_kernels
    torch.library.opcheck(ops.triton_token_stats.default, (logits, targets, 1.3))
    _, entropy, lse = ops.triton_token_stats(logits, targets, 1.3)
    grad_logp = torch.randn_like(lse)
    grad_entropy = torch.randn_like(lse) if with_entropy else None
    row_mask = torch.rand(lse.shape, device=device) < 0.7 if with_mask else None
    args = (targets, lse, entropy, grad_logp, grad_entropy, row_mask, 1.3)
    torch.library.opcheck(ops.triton_logits_grad.default, (logits, *args))
    torch.library.opcheck(ops.triton_logits_grad_.default, (logits.clone(), *args))


def test_triton_inplace_op_refuses_overlapping_rows():
    device = device_for("triton")
    logits = torch.randn(1, 4, 33, device=device).expand(3, 4, 33)
    targets = torch.randint(0, 33, (12,), device=device)
    _, entropy, lse = torch.ops.gspo_kernels.triton_token_stats(logits, targets, 1.0)
    with pytest.raises(ValueError, match="do not share memory"):
        torch.ops.gspo_kernels.triton_logits_grad_(logits, targets, lse, entropy, torch.ones_like(lse), None, None, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck_triton_kept_thresholds(dtype):
    device = device_for("triton")
    logits = torch.randn(2, 5, 97, device=device).to(dtype)[:, :-1]  # strided rows
    for filters in ((3, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.1), (5, 0.9, 0.05)):
        torch.library.opcheck(torch.ops.gspo_kernels.triton_kept_thresholds.default, (logits, 1.3, 0.0, *filters))
    torch.library.opcheck(torch.ops.gspo_kernels.triton_kept_thresholds.default, (logits, 0.7, 2.5, 4, 0.9, 0.0))


def test_triton_kept_thresholds_refuses_bad_filters():
    from gspo_kernels.backends.triton import kept_set_ops
    from gspo_kernels.config.logit_map import LogitMap

    logits = torch.randn(3, 11, device=device_for("triton"))
    with pytest.raises(ValueError, match="top_p must be > 0"):
        kept_set_ops.kept_thresholds(logits, LogitMap(), 0, 0.0, 0.0)
    with pytest.raises(ValueError, match="min_p <= 1"):
        kept_set_ops.kept_thresholds(logits, LogitMap(), 0, 1.0, 1.5)
    with pytest.raises(ValueError, match="empty vocab"):
        kept_set_ops.kept_thresholds(logits[:, :0], LogitMap(), 5, 1.0, 0.0)
