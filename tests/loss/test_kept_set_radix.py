"""The cpu selection's radix select, its passes by max for ranks below 64, and compress
(csrc/cpu/row_select.h) on the rows that can trip them (top-k 1, 3 and 37 select by max, 500 and
2000 by radix): signed zeros across the boundary (two bit patterns, one value), rows whose logits share
their top key bits (one exponent), long runs of one value, a vocab past the strided sample's 1024
(the bound from the sample, then its candidates), and top-k whose last dropped logit lies outside
the candidates. Each kept set is the float64 sampler's, and without a soft-cap the threshold is the
PyTorch pre-pass's to the bit (below top-p 0.99, where that float32 pre-pass is exact)."""

import math

import pytest
import torch

from gspo_kernels.config.logit_map import LogitMap
from gspo_kernels.testing import reference
from gspo_kernels.token_stats.kept_set import SamplingFilter, kept_thresholds

from conftest import BACKENDS

pytestmark = pytest.mark.skipif("cpu" not in BACKENDS, reason="the cpu backend's selection")

VOCAB = 4099  # past the sample's 1024 logits, not a multiple of 16 or of the 256 bins


def _rows(gen):
    x = torch.randn(8, VOCAB, generator=gen, dtype=torch.float64)
    x[0] = torch.where(torch.rand(VOCAB, generator=gen) < 0.5, 0.0, -0.0)  # +0 and -0 only: one value
    x[0, :5] = 1.0
    x[1] = 1.0 + torch.rand(VOCAB, generator=gen, dtype=torch.float64) * 0.999  # all in [1, 2): one exponent
    x[2] = (x[2] * 2).round() / 2  # runs of a few values
    x[3, : VOCAB // 3] = -0.0  # -0 below a mix of signs
    x[3, VOCAB // 3: VOCAB // 2] = 0.0
    x[4] = -x[4].abs() - 1.0  # all negative: flipped keys
    x[5, :] = -5.0
    x[5, :40] = torch.linspace(3.0, 1.0, 40)  # top-k's last dropped logit far below its candidates
    x[6] = torch.randn(VOCAB, generator=gen, dtype=torch.float64) * 8.0  # peaked: few candidates carry the mass
    x[7, :: 2] = math.nextafter(0.0, 1.0)  # denormals beside zeros
    return x.float()


FILTERS = [SamplingFilter(1), SamplingFilter(3), SamplingFilter(37), SamplingFilter(2000), SamplingFilter(None, 0.3),
           SamplingFilter(None, 0.9), SamplingFilter(None, 0.999), SamplingFilter(None, None, 0.5),
           SamplingFilter(20, 0.8, 0.01), SamplingFilter(500, 0.95, None)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_radix_selection_keeps_the_samplers_set(dtype, seed):
    gen = torch.Generator().manual_seed(seed % 2**31)
    x = _rows(gen).to(dtype)
    xf = x.float()
    # A cap that the rows do not saturate: a saturated tanh makes float32 z ties that float64 z
    # are not, and which of them top-p keeps is then the map's rounding, not the selection's.
    for logit_map in ((1.0, 0.0), (0.05, 30.0)):
        scale, cap = logit_map
        x64 = xf.double()
        z64 = cap * torch.tanh(x64 * scale) if cap > 0 else x64 * scale
        for sampling in FILTERS:
            where = f"{sampling}, map {logit_map}, {dtype}"
            got = kept_thresholds(x, LogitMap(*logit_map), sampling, "cpu")
            kept = (xf >= got[:, None]) | (got == -math.inf)[:, None]
            want = reference.sampler_kept(z64, sampling.top_k, sampling.top_p, sampling.min_p, order=x64)
            bad = (kept != want).any(-1).nonzero().flatten().tolist()
            assert not bad, f"{where}: rows {bad}"
            # At top-p 0.999 the pre-pass's float32 running sum over thousands of tokens is off by
            # more than the masses that decide the boundary (here on row 3): it keeps another set
            # than the float64 sampler, which the selection matches (asserted above).
            if cap == 0.0 and (sampling.top_p or 0.0) < 0.99:
                assert torch.equal(got, kept_thresholds(x, LogitMap(*logit_map), sampling, "torch")), where


def test_signed_zeros_are_one_value_at_the_top_k_boundary():
    """Five ones, then +0 and -0 alike: top-6 keeps the ones and every zero (a tie with the sixth
    largest), whichever sign the sixth has."""
    row = torch.tensor([1.0] * 5 + [0.0, -0.0] * 50 + [-1.0] * 20)
    got = kept_thresholds(row[None], LogitMap(1.0, 0.0), SamplingFilter(6), "cpu")
    kept = row >= got[0]
    assert kept[:105].all() and not kept[105:].any()
