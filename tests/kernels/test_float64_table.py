"""One float64 table, every backend held to it: for rows of every kind a kernel meets (spread,
peaked, large, ties, -inf logits, soft-cap saturation, a kept set) under each logit map, the
log-prob, the entropy and each logit's gradient dLoss/dx for upstream g (log-prob) and h
(entropy), computed by autograd in float64 from the map's definition in the model's terms.
Each backend's token_stats and logits_grad (contract.Backend) must give the table's values."""

import math

import pytest
import torch

from gspo_kernels import backends
from gspo_kernels.backends.contract import GradInputs, StatsInputs
from gspo_kernels.config.logit_map import LogitMap

from conftest import BACKENDS, device_for

# (temperature, logit_scale, logit_softcap)
MAPS = [(1.0, 1.0, None), (0.7, 1.0, None), (1.3, 0.5, 2.5), (1.0, 1.0, 30.0)]
VOCAB = 67


def _rows() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, VOCAB, generator=gen, dtype=torch.float64)
    x[1] *= 8.0  # peaked
    x[2] += 300.0  # large: the shift must not lose digits
    x[3] = torch.round(x[3])  # ties
    x[4, :20] = -math.inf  # -inf logits: probability 0, gradient 0
    x[5] *= 40.0  # saturates a soft-cap
    x[6, 5] += 25.0  # one token holds nearly all the mass
    return x


def _model_z(x, temperature, logit_scale, logit_softcap):
    y = x * logit_scale
    if logit_softcap is not None:
        y = logit_softcap * torch.tanh(y / logit_softcap)
    return y / temperature


def _table(x, targets, kept_min, options, g, h):
    """(logp, entropy, d loss / d x) in float64, loss = sum(g * logp + h * entropy)."""
    leaf = x.clone().requires_grad_()
    z = _model_z(leaf, *options)
    if kept_min is not None:
        z = torch.where(leaf < kept_min[:, None], -math.inf, z)
    logp_all = torch.log_softmax(z, -1)
    p = logp_all.exp()
    entropy = -(p * torch.where(p > 0, logp_all, 0.0)).sum(-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    (g * logp + h * entropy).sum().backward()
    return logp.detach(), entropy.detach(), torch.nan_to_num(leaf.grad, nan=0.0)  # -inf logits: 0 * nan -> 0


@pytest.mark.parametrize("with_kept_set", [False, True], ids=["all", "kept"])
@pytest.mark.parametrize("options", MAPS, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_gives_the_float64_table(backend, options, with_kept_set):
    device = device_for(backend)
    x = _rows().float().double()  # the float32 logits the backends read, in float64
    targets = torch.arange(8) * 5 % (VOCAB - 25) + 25  # in [25, V): never a -inf logit of row 4
    gen = torch.Generator().manual_seed(1)
    g, h = torch.randn(8, generator=gen, dtype=torch.float64), torch.randn(8, generator=gen, dtype=torch.float64)
    kept_min = None
    if with_kept_set:  # each row keeps its logits at or above its 20th largest, targets kept
        kept_min = torch.minimum(x.topk(20, -1).values[:, -1], x.gather(-1, targets[:, None]).squeeze(-1))
    logp64, entropy64, grad64 = _table(x, targets, kept_min, options, g, h)
    module = backends.get(backend)
    logits = x.float().to(device)
    kept = None if kept_min is None else kept_min.float().to(device)
    logit_map = LogitMap.of(*options)
    logp, entropy, lse = module.token_stats(logits, StatsInputs(targets.to(device), logit_map, kept))
    # The table is of the float32 logits' own values: only the kernels' rounding is left.
    assert torch.allclose(logp.double().cpu(), logp64, rtol=1e-5, atol=2e-5), (logp.cpu(), logp64)
    assert torch.allclose(entropy.double().cpu(), entropy64, rtol=1e-5, atol=2e-5), (entropy.cpu(), entropy64)
    inputs = GradInputs(targets.to(device), lse, entropy, g.float().to(device), h.float().to(device), None,
                        logit_map, kept)
    grad = module.logits_grad(logits, inputs).double().cpu()
    assert torch.allclose(grad, grad64, rtol=1e-4, atol=2e-6), (grad - grad64).abs().max()
