"""The cpu forward that selects the sampler's kept set as it reads each row
(gspo_kernels::sampled_token_stats, csrc/cpu/kernels.cpp) against the two passes it replaces,
kept_thresholds then token_stats: the same thresholds to the bit, so the same kept sets; the same
stats to the bit on every row that keeps every token (the plain path) and within float32 sums'
rounding elsewhere (top-p's stats there are the selection's own float64 sums); the same NaN and
-inf entries. The rows are those whose ties stop top-p's search on the masses (runs of a few
values: the finish takes the tied bracket) or send it to the search on the logits (a flat row)
as well as those it settles (spread and peaked rows)."""

import math

import pytest
import torch

from conftest import BACKENDS

pytestmark = pytest.mark.skipif("cpu" not in BACKENDS, reason="the cpu backend's op")

VOCAB = 4099  # past the sampled 1024 and the bracket's 256, not a multiple of 16
FILTERS = [(0, 0.9, 0.0), (0, 0.3, 0.0), (0, 0.999, 0.0), (50, 1.0, 0.0), (0, 1.0, 0.1), (20, 0.8, 0.01),
           (500, 0.95, 0.0), (1, 1.0, 0.0)]
MAPS = [(1.0, 0.0), (0.7, 0.0), (1 / 30, 30.0)]


def _rows(gen):
    x = torch.randn(12, VOCAB, generator=gen, dtype=torch.float64) * 2.0
    x[1] *= 4.0  # peaked: a few logits carry the mass
    x[2] = (x[2] * 2).round() / 2  # runs of a few values
    x[3] = 1.0  # flat: every mass equal
    x[4, 17] = math.nan
    x[5] = -math.inf
    x[5, 3] = 0.5  # one finite logit
    x[6, 40] = math.inf  # +inf: NaN results without a soft-cap
    x[7, ::2] = math.nextafter(0.0, 1.0)  # denormals beside zeros
    x[7, 1::2] = 0.0
    x[8] = x[8] * 0.01  # nearly flat
    x[9, :100] += 30.0  # a block far above the rest
    return x.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_sampled_forward_matches_thresholds_then_stats(dtype, seed):
    gen = torch.Generator().manual_seed(seed % 2**31)
    x = _rows(gen).to(dtype)
    ops = torch.ops.gspo_kernels
    targets = torch.randint(0, VOCAB, (x.shape[0],), generator=gen)
    targets[9] = 5  # a target among the block above the rest (kept)
    for inv_t, cap in MAPS:
        for filters in FILTERS:
            where = f"{dtype}, map {(inv_t, cap)}, filters {filters}"
            thresholds = ops.kept_thresholds(x, inv_t, cap, *filters)
            want = ops.token_stats(x, targets, inv_t, cap, thresholds)
            *got, got_thresholds = ops.sampled_token_stats(x, targets, inv_t, cap, *filters)
            assert torch.equal(got_thresholds, thresholds), where
            every = thresholds == -math.inf
            for name, g, w in zip(("logp", "entropy", "lse"), got, want):
                assert torch.equal(g.isnan(), w.isnan()), (name, where)
                assert torch.equal(g == -math.inf, w == -math.inf), (name, where)
                # the plain path, bitwise
                torch.testing.assert_close(g[every], w[every], rtol=0, atol=0, equal_nan=True, msg=f"{name}, {where}")
                finite = torch.isfinite(w)
                torch.testing.assert_close(g[finite], w[finite], rtol=2e-6, atol=2e-6, msg=f"{name}, {where}")


def test_sampled_forward_reads_strided_rows():
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(2, 9, 1031, generator=gen).to(torch.bfloat16) * 3
    x = full[:, :-1]  # rows 9 apart in the first dim, 1031 in the second: not contiguous
    targets = torch.randint(0, 1031, (16,), generator=gen)
    ops = torch.ops.gspo_kernels
    *got, thresholds = ops.sampled_token_stats(x, targets, 1.0, 0.0, 0, 0.9, 0.0)
    assert torch.equal(thresholds.reshape(-1), ops.kept_thresholds(x.contiguous(), 1.0, 0.0, 0, 0.9, 0.0).reshape(-1))
    want = ops.token_stats(x.contiguous(), targets, 1.0, 0.0, thresholds.reshape(-1))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.reshape(-1), w, rtol=2e-6, atol=2e-6)
