"""How the fused kernels address rows of a `[B, T, V]` or `[N, V]` logits tensor."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowLayout:
    """Row r lives at `(r // rows_per_batch) * stride_b + (r % rows_per_batch) * stride_t`.

    Two strides instead of one is what lets a kernel read `logits[:, :-1]` without a copy:
    there the batch stride is (T + 1) * V, not T * V. Packed `[N, V]` is the case
    rows_per_batch = N, stride_b = 0.
    """

    rows: int
    rows_per_batch: int
    stride_b: int
    stride_t: int
    vocab: int

    @staticmethod
    def of(t: torch.Tensor) -> "RowLayout":
        if not has_unit_vocab_stride(t):
            raise ValueError("the fused kernels need the vocab dimension to be contiguous")
        if t.dim() == 3:
            b, n_t, vocab = t.shape
            return RowLayout(b * n_t, max(n_t, 1), t.stride(0), t.stride(1), vocab)
        if t.dim() == 2:
            n, vocab = t.shape
            return RowLayout(n, max(n, 1), 0, t.stride(0), vocab)
        raise ValueError(f"expected a 2-D or 3-D tensor; got shape {tuple(t.shape)}")


def has_unit_vocab_stride(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 or t.shape[-1] == 1


def with_unit_vocab_stride(logits: torch.Tensor) -> torch.Tensor:
    """The kernels stream along the vocab; a transposed input is copied once to allow that. An
    empty one counts as contiguous whatever its strides, so contiguous() would keep them: it gets
    a new (empty) buffer instead."""
    if has_unit_vocab_stride(logits):
        return logits
    return logits.new_empty(logits.shape) if logits.numel() == 0 else logits.contiguous()


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def elements_disjoint(t: torch.Tensor) -> bool:
    """Whether no two elements of `t` can share memory, by a sufficient test: with the dims of
    size > 1 sorted by stride, each stride must pass the largest offset the smaller ones reach.
    Every dense or sliced layout passes (logits[:, :-1] included); expand()ed and as_strided
    views whose rows overlap fail, as do a few exotic disjoint ones (they get a new buffer).
    The same test guards the native in-place op (csrc/op_common.h)."""
    if t.numel() == 0:
        return True
    reach = 0
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if stride <= reach:
            return False
        reach += stride * (size - 1)
    return True


def writable_in_place(t: torch.Tensor) -> bool:
    """Whether a backend's logits_grad_ may write the gradient over `t`: the kernels need the
    vocab dim at stride 1, and no two rows may share memory."""
    return has_unit_vocab_stride(t) and elements_disjoint(t)
