"""LinearConfig: the fused-linear options validated once, passed as `linear=` or as keywords
(the same numbers either way), next to a GSPOConfig; and the errors of mixing the two forms."""

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.testing.problems import ProblemSpec, make_problem


def _inputs(seed):
    problem = make_problem(ProblemSpec(batch=3, seq_len=6, vocab=30, seed=seed % 1000))
    args, kwargs = problem.loss_args()
    gen = torch.Generator().manual_seed(seed % 1000)
    return torch.randn(3, 6, 12, generator=gen), torch.randn(30, 12, generator=gen), args[1:], kwargs


def _run(hidden, weight, rest, **kwargs):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, _ = gk.fused_linear_gspo_loss(h, w, *rest, **kwargs)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def test_linear_config_object_equals_keywords(seed):
    hidden, weight, rest, kwargs = _inputs(seed)
    options = dict(kwargs, level="token", backend="torch")
    by_keywords = _run(hidden, weight, rest, chunk_size=4, weight_grad_fp32=False, **options)
    by_object = _run(hidden, weight, rest, linear=gk.LinearConfig(chunk_size=4, weight_grad_fp32=False), **options)
    tensors = {name: value for name, value in kwargs.items() if name != "temperature"}
    config = gk.GSPOConfig(level="token", backend="torch", temperature=kwargs["temperature"])
    with_config = _run(hidden, weight, rest, config=config, chunk_size=4, weight_grad_fp32=False, **tensors)
    for a, b, c in zip(by_keywords, by_object, with_config):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_module_holds_both_configs():
    loss_fn = gk.FusedLinearGSPOLoss(chunk_size=3, level="token")
    assert loss_fn.linear == gk.LinearConfig(chunk_size=3)
    assert loss_fn.config == gk.GSPOConfig(level="token")
    assert "chunk_size=3" in repr(loss_fn) and "level='token'" in repr(loss_fn)


def test_mixing_forms_is_refused():
    hidden, weight, rest, kwargs = _inputs(0)
    with pytest.raises(TypeError, match="not both"):
        gk.fused_linear_gspo_loss(hidden, weight, *rest, linear=gk.LinearConfig(), chunk_size=4, **kwargs)
    with pytest.raises(TypeError, match="not both"):
        gk.fused_linear_gspo_loss(hidden, weight, *rest, config=gk.GSPOConfig(), level="token",
                                  **{k: v for k, v in kwargs.items() if k != "temperature"})
    with pytest.raises(TypeError, match="must be a LinearConfig"):
        gk.fused_linear_gspo_loss(hidden, weight, *rest, linear={"chunk_size": 4}, **kwargs)
    with pytest.raises(TypeError, match="must be a GSPOConfig"):
        gk.gspo_loss(torch.randn(3, 6, 30), *rest, config=gk.LinearConfig(), **kwargs)


@pytest.mark.parametrize("options, error, match", [
    ({"chunk_size": 0}, ValueError, "chunk_size must be a positive int"),
    ({"chunk_size": True}, ValueError, "chunk_size must be a positive int"),
    ({"fused": 1}, TypeError, "fused must be a bool"),
    ({"reduce_hidden_grad": None}, TypeError, "reduce_hidden_grad must be a bool"),
    ({"grad_filter_eps": 1.0}, ValueError, "grad_filter_eps must be a probability"),
    ({"grad_filter_eps": -1e-3}, ValueError, "grad_filter_eps must be a probability"),
    ({"grad_filter_eps": 1e-6}, ValueError, "pass fused=True"),  # nothing but the tile kernels reads it
])
def test_linear_config_validates_once(options, error, match):
    with pytest.raises(error, match=match):
        gk.LinearConfig(**options)
