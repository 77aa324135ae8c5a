"""The sampler's kept set (sampling_top_k / _top_p / _min_p, or a given sampling_threshold): the
log-probs and entropies of the softmax renormalised over the tokens vLLM's sampler keeps, on
every backend and the chunked fused-linear path, against the float64 reference sampler
(reference.sampler_kept: vLLM v1's min-p, top-k, top-p, read from its sampler)."""

import math

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.backends import triton_backend
from gspo_kernels.config.logit_map import LogitMap
from gspo_kernels.testing import reference
from gspo_kernels.testing.verify import relative_error

from conftest import BACKENDS, device_for

FILTERS = [dict(sampling_top_k=4), dict(sampling_top_p=0.7), dict(sampling_min_p=0.15),
           dict(sampling_top_k=12, sampling_top_p=0.85, sampling_min_p=0.02),
           dict(sampling_top_p=0.9, logit_softcap=2.5, logit_scale=1.5)]


def _id(options):
    return ",".join(f"{k.removeprefix('sampling_').removeprefix('logit_')}={v}" for k, v in options.items())


def _sampled(logits64, temperature, options, gen):
    """Targets drawn from the reference sampler's distribution (every one inside its kept set)."""
    z = logits64 * options.get("logit_scale", 1.0)
    if "logit_softcap" in options:
        z = options["logit_softcap"] * torch.tanh(z / options["logit_softcap"])
    z = (z / temperature).reshape(-1, logits64.shape[-1])
    kept = reference.sampler_kept(z, options.get("sampling_top_k"), options.get("sampling_top_p"),
                                  options.get("sampling_min_p"), order=logits64.reshape(z.shape))
    probs = torch.softmax(torch.where(kept, z, torch.full_like(z, -math.inf)), -1)
    return torch.multinomial(probs, 1, generator=gen).reshape(logits64.shape[:-1]), probs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("options", FILTERS, ids=_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sampled_tokens_log_probs_are_the_samplers(backend, options, dtype):
    gen = torch.Generator().manual_seed(3)
    logits = (2 * torch.randn(3, 6, 60, generator=gen)).to(dtype).to(device_for(backend))
    targets, probs = _sampled(logits.double().cpu(), 0.8, options, gen)
    logp = gk.selective_log_softmax(logits, targets.to(logits.device), 0.8, backend=backend, **options)
    want = probs.gather(-1, targets.reshape(-1, 1)).log().reshape(targets.shape)
    assert torch.isfinite(logp).all()
    assert torch.allclose(logp.double().cpu(), want, atol=2e-6, rtol=0), (logp.double().cpu() - want).abs().max()


@pytest.mark.parametrize("options", FILTERS, ids=_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_values_gradients_and_targets_outside_the_kept_set(backend, options):
    gen = torch.Generator().manual_seed(5)
    logits = (2 * torch.randn(4, 5, 40, generator=gen)).to(device_for(backend))
    targets = torch.randint(0, 40, (4, 5), generator=gen).to(logits.device)  # many outside the kept set
    upstream = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    results = []
    for fn, leaf in ((gk.selective_log_softmax, logits.clone()), (reference.selective_log_softmax, logits.double())):
        leaf.requires_grad_()
        extra = {"backend": backend} if fn is gk.selective_log_softmax else {}
        lp, ent = fn(leaf, targets, 0.8, True, **extra, **options)
        # A target outside the kept set has a -inf log-prob: its upstream gradient is 0 here.
        finite = torch.isfinite(lp)
        (torch.where(finite, lp.double() * upstream.to(lp.device), 0).sum() + 0.3 * ent.double().sum()).backward()
        results.append((lp.detach().double().cpu(), ent.detach().double().cpu(), leaf.grad.double().cpu()))
    (lp, ent, grad), (want_lp, want_ent, want_grad) = results
    assert torch.equal(torch.isfinite(lp), torch.isfinite(want_lp)) and (~torch.isfinite(want_lp)).any()
    assert (lp[~torch.isfinite(lp)] == -math.inf).all()  # never NaN
    finite = torch.isfinite(want_lp)
    assert torch.allclose(lp[finite], want_lp[finite], atol=2e-6)
    assert torch.allclose(ent, want_ent, atol=2e-6)
    assert torch.allclose(grad, want_grad, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_loss_against_the_reference(backend):
    gen = torch.Generator().manual_seed(7)
    logits = (2 * torch.randn(4, 6, 50, generator=gen)).to(device_for(backend))
    options = dict(sampling_top_p=0.8, sampling_top_k=10, temperature=0.9)
    targets, probs = _sampled(logits.double().cpu(), 0.9, options, gen)
    logp = probs.gather(-1, targets.reshape(-1, 1)).log().reshape(targets.shape)
    shift = torch.tensor([-0.01, 0.01, 0.0005, -0.0005], dtype=torch.float64)[:, None]  # the first two clip
    old = (logp + shift).float().to(logits.device)
    advantages = torch.tensor([1.0, -0.7, 0.4, -1.2], device=logits.device)
    targets = targets.to(logits.device)
    leaf, ref_leaf = logits.clone().requires_grad_(), logits.double().cpu().requires_grad_()
    loss, metrics = gk.gspo_loss(leaf, targets, old, advantages, backend=backend, eps_low=0.002, eps_high=0.002,
                                 entropy_coef=0.01, **options)
    loss.backward()
    want, want_metrics = reference.gspo_loss(ref_leaf, targets.cpu(), old.cpu(), advantages.cpu(), eps_low=0.002,
                                             eps_high=0.002, entropy_coef=0.01, **options)
    want.backward()
    assert abs(float(loss) - float(want)) <= 1e-5 * abs(float(want))
    assert float((leaf.grad.double().cpu() - ref_leaf.grad).norm() / ref_leaf.grad.norm()) < 1e-5
    assert 0 < float(want_metrics["clip_frac"]) < 1  # the ratios straddle the clip


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_chunked_path(backend):
    gen = torch.Generator().manual_seed(9)
    hidden, weight = torch.randn(3, 5, 8, generator=gen), torch.randn(40, 8, generator=gen)
    targets = torch.randint(0, 40, (3, 5), generator=gen)
    got = [t.to(device_for(backend), copy=True).requires_grad_() for t in (hidden, weight)]
    want = [t.double().requires_grad_() for t in (hidden, weight)]
    options = dict(sampling_top_k=6, sampling_min_p=0.05, temperature=0.8, return_entropy=True)
    lp, ent = gk.fused_linear_selective_log_softmax(*got, targets.to(got[0].device), backend=backend, chunk_size=4,
                                                    **options)
    want_lp, want_ent = reference.fused_linear_selective_log_softmax(*want, targets, **options)
    finite = torch.isfinite(want_lp)
    assert torch.equal(torch.isfinite(lp).cpu(), finite) and (~finite).any()
    (torch.where(finite.to(lp.device), lp, 0).sum() + ent.sum()).backward()
    (torch.where(finite, want_lp, 0).sum() + want_ent.sum()).backward()
    for a, b in zip(got, want):
        assert float((a.grad.double().cpu() - b.grad).norm() / b.grad.norm()) < 1e-5
    with pytest.raises(NotImplementedError, match="fused=True"):
        gk.fused_linear_selective_log_softmax(hidden, weight, targets, fused=True, sampling_top_k=6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_that_keep_every_token_are_bitwise_plain(backend):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 30, generator=gen).to(device_for(backend)) * 0.01  # nearly flat: min-p keeps all
    targets = torch.randint(0, 30, (2, 4), generator=gen).to(logits.device)
    runs = []
    for options in ({}, {"sampling_min_p": 0.5, "sampling_top_k": 30}):
        leaf = logits.clone().requires_grad_()
        lp, ent = gk.selective_log_softmax(leaf, targets, 0.7, True, backend=backend, **options)
        (lp.sum() + ent.sum()).backward()
        runs.append((lp, ent, leaf.grad))
    if backend == "triton" and not triton_backend.INTERPRETED:
        # Compiled Triton on a GPU: the kept-set kernel's extra select changes the compiled
        # arithmetic; on an H200 (triton 3.6) these rows were not bitwise the plain ones (docs/semantics.md).
        assert all(relative_error(a, b) < 1e-6 for a, b in zip(*runs))
    else:
        assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_a_given_threshold_and_bad_input():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 20, generator=gen)
    targets = logits.argmax(-1)
    threshold = logits.topk(5, -1).values[..., -1]  # an engine's report: its top-5's smallest raw logit
    given = gk.selective_log_softmax(logits, targets, sampling_threshold=threshold)
    computed = gk.selective_log_softmax(logits, targets, sampling_top_k=5)
    assert torch.allclose(given, computed)
    loss_given, _ = gk.gspo_loss(logits, targets, given.detach(), torch.ones(2), sampling_threshold=threshold)
    assert torch.isfinite(loss_given)
    with pytest.raises(ValueError, match="either as sampling_threshold or as sampling_top_k"):
        gk.selective_log_softmax(logits, targets, sampling_threshold=threshold, sampling_top_k=5)
    with pytest.raises(ValueError, match="sampling_threshold must be shaped like target_ids"):
        gk.selective_log_softmax(logits, targets, sampling_threshold=threshold[0])
    for bad, word in ((dict(sampling_top_k=0), "sampling_top_k"), (dict(sampling_top_p=0.0), "sampling_top_p"),
                      (dict(sampling_min_p=1.5), "sampling_min_p"), (dict(sampling_top_k=2.5), "sampling_top_k")):
        with pytest.raises(ValueError, match=word):
            gk.GSPOConfig(**bad)
    with pytest.raises(ValueError, match="shape the log-probs, which policy_loss is given"):
        gk.policy_loss(given.detach(), given.detach(), torch.ones(2), sampling_top_p=0.9)
    with pytest.raises(TypeError, match="ours is sampling_top_p"):
        gk.gspo_loss(logits, targets, None, torch.ones(2), top_p=0.9)


@pytest.mark.parametrize("options", FILTERS, ids=_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_rows(backend, options):
    # Packed (N, V) logits with strided rows (a view into a wider buffer): the same as padded.
    gen = torch.Generator().manual_seed(11)
    wide = (2 * torch.randn(9, 45, generator=gen)).to(device_for(backend))
    logits = wide[:, :40]
    targets = torch.randint(0, 40, (9,), generator=gen).to(logits.device)
    got = gk.selective_log_softmax(logits, targets, 0.9, True, backend=backend, **options)
    want = reference.selective_log_softmax(logits.double().cpu(), targets.cpu(), 0.9, True, **options)
    for a, b in zip(got, want):
        finite = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a.cpu()), finite)
        assert torch.allclose(a.double().cpu()[finite], b[finite], atol=2e-6)


@pytest.mark.parametrize("options", FILTERS, ids=_id)
def test_gradcheck_float64(options):
    gen = torch.Generator().manual_seed(13)
    logits = (2 * torch.randn(2, 3, 12, generator=gen, dtype=torch.float64)).requires_grad_()
    # Targets inside the kept set (the largest logit's), so that every log-prob is finite.
    targets = logits.detach().argmax(-1)
    assert torch.autograd.gradcheck(
        lambda z: gk.selective_log_softmax(z, targets, 0.9, True, backend="torch", **options), (logits,))


def _kept_set_rows(gen, vocab, dtype):
    """Rows of every kind the selection meets: spread and peaked, ties (rounded logits, one value
    everywhere), -inf logits, a NaN row, a +inf one, all -inf, a +inf above flat ones (soft-capped,
    it may hold most of the mass alone); V not a multiple of any SIMD width."""
    x = torch.randn(12, vocab, generator=gen, dtype=torch.float64) * torch.tensor([0.3, 1.0, 3.0, 8.0] * 3)[:, None]
    x[4] = x[4].round()
    x[5] = 1.5
    x[6, : vocab // 2] = -math.inf
    x[7, min(3, vocab - 1)] = math.nan
    x[8, min(1, vocab - 1)] = math.inf
    x[9] = -math.inf
    x[10, 0] += 40.0  # one token holds nearly all the mass
    x[11] = -5.0
    x[11, -1] = math.inf  # soft-capped, a finite z that may hold most of the mass alone
    return x.to(dtype)


def _float64_kept(rows, logit_map, sampling):
    """The float64 sampler's kept set of float rows under the logit map (scale, cap)."""
    x64 = rows.double().reshape(-1, rows.shape[-1])
    scale, cap = logit_map
    z64 = cap * torch.tanh(x64 * scale) if cap > 0 else x64 * scale
    return reference.sampler_kept(z64, sampling.top_k, sampling.top_p, sampling.min_p, order=x64)


# The selections that are not the pre-pass: the cpu backend's (csrc/cpu/kept_set.cpp) and the
# Triton one (backends/triton/kept_set_kernels.py, which the cuda backend also takes on a GPU).
SELECTIONS = [b for b in ("cpu", "triton") if b in BACKENDS]


def _selection_ready(selection):
    if selection == "triton" and not triton_backend.INTERPRETED:
        pytest.skip("compiled Triton takes CUDA tensors; these rows are CPU tensors")


# The interpreter runs a launch's every op in Python (about 0.4 s a launch of these 12 rows at
# V = 37, 1.5 s at V = 5003): the Triton selection meets a subset, one vocab inside a block and
# one over five, each filter kind once and combined, both maps at the small vocab.
_INTERPRETED = {37: (("contiguous", "sliced"), ((1 / 0.7, 0.0), (1.3, 2.5))), 5003: (("sliced",), ((1.3, 2.5),))}


def _subset(selection, vocab, filters, layouts, maps):
    """The (filters, layouts, maps) a selection meets at this vocab."""
    from gspo_kernels.token_stats.kept_set import SamplingFilter

    if selection != "triton":
        return filters, layouts, maps
    names, maps = _INTERPRETED[vocab]
    kinds = [f for f in filters if f in (SamplingFilter(5), SamplingFilter(None, 0.95), SamplingFilter(None, None, 0.2),
                                         SamplingFilter(3, 0.9, 0.05))]  # top-k, top-p, min-p, all three
    return kinds, [(n, r) for n, r in layouts if n in names], maps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("selection, vocab", [(s, v) for s in SELECTIONS for v in (1, 37, 1000, 5003)
                                              if s != "triton" or v in _INTERPRETED])
def test_native_selection_keeps_the_samplers_set(selection, dtype, vocab, seed):
    """The selections without a sort of the row on every filter and their combinations, with and
    without a soft-cap, on contiguous and strided rows of every kind: the float64 sampler's kept
    set in every row. Without a soft-cap the threshold is also the PyTorch pre-pass's
    (kept_set.py) to the bit; with one, on rows whose capped z are nearly flat, the pre-pass's
    float32 running sum keeps other tokens at top-p 0.99 than the sampler
    (test_native_top_p_near_one_keeps_the_float64_samplers_set)."""
    from gspo_kernels.token_stats.kept_set import SamplingFilter, kept_thresholds

    _selection_ready(selection)
    gen = torch.Generator().manual_seed(seed % 2**31)
    x = _kept_set_rows(gen, vocab, dtype)
    strided = torch.cat([x, x[:, :1]], 1)[:, :-1]  # row stride vocab + 1
    blocks = x.reshape(3, 4, vocab)
    sliced = torch.cat([blocks, blocks[:, :1]], 1)[:, :-1]  # (B, T, V), batch stride 5 * vocab: logits[:, :-1]
    filters = [SamplingFilter(1), SamplingFilter(5), SamplingFilter(None, 0.5), SamplingFilter(None, 0.95),
               SamplingFilter(None, None, 0.2), SamplingFilter(None, 1.0, 0.0), SamplingFilter(3, 0.9, 0.05),
               SamplingFilter(vocab + 3, 0.99, None)]
    filters, layouts, maps = _subset(selection, vocab, filters,
                                     [("contiguous", x), ("strided", strided), ("sliced", sliced)],
                                     ((1.0, 0.0), (1 / 0.7, 0.0), (1.3, 2.5)))
    for layout, rows in layouts:
        xf = rows.float().reshape(-1, vocab)
        for logit_map in maps:
            for sampling in filters:
                if not sampling.active:
                    continue
                got = kept_thresholds(rows, LogitMap(*logit_map), sampling, selection)
                assert got.shape == rows.shape[:-1]
                where = f"{sampling}, map {logit_map}, {layout}"
                got = got.reshape(-1)
                kept = (xf >= got[:, None]) | (got == -math.inf)[:, None]  # -inf: every token (NaN ones too)
                assert torch.equal(kept, _float64_kept(xf, logit_map, sampling)), where
                if logit_map[1] == 0.0:
                    assert torch.equal(got, kept_thresholds(rows, LogitMap(*logit_map), sampling, "torch").reshape(-1)), where


@pytest.mark.parametrize("selection", SELECTIONS)
def test_native_top_p_near_one_keeps_the_float64_samplers_set(selection, seed):
    """top_p = 0.999 on rows whose soft-capped z are nearly flat: the boundary lies where a float32
    running sum of thousands of probabilities is off by more than the masses that decide it, so
    the float32 pre-pass keeps other tokens than the float64 sampler; the native selection sums
    the masses in float64 and keeps the sampler's set."""
    from gspo_kernels.token_stats.kept_set import SamplingFilter, kept_thresholds

    _selection_ready(selection)
    gen = torch.Generator().manual_seed(seed % 2**31)
    x = (torch.randn(6, 5003, generator=gen, dtype=torch.float64) * torch.tensor([1.0, 3.0, 8.0] * 2)[:, None]).float()
    logit_map, sampling = (1.3, 2.5), SamplingFilter(None, 0.999)
    got = kept_thresholds(x, LogitMap(*logit_map), sampling, selection)
    assert torch.equal((x >= got[:, None]) | (got == -math.inf)[:, None], _float64_kept(x, logit_map, sampling))
