"""Launchers of the fused-linear Triton tile kernels (tile_kernels.py), registered as torch
custom ops like the row kernels' (row_ops.py), so that torch.compile sees single opaque calls:
token stats from hidden states and the lm_head weight, and the float32 gradients of both,
never forming the `[N, V]` logits outside on-chip tiles."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ...compat import custom_op
from ..contract import GradInputs
from . import tile_kernels as kernels
from .common import INTERPRETED, INTERPRETER_PROBLEM


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
        # tiles per problem. GPU tiles compile for sm_90 without register spills
        # (tests/kernels/triton_sm90_compile.py), float32 at a quarter of the tile; their speed is
        # unmeasured (docs/performance.md, "Unmeasured").
        if INTERPRETED:
            return TileConfig(16, 32, 16, 4)
        if dtype in (torch.float32, torch.float16):  # float32 products (_ieee)
            return TileConfig(32, 64, 32, 8)
        return TileConfig(64, 128, 32, 8)


def available(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and INTERPRETED and INTERPRETER_PROBLEM is None)


def _ieee(hidden: torch.Tensor) -> bool:
    """float32 products: for float32 inputs (not TF32); for float16 ones, whose backward keeps dz
    in float32 (it can pass float16's 65504, where bfloat16's range holds it); always in the
    interpreter."""
    return hidden.dtype in (torch.float32, torch.float16) or INTERPRETED


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@custom_op("gspo_kernels::triton_tile_token_stats", mutates_args=())
def _token_stats_op(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                    inv_temperature: float, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tiles = TileConfig.default(hidden.dtype)
    hidden, weight = _rows(hidden), _rows(weight)
    n_rows, hidden_size = hidden.shape
    vocab = weight.shape[0]
    logp, entropy, lse = (torch.empty(n_rows, dtype=torch.float32, device=hidden.device) for _ in range(3))
    if n_rows:
        kernels.linear_token_stats_kernel[(triton.cdiv(n_rows, tiles.block_n),)](
            hidden, weight, weight if bias is None else bias, targets, logp, entropy, lse,
            n_rows, vocab, hidden_size, hidden.stride(0), weight.stride(0), inv_temperature, softcap,
            HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0.0, IEEE=_ieee(hidden),
            BLOCK_N=tiles.block_n, BLOCK_V=tiles.block_v, BLOCK_H=tiles.block_h, num_warps=tiles.num_warps,
        )
    return logp, entropy, lse


@_token_stats_op.register_fake
def _(hidden, weight, bias, targets, inv_temperature, softcap=0.0):
    return tuple(hidden.new_empty(hidden.shape[0], dtype=torch.float32) for _ in range(3))


def token_stats(hidden, weight, bias, targets, logit_map):
    """(logp, entropy, lse), each `[N]` float32, of the logits hidden @ weight.T + bias through
    the logit map (logit_map.LogitMap). targets: `[N]` int64, local ids (an id outside [0, V)
    gives a NaN log-prob)."""
    return _token_stats_op(hidden, weight, bias, targets, *logit_map.op_args())


def _grad_shapes(hidden, weight, need_hidden: bool, need_weight: bool, need_bias: bool):
    """The gradients' shapes; a gradient not asked for is an empty `(0,)` tensor (an op's
    outputs cannot be None)."""
    return (tuple(hidden.shape) if need_hidden else (0,), tuple(weight.shape) if need_weight else (0,),
            (weight.shape[0],) if need_bias else (0,))


@custom_op("gspo_kernels::triton_tile_grads", mutates_args=())
def _grads_op(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
              lse: torch.Tensor, entropy: torch.Tensor, grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None,
              row_mask: torch.Tensor | None, inv_temperature: float, softcap: float, need_hidden: bool, need_weight: bool,
              need_bias: bool, filter_eps: float, invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tiles = TileConfig.default(hidden.dtype)
    need_bias = need_bias and bias is not None
    d_hidden, d_weight, d_bias = (torch.zeros(shape, dtype=torch.float32, device=hidden.device)
                                  for shape in _grad_shapes(hidden, weight, need_hidden, need_weight, need_bias))
    hidden, weight = _rows(hidden), _rows(weight)
    n_rows, hidden_size = hidden.shape
    vocab = weight.shape[0]
    if n_rows and invariant:
        _launch_invariant(tiles, (hidden, weight, bias, targets, lse, entropy, grad_logp, grad_entropy, row_mask),
                          (d_hidden, d_weight, d_bias), (inv_temperature, softcap), (need_hidden, need_weight, need_bias))
    elif n_rows and (need_hidden or need_weight or need_bias):
        dummy = lse  # stands in for every pointer a flag says is never read
        grid = (triton.cdiv(n_rows, tiles.block_n), triton.cdiv(vocab, tiles.block_v))
        kernels.linear_grad_kernel[grid](
            hidden, weight, weight if bias is None else bias, targets, lse, entropy, grad_logp,
            dummy if grad_entropy is None else grad_entropy, targets if row_mask is None else row_mask,
            d_hidden, d_weight, d_bias,
            n_rows, vocab, hidden_size, hidden.stride(0), weight.stride(0), inv_temperature, softcap, filter_eps,
            HAS_BIAS=bias is not None, HAS_ENTROPY_GRAD=grad_entropy is not None, HAS_ROW_MASK=row_mask is not None,
            NEED_DH=need_hidden, NEED_DW=need_weight, NEED_DB=need_bias, FILTER=filter_eps > 0,
            HAS_SOFTCAP=softcap > 0.0,
            IEEE=_ieee(hidden),
            BLOCK_N=tiles.block_n, BLOCK_V=tiles.block_v, BLOCK_H=tiles.block_h, num_warps=tiles.num_warps,
        )
    return d_hidden, d_weight, d_bias


def _launch_invariant(tiles: TileConfig, inputs: tuple, outputs: tuple, logit_map: tuple, need) -> None:
    """The batch-invariant backward: d hidden by row blocks, d weight and d bias by vocab tiles,
    each summed in a fixed order (no atomics)."""
    hidden, weight, bias, targets, lse, entropy, grad_logp, grad_entropy, row_mask = inputs
    d_hidden, d_weight, d_bias = outputs
    need_hidden, need_weight, need_bias = need
    n_rows, hidden_size = hidden.shape
    vocab = weight.shape[0]
    operands = (hidden, weight, weight if bias is None else bias, targets, lse, entropy, grad_logp,
                lse if grad_entropy is None else grad_entropy, targets if row_mask is None else row_mask)
    inv_temperature, softcap = logit_map
    sizes = (n_rows, vocab, hidden_size, hidden.stride(0), weight.stride(0), inv_temperature, softcap)
    flags = dict(HAS_BIAS=bias is not None, HAS_ENTROPY_GRAD=grad_entropy is not None,
                 HAS_ROW_MASK=row_mask is not None, HAS_SOFTCAP=softcap > 0.0, IEEE=_ieee(hidden), BLOCK_N=tiles.block_n,
                 BLOCK_V=tiles.block_v, BLOCK_H=tiles.block_h, num_warps=tiles.num_warps)
    if need_hidden:
        kernels.linear_hidden_grad_kernel[(triton.cdiv(n_rows, tiles.block_n),)](*operands, d_hidden, *sizes, **flags)
    if need_weight or need_bias:
        kernels.linear_weight_grad_kernel[(triton.cdiv(vocab, tiles.block_v),)](
            *operands, d_weight, d_bias, *sizes, NEED_DW=need_weight, NEED_DB=need_bias, **flags)


@_grads_op.register_fake
def _(hidden, weight, bias, targets, lse, entropy, grad_logp, grad_entropy, row_mask, inv_temperature, softcap,
      need_hidden, need_weight, need_bias, filter_eps, invariant=False):
    shapes = _grad_shapes(hidden, weight, need_hidden, need_weight, need_bias and bias is not None)
    return tuple(hidden.new_empty(shape, dtype=torch.float32) for shape in shapes)


@dataclass(frozen=True)
class LinearGrads:
    hidden: torch.Tensor | None  # float32 [N, H]
    weight: torch.Tensor | None  # float32 [V, H]
    bias: torch.Tensor | None  # float32 [V]


def grads(hidden, weight, bias, inputs: GradInputs, need: tuple[bool, bool, bool], filter_eps: float,
          invariant: bool = False) -> LinearGrads:
    """float32 d hidden, d weight, d bias (those `need` asks for). inputs.targets: local ids,
    < 0 for a row whose target lives on another rank (no one-hot term); a row in the loss whose
    lse is not finite gets NaN. filter_eps > 0 skips tiles in which each row's probability mass
    is below it. invariant: no atomics, every sum in a fixed order (then filter_eps must be 0)."""
    need_hidden, need_weight, need_bias = need
    need_bias = need_bias and bias is not None
    if inputs.kept_min is not None:  # LinearPlan refuses it first; the tiles take no kept set
        raise NotImplementedError("the tile kernels (fused=True) take no sampler's kept set")
    d_hidden, d_weight, d_bias = _grads_op(hidden, weight, bias, *inputs.op_args(kept_set=False), need_hidden, need_weight,
                                           need_bias, float(filter_eps), bool(invariant))
    return LinearGrads(d_hidden if need_hidden else None, d_weight if need_weight else None,
                       d_bias if need_bias else None)
