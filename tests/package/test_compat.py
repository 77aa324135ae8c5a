"""gspo_kernels/compat.py on this torch: the version boundaries as they were seen on each side
(README, "Supported versions"), and custom_op registering an op from string annotations (the form
torch 2.4 could not read; scripts/support_matrix.sh runs the package on 2.4.1 itself)."""

from __future__ import annotations

import typing

import torch

from gspo_kernels import compat


def test_the_interpreter_and_numpy_pairings_seen_on_each_side():
    refused = [("3.5.1", "2.4.0"), ("3.6.0", "2.4.6"), ("3.6.0", "2.5.5")]
    run = [("3.5.1", "2.3.5"), ("3.6.0", "2.3.0"), ("3.7.1", "2.4.6"), ("3.8.0", "2.4.6"), ("3.2.0", "2.2.6")]
    for triton, numpy in refused:
        why = compat.triton_interpreter_problem(triton, numpy)
        assert why is not None and "numpy<2.4" in why and triton in why, (triton, numpy)
    for triton, numpy in run:
        assert compat.triton_interpreter_problem(triton, numpy) is None, (triton, numpy)


def test_triton_older_than_3_2_is_refused():
    assert "older than 3.2" in compat.triton_version_problem("3.0.0")
    assert "older than 3.2" in compat.triton_version_problem("3.1.0")
    for version in ("3.2.0", "3.6.0", "3.8.0", "3.10.0+git1234"):
        assert compat.triton_version_problem(version) is None


def test_annotations_become_forms_every_torch_infers():
    assert compat._typing_form(torch.Tensor | None) == typing.Optional[torch.Tensor]
    assert compat._typing_form(tuple[torch.Tensor, torch.Tensor]) == typing.Tuple[torch.Tensor, torch.Tensor]
    assert compat._typing_form(type(None)) is None
    assert compat._typing_form(float) is float


@compat.custom_op("gspo_kernels_test::scaled", mutates_args=())
def _scaled(x: torch.Tensor, scale: float, shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    out = x * scale
    return out, out if shift is None else out + shift


def test_custom_op_from_string_annotations():
    x = torch.arange(3.0)
    a, b = torch.ops.gspo_kernels_test.scaled(x, 2.0, torch.ones(3))
    assert torch.equal(a, x * 2) and torch.equal(b, x * 2 + 1)
    assert "Tensor? shift=None" in str(torch.ops.gspo_kernels_test.scaled.default._schema)


def test_a_torch_older_than_2_4_is_refused_by_name():
    import pytest

    with pytest.raises(ImportError, match="needs torch 2.4 or later.*this is torch 2.3.1"):
        compat.check_torch("2.3.1+cu121")
    compat.check_torch("2.4.1+cu121")
    compat.check_torch(torch.__version__)
