"""The objects every backend shares: the logit map (logit_map.LogitMap) against float64 math in
the model's terms and autograd, and GradInputs' positional op arguments against the argument
names of every op schema that takes them (so that no argument can land in another's place)."""

import dataclasses
import math

import pytest
import torch

from gspo_kernels import backends
from gspo_kernels.backends.contract import OP_ARG_NAMES, STATS_OP_ARG_NAMES, GradInputs, StatsInputs
from gspo_kernels.config.logit_map import LogitMap

# (temperature, logit_scale, logit_softcap) as models and trainers set them.
OPTIONS = [(1.0, 1.0, None), (0.7, 1.0, None), (1.3, 0.0625, None), (1.0, 1.0, 30.0), (0.6, 1.5, 2.5), (2.0, 0.25, 50.0)]


def _model_map(x64, temperature, logit_scale, logit_softcap):
    """What the model and trainer compute: scale, then c * tanh(y / c), then / temperature."""
    y = x64 * logit_scale
    if logit_softcap is not None:
        y = logit_softcap * torch.tanh(y / logit_softcap)
    return y / temperature


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_the_map_and_its_slope_against_float64(options):
    x = torch.linspace(-300.0, 300.0, 2001, dtype=torch.float64)
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1e-30, -1e-30], dtype=torch.float64)])
    logit_map = LogitMap.of(*options)
    want = _model_map(x, *options)
    z = logit_map.apply_(x.clone())
    assert torch.allclose(z, want, rtol=1e-13, atol=1e-13)
    slope = logit_map.slope(z)
    want_slope = torch.func.vmap(torch.func.grad(lambda v: _model_map(v, *options)))(x)
    assert torch.allclose(torch.as_tensor(slope, dtype=torch.float64).expand_as(x), want_slope, rtol=1e-10,
                          atol=1e-13)
    assert logit_map.capped == (options[2] is not None)
    assert logit_map.op_args() == (logit_map.inv_temperature, logit_map.softcap)


def test_the_map_keeps_the_order_and_saturates_exactly():
    logit_map = LogitMap.of(1.0, 1.0, 2.5)
    x = torch.tensor([-math.inf, -1e4, -1.0, 0.0, 1.0, 1e4, math.inf], dtype=torch.float64)
    z = logit_map.apply_(x.clone())
    assert torch.all(z[1:] >= z[:-1])
    assert z[0] == -2.5 and z[-1] == 2.5
    assert torch.all(logit_map.slope(z)[[0, -1]] == 0.0)  # exactly 0 where z saturates, as in float64


@pytest.mark.parametrize("options, what", [((1e308, 1e-308, None), "temperature / logit_scale"),
                                           ((1e-300, 1.0, 1e300), "logit_softcap / temperature"),
                                           ((1.0, 1e300, 1e-300), "logit_scale / logit_softcap")])
def test_a_map_outside_float_range_is_refused_by_name(options, what):
    with pytest.raises(ValueError, match=what):
        LogitMap.of(*options)


def test_grad_inputs_op_args_follow_the_names():
    """Each value op_args() passes sits at the position of the name it belongs to."""
    fields = [f.name for f in dataclasses.fields(GradInputs)]
    sentinels = {name: object() for name in fields if name != "logit_map"}
    inputs = GradInputs(**sentinels, logit_map=LogitMap(0.75, 3.5))
    values = dict(sentinels, inv_temperature=0.75, softcap=3.5)
    assert [values[name] for name in OP_ARG_NAMES] == list(inputs.op_args())
    assert [values[name] for name in OP_ARG_NAMES if name != "kept_min"] == list(inputs.op_args(kept_set=False))
    assert set(OP_ARG_NAMES) == set(values)


def _schema_names(op) -> list[str]:
    return [a.name for a in op.default._schema.arguments]


def _schemas_taking_inputs():
    """(op, the names after `logits` its schema must have): the gradient ops take GradInputs'
    op_args, the stats ops StatsInputs'."""
    ops = []
    if backends.native_available():
        ops += [(torch.ops.gspo_kernels.logits_grad, OP_ARG_NAMES), (torch.ops.gspo_kernels.logits_grad_, OP_ARG_NAMES),
                (torch.ops.gspo_kernels.token_stats, STATS_OP_ARG_NAMES),
                # native_backend.sampled_token_stats passes StatsInputs' op_args less kept_min
                (torch.ops.gspo_kernels.sampled_token_stats, (*STATS_OP_ARG_NAMES[:-1], "top_k", "top_p", "min_p"))]
    if backends.triton_backend is not None:
        ops += [(torch.ops.gspo_kernels.triton_logits_grad, OP_ARG_NAMES),
                (torch.ops.gspo_kernels.triton_logits_grad_, OP_ARG_NAMES),
                (torch.ops.gspo_kernels.triton_token_stats, STATS_OP_ARG_NAMES)]
    return ops


@pytest.mark.parametrize("op, names", _schemas_taking_inputs(), ids=lambda x: getattr(x, "_qualified_op_name", ""))
def test_every_schema_takes_its_inputs_op_args_in_order(op, names):
    assert _schema_names(op) == ["logits", *names]


def test_stats_inputs_op_args_follow_the_names():
    inputs = StatsInputs(targets=object(), logit_map=LogitMap(0.75, 3.5), kept_min=object())
    values = dict(targets=inputs.targets, inv_temperature=0.75, softcap=3.5, kept_min=inputs.kept_min)
    assert [values[name] for name in STATS_OP_ARG_NAMES] == list(inputs.op_args())


def test_the_stats_and_selection_schemas_take_the_map_by_its_names():
    ops = []
    if backends.native_available():
        ops += [torch.ops.gspo_kernels.token_stats, torch.ops.gspo_kernels.kept_thresholds,
                torch.ops.gspo_kernels.sampled_token_stats]
    if backends.triton_backend is not None:
        ops += [torch.ops.gspo_kernels.triton_token_stats, torch.ops.gspo_kernels.triton_kept_thresholds]
    if backends.triton_tiles is not None:
        ops += [torch.ops.gspo_kernels.triton_tile_token_stats]
        names = _schema_names(torch.ops.gspo_kernels.triton_tile_grads)
        start = names.index("targets")
        assert names[start:start + len(OP_ARG_NAMES) - 1] == list(OP_ARG_NAMES[:-1])  # no kept set
    assert ops, "no op to check: neither the extension nor Triton is here"
    for op in ops:
        names = _schema_names(op)
        start = names.index("inv_temperature")
        assert tuple(names[start:start + 2]) == LogitMap.OP_ARG_NAMES, op


@pytest.mark.parametrize("name", ["torch", "cpu", "cuda", "triton"])
def test_every_backend_module_has_the_contracts_signatures(name):
    """Each module backends.get returns defines contract.Backend's functions with its parameter
    names, in its order (a caller may pass any of them by name)."""
    import inspect

    from gspo_kernels.backends.contract import Backend

    module = backends.get(name)
    if module is None:
        pytest.skip(f"{name}: not installed here")
    for function in ("token_stats", "logits_grad", "logits_grad_"):
        want = list(inspect.signature(getattr(Backend, function)).parameters)[1:]  # without self
        assert list(inspect.signature(getattr(module, function)).parameters) == want, (name, function)
