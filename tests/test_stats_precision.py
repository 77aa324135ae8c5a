"""Precision of the token statistics against float64, and NaN/inf wherever they sit in a row.

The rows span several kernel blocks and their max may sit in any block: a kernel that takes a
block's exps below that block's max must not lose the entropy to cancellation.
"""

import math

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.verify import STATS_LIMIT, token_stats_errors

from conftest import BACKENDS, device_for


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_logprob_and_entropy_within_float32_level(backend, dtype, seed):
    logp_err, entropy_err = token_stats_errors(backend, dtype, device_for(backend), seed=seed % 1000)
    assert logp_err <= STATS_LIMIT
    assert entropy_err <= STATS_LIMIT


# Vector lanes, the scalar tail, the first block, a later block below the running max, and a
# later block that raises it (the CPU kernel's correction pass): a NaN or +inf in any of them
# must turn the row's results NaN.
_POSITIONS = {"first": 0, "lane5": 5, "block1": 4096 + 17, "raising_block": 2 * 4096 + 33, "tail": 3 * 4096 + 2}


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("where", list(_POSITIONS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_logit_anywhere_makes_the_row_nan(backend, where, value, seed):
    device = device_for(backend)
    vocab = 3 * 4096 + 3
    logits = torch.randn(3, vocab, device=device)
    logits[:, 2 * 4096 + 40] = 9.0  # the third block raises the row's max
    logits[1, _POSITIONS[where]] = value
    targets = torch.tensor([1, 2, 3], device=device)
    leaf = logits.clone().requires_grad_()
    logp, entropy = gk.selective_log_softmax(leaf, targets, backend=backend, return_entropy=True)
    (logp.sum() + entropy.sum()).backward()
    assert math.isnan(logp[1].item()) and math.isnan(entropy[1].item())
    assert torch.isnan(leaf.grad[1]).all()
    assert torch.isfinite(logp[[0, 2]]).all() and torch.isfinite(entropy[[0, 2]]).all()
    assert torch.isfinite(leaf.grad[[0, 2]]).all()
