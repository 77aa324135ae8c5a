"""Every backend against the float64 reference over levels, aggregations and dtypes."""

import pytest
import torch

from gspo_kernels.config import LEVELS, LOSS_AGGS
from gspo_kernels.testing.problems import ProblemSpec, make_problem
from gspo_kernels.testing.verify import run_case

from conftest import BACKENDS, device_for

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.triton_pairwise
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference(backend, level, loss_agg, dtype, seed, small_blocks):
    spec = ProblemSpec(dtype=dtype, empty_sequence=True, vocab=300, device=device_for(backend), seed=seed)
    result = run_case(make_problem(spec), backend, level=level, loss_agg=loss_agg)
    assert result.passed, result.failures()


@pytest.mark.parametrize("level", LEVELS)
def test_problems_clip_on_both_sides(level, seed):
    """The grid above is only meaningful if its problems clip low and high."""
    from gspo_kernels.testing import reference

    problem = make_problem(ProblemSpec(seed=seed, token_advantages=(level == "token")))
    args, kwargs = problem.loss_args()
    _, metrics = reference.gspo_loss(*args, **kwargs, level=level)
    assert metrics["clip_frac_low"] > 0
    assert metrics["clip_frac_high"] > 0
    assert metrics["clip_frac"] < 1
