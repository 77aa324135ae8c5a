"""Launchers of the fused-linear Triton kernels (triton_linear_kernels.py): token stats from
hidden states and the lm_head weight, and the float32 gradients of both, never forming the
`[N, V]` logits outside on-chip tiles."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from . import triton_linear_kernels as kernels
from .triton_backend import INTERPRETED


@dataclass(frozen=True)
class TileConfig:
    block_n: int
    block_v: int
    block_h: int
    num_warps: int

    def __post_init__(self) -> None:
        for name in ("block_n", "block_v", "block_h"):
            size = getattr(self, name)
            if size < 16 or size & (size - 1):  # tl.dot needs powers of two >= 16
                raise ValueError(f"{name} must be a power of two >= 16; got {size}")

    @staticmethod
    def default(dtype: torch.dtype = torch.bfloat16) -> "TileConfig":
        # The interpreter runs numpy per tile: small tiles keep CI fast and still give several
        # tiles per problem. GPU tiles: untuned (no GPU run has been recorded); they compile for
        # sm_90 without register spills (tests/triton_sm90_compile.py), float32 at a quarter of the tile.
        if INTERPRETED:
            return TileConfig(16, 32, 16, 4)
        if dtype == torch.float32:
            return TileConfig(32, 64, 32, 8)
        return TileConfig(64, 128, 32, 8)


def available(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and INTERPRETED)


def _ieee(hidden: torch.Tensor) -> bool:
    """float32 products: for float32 inputs (not TF32), and always in the interpreter."""
    return hidden.dtype == torch.float32 or INTERPRETED


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def token_stats(hidden, weight, bias, targets, inv_temperature: float, tiles: TileConfig | None = None):
    """(logp, entropy, lse), each `[N]` float32, of the logits hidden @ weight.T + bias.
    targets: `[N]` int64, local ids (an id outside [0, V) gives a NaN log-prob)."""
    tiles = tiles or TileConfig.default(hidden.dtype)
    hidden, weight = _rows(hidden), _rows(weight)
    n_rows, hidden_size = hidden.shape
    vocab = weight.shape[0]
    logp, entropy, lse = (torch.empty(n_rows, dtype=torch.float32, device=hidden.device) for _ in range(3))
    if n_rows:
        kernels.linear_token_stats_kernel[(triton.cdiv(n_rows, tiles.block_n),)](
            hidden, weight, weight if bias is None else bias, targets, logp, entropy, lse,
            n_rows, vocab, hidden_size, hidden.stride(0), weight.stride(0), inv_temperature,
            HAS_BIAS=bias is not None, IEEE=_ieee(hidden),
            BLOCK_N=tiles.block_n, BLOCK_V=tiles.block_v, BLOCK_H=tiles.block_h, num_warps=tiles.num_warps,
        )
    return logp, entropy, lse


@dataclass(frozen=True)
class LinearGrads:
    hidden: torch.Tensor | None  # float32 [N, H]
    weight: torch.Tensor | None  # float32 [V, H]
    bias: torch.Tensor | None  # float32 [V]


def grads(hidden, weight, bias, targets, lse, entropy, grad_logp, grad_entropy, row_mask, inv_temperature: float,
          need: tuple[bool, bool, bool], filter_eps: float, tiles: TileConfig | None = None) -> LinearGrads:
    """float32 d hidden, d weight, d bias (those `need` asks for). targets: local ids, < 0 for
    a row whose target lives on another rank (no one-hot term); a row in the loss whose lse is
    not finite gets NaN. filter_eps > 0 skips tiles in which each row's probability mass is
    below it."""
    tiles = tiles or TileConfig.default(hidden.dtype)
    hidden, weight = _rows(hidden), _rows(weight)
    n_rows, hidden_size = hidden.shape
    vocab = weight.shape[0]
    need_h, need_w, need_b = need
    need_b = need_b and bias is not None
    device = hidden.device
    d_hidden = torch.zeros(n_rows, hidden_size, dtype=torch.float32, device=device) if need_h else None
    d_weight = torch.zeros(vocab, hidden_size, dtype=torch.float32, device=device) if need_w else None
    d_bias = torch.zeros(vocab, dtype=torch.float32, device=device) if need_b else None
    if n_rows and (need_h or need_w or need_b):
        dummy = lse  # stands in for every pointer a flag says is never read
        grid = (triton.cdiv(n_rows, tiles.block_n), triton.cdiv(vocab, tiles.block_v))
        kernels.linear_grad_kernel[grid](
            hidden, weight, weight if bias is None else bias, targets, lse, entropy, grad_logp,
            dummy if grad_entropy is None else grad_entropy, targets if row_mask is None else row_mask,
            dummy if d_hidden is None else d_hidden, dummy if d_weight is None else d_weight,
            dummy if d_bias is None else d_bias,
            n_rows, vocab, hidden_size, hidden.stride(0), weight.stride(0), inv_temperature, float(filter_eps),
            HAS_BIAS=bias is not None, HAS_ENTROPY_GRAD=grad_entropy is not None, HAS_ROW_MASK=row_mask is not None,
            NEED_DH=need_h, NEED_DW=need_w, NEED_DB=need_b, FILTER=filter_eps > 0,
            IEEE=_ieee(hidden),
            BLOCK_N=tiles.block_n, BLOCK_V=tiles.block_v, BLOCK_H=tiles.block_h, num_warps=tiles.num_warps,
        )
    return LinearGrads(d_hidden, d_weight, d_bias)
