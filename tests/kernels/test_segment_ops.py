"""The packed layout's segment ops (backends/segment_ops.py): the extension's one-op kernels
gspo_kernels::{segment_sum, segment_expand} against the torch way (segment_reduce in float64,
index_select by the row -> sequence index), opcheck, isolation of sequences, and the loss
itself giving the same bits either way."""

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.backends import segment_ops

native = pytest.mark.skipif(not segment_ops.native_for(torch.device("cpu")),
                            reason="extension built without the segment ops")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and segment_ops.native_for(torch.device("cuda")) else [])

# Empty sequences first, inside and last; one sequence alone; one row per sequence.
BOUNDS = [[0, 0, 3, 3, 7, 12, 12], [0, 9], [0, 1, 2, 3, 4]]


def _cu(bounds, device):
    return torch.tensor(bounds, dtype=torch.int64, device=device)


@native
@pytest.mark.parametrize("columns", [None, 1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("bounds", BOUNDS, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_segment_sum_matches_the_torch_way(device, bounds, dtype, columns):
    cu = _cu(bounds, device)
    shape = (bounds[-1],) if columns is None else (bounds[-1], columns)
    # float32 values: their float64 sums are exact in any order, so every way agrees bitwise.
    x = (torch.randn(shape) * 1e3).to(dtype).to(device)
    got = segment_ops.segment_sum(x, cu, native=True)
    want = segment_ops.segment_sum(x, cu, native=False)
    assert got.dtype == dtype and got.shape == want.shape == (len(bounds) - 1,) + shape[1:]
    exact = torch.stack([x[a:b].double().sum(0) for a, b in zip(bounds, bounds[1:])]).to(dtype)
    assert torch.equal(got, exact)
    assert torch.equal(want, exact)


@native
@pytest.mark.parametrize("device", DEVICES)
def test_segment_sum_keeps_each_sequence_to_itself(device):
    cu = _cu([0, 2, 4, 6], device)
    x = torch.tensor([float("inf"), 1.0, 1e30, 2.0, 3.0, float("nan")], device=device)
    got = segment_ops.segment_sum(x, cu, native=True)
    assert got[0] == float("inf") and got[1] == 1e30 and torch.isnan(got[2])
    y = torch.tensor([1e300, -1e300, 0.5, 0.25], dtype=torch.float64, device=device)
    assert segment_ops.segment_sum(y, _cu([0, 2, 4], device), native=True).tolist() == [0.0, 0.75]


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool], ids=str)
@pytest.mark.parametrize("bounds", BOUNDS, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_segment_expand_matches_the_torch_way(device, bounds, dtype):
    cu, rows = _cu(bounds, device), bounds[-1]
    v = torch.randn(len(bounds) - 1, device=device)
    v = v > 0 if dtype == torch.bool else v.to(dtype)
    got = segment_ops.segment_expand(v, cu, None, rows)
    want = segment_ops.segment_expand(v, cu, segment_ops.row_to_sequence(cu, rows, known_valid=True), rows)
    assert got.dtype == dtype and torch.equal(got, want)
    lengths = torch.tensor(bounds).diff()
    assert torch.equal(got.cpu(), v.cpu().repeat_interleave(lengths))


@native
@pytest.mark.parametrize("device", DEVICES)
def test_segment_ops_stay_in_bounds_on_an_invalid_cu_seqlens(device):
    # The caller's check refuses such a cu_seqlens (on the host, or by a device-side assert
    # that fires later): until then the ops must neither read nor write out of bounds.
    cu = _cu([0, 2, 9], device)  # ends past the 5 rows
    x = torch.arange(5.0, device=device)
    assert segment_ops.segment_sum(x, cu, native=True).tolist() == [1.0, 9.0]
    assert segment_ops.segment_expand(torch.tensor([7.0, 8.0], device=device), _cu([0, 2, 3], device),
                                      None, 5).tolist() == [7.0, 7.0, 8.0, 8.0, 8.0]


@native
@pytest.mark.parametrize("device", DEVICES)
def test_segment_ops_refuse_bad_arguments(device):
    x = torch.zeros(4, device=device)
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.gspo_kernels.segment_sum(x, torch.tensor([0, 4], dtype=torch.int32, device=device))
    with pytest.raises(RuntimeError, match="floats"):
        torch.ops.gspo_kernels.segment_sum(x.long(), _cu([0, 4], device))
    with pytest.raises(RuntimeError, match="one value per segment"):
        torch.ops.gspo_kernels.segment_expand(torch.zeros(3, device=device), _cu([0, 4], device), 4)


@native
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_segment_ops(device):
    cu = _cu([0, 0, 3, 7], device)
    torch.library.opcheck(torch.ops.gspo_kernels.segment_sum.default, (torch.randn(7, 2, device=device), cu))
    torch.library.opcheck(torch.ops.gspo_kernels.segment_expand.default, (torch.randn(3, device=device), cu, 7))


@native
@pytest.mark.parametrize("options", [dict(level="sequence"), dict(level="sequence", beta=0.04, entropy_coef=0.01),
                                     dict(level="sequence", objective="gmpo", eps_low=0.4, eps_high=0.4),
                                     dict(level="sequence_token")], ids=str)
def test_packed_loss_is_the_same_either_way(monkeypatch, options):
    bounds = [0, 5, 5, 17, 30]
    rows, vocab = bounds[-1], 64
    logits = torch.randn(rows, vocab)
    targets = torch.randint(0, vocab, (rows,))
    old = torch.randn(rows) * 0.05 - 4.0
    ref = torch.randn(rows) * 0.05 - 4.0
    adv = torch.randn(len(bounds) - 1)
    mask = torch.rand(rows) > 0.2

    def run():
        leaf = logits.clone().requires_grad_()
        loss, metrics = gk.gspo_loss(leaf, targets, old, adv, mask=mask, cu_seqlens=torch.tensor(bounds),
                                     ref_logprobs=ref, backend="cpu", **options)
        loss.backward()
        return loss, leaf.grad, metrics

    loss, grad, metrics = run()
    monkeypatch.setattr(segment_ops, "native_for", lambda device: False)
    loss_t, grad_t, metrics_t = run()
    assert torch.equal(loss, loss_t)
    assert torch.equal(grad, grad_t)
    assert metrics.keys() == metrics_t.keys()
    for name in metrics:
        assert torch.equal(metrics[name], metrics_t[name]), name
