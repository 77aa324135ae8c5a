"""Benchmark inputs: a padded batch whose every row carries gradient."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EPS_LOW, EPS_HIGH = 3e-4, 4e-4
MODES = ("forward", "backward", "fwd+bwd")  # what a Step is timed in (timing.py)


def parse_dims(text: str, expected: str) -> tuple[int, int, int]:
    """"AxBxC" -> (A, B, C); ValueError saying `expected` otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*x\s*(\d+)\s*", text)
    if not m:
        raise ValueError(f"{expected}; got {text!r}")
    return tuple(int(g) for g in m.groups())


@dataclass(frozen=True)
class Shape:
    batch: int
    seq_len: int
    vocab: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    def __str__(self) -> str:
        return f"{self.batch}x{self.seq_len}x{self.vocab}"

    @staticmethod
    def parse(text: str) -> "Shape":
        return Shape(*parse_dims(text, "a shape is BxTxV, e.g. 8x512x32768"))


def floor_bytes(shape: Shape, dtype: torch.dtype, mode: str) -> int:
    """Bytes the fused kernels must move: read the logits in forward; read + write in backward."""
    passes = {"forward": 1, "backward": 2, "fwd+bwd": 3}[mode]
    return passes * shape.tokens * shape.vocab * torch.empty((), dtype=dtype).element_size()


@dataclass
class BenchProblem:
    shape: Shape
    dtype: torch.dtype
    logits: torch.Tensor  # (B, T, V), contiguous, the leaf whose gradient is taken
    target_ids: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor


def make_bench_problem(shape: Shape, dtype: torch.dtype, device: str, seed: int = 0) -> BenchProblem:
    """Random logits; old log-probs within ~1e-3 of the current ones, so ratios sit near the
    clip range and every row gets a gradient (all-masked or fully clipped rows would let the
    fused kernels skip them, which would flatter them)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    b, t, v = shape.batch, shape.seq_len, shape.vocab
    logits = torch.empty(b, t, v, dtype=dtype, device=device)
    # Filled a sequence at a time: a float32 (B, T, V) draw would cost more memory than the benchmark.
    for i in range(b):
        logits[i] = (torch.randn(t, v, generator=gen, device=device) * 2).to(dtype)
    target_ids = torch.randint(0, v, (b, t), generator=gen, device=device)
    with torch.no_grad():
        logp = torch.stack([
            torch.log_softmax(logits[i].float(), -1).gather(-1, target_ids[i].unsqueeze(-1)).squeeze(-1)
            for i in range(b)
        ])
    old = logp + 1e-3 * torch.randn(b, t, generator=gen, device=device)
    adv = torch.randn(b, generator=gen, device=device)
    mask = torch.ones(b, t, dtype=torch.bool, device=device)
    return BenchProblem(shape, dtype, logits, target_ids, old, adv, mask)
