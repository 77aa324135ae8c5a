"""What a CUDA graph needs of one loss call, checked without a GPU: the call runs whole on the
meta device (shapes only, so any read of a value on the host, any data-dependent shape, would
raise), and no op in it takes or makes a tensor on another device (a CPU tensor made per call
would be a host-to-device copy at capture). The capture itself runs in benchmarks/gpu/cuda_graph.py
on a GPU."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gspo_kernels as gk
from gspo_kernels.bench import host


class _ForeignTensors(TorchDispatchMode):
    """Records every op that takes or returns a tensor off the meta device (0-d CPU scalars,
    which every device takes as plain numbers, aside)."""

    def __init__(self) -> None:
        super().__init__()
        self.foreign: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        if any(t.device.type != "meta" and t.dim() > 0 for t in tensors):
            self.foreign.append(str(func))
        return out


def _meta_call(case: str, layout: str, batch: int = 3, seq_len: int = 8, vocab: int = 64):
    dev = "meta"
    shape = (batch * seq_len,) if layout == "packed" else (batch, seq_len)
    logits = torch.empty(*shape, vocab, device=dev, requires_grad=True)
    tensors = dict(mask=torch.empty(shape, dtype=torch.bool, device=dev))
    if layout == "packed":
        tensors["cu_seqlens"] = torch.empty(batch + 1, dtype=torch.int64, device=dev)
    options = dict(host.CASES[case])
    if "beta" in options:
        tensors["ref_logprobs"] = torch.empty(shape, device=dev)
    targets = torch.empty(shape, dtype=torch.int64, device=dev)
    old = torch.empty(shape, device=dev)
    advantages = torch.empty(batch, device=dev)
    return logits, lambda: gk.gspo_loss(logits, targets, old, advantages, backend="torch", **tensors, **options)


@pytest.mark.parametrize("layout", host.LAYOUTS)
@pytest.mark.parametrize("case", sorted(host.CASES))
def test_loss_call_reads_no_value_and_stays_on_its_device(case, layout):
    logits, call = _meta_call(case, layout)
    mode = _ForeignTensors()
    with mode:
        loss, metrics = call()
        loss.backward()
    assert mode.foreign == []
    assert logits.grad is not None and logits.grad.shape == logits.shape
    assert all(v.device.type == "meta" for v in metrics.values())


def test_the_check_catches_a_host_read():
    """The meta device does refuse a host read, so the test above can fail."""
    with pytest.raises((RuntimeError, NotImplementedError)):
        bool(torch.empty((), device="meta") > 0)


def test_the_check_catches_a_cpu_tensor_made_per_call():
    mode = _ForeignTensors()
    with mode:
        torch.empty(3, device="meta") + torch.ones(3).to("meta")
    assert mode.foreign
