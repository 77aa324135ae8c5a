"""The loss from hidden states and the lm_head weight, without the `[N, V]` logits.

Chunked path, every backend: rows are taken `chunk_size` at a time; a chunk's logits
z = hidden @ weight.T (+ bias) are formed in float32 by one matmul (linear_products.py), the
backend's stage-1 kernel reads them, and they are dropped. Backward (fused_linear_backward.py)
forms the logits again a buffer at a time, runs the stage-3 kernel over them in place (dz), and
takes `d hidden`, `d weight` and `d bias` from dz by matmuls: over chunks of rows, accumulating
`d weight` in float32, or over blocks of vocab columns, accumulating `d hidden`, whichever
accumulator is smaller (no atomics: the same inputs give the same bits). Stage 2 is the
unchanged `sequence.py`.

Nothing `[N, V]` is kept: what survives forward is the inputs and O(N) statistics. Peak memory
is one float32 buffer of logits plus the smaller accumulator; on a CPU, for 16-bit inputs, also
float32 copies of the operands while a pass runs (CPUs without native bf16 multiply it 10-80x
slower than fp32, so both operands are upcast there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import backends
from .backends.grad_inputs import GradInputs, nan_lse_for_bad_targets, upstream_grads
from .config import BACKENDS, GSPOConfig, check_temperature
from .distributed.vocab_parallel import VocabShard
from .fused_linear_backward import SavedPass, choose_sweep, rows_sweep, vocab_sweep
from .fused_linear_tiled import TiledLinearTokenStats
from .linear_products import Operands

try:
    from .backends.triton_linear import available as triton_linear_available
except ImportError:  # no triton: only the chunked path
    def triton_linear_available(device) -> bool:
        return False

# Gradient filtering (fused=True) is off unless asked for: what it drops is bounded (README,
# "Fused kernel") but its speed-up is unmeasured (no GPU run yet). The README discusses 2**-20.
DEFAULT_FILTER_EPS = 0.0
from .inputs import check_logits_and_targets, check_mask, prepare_batch
from .sequence import gspo_objective

# float32 logits per chunk when chunk_size is None: a budget in bytes, rows = budget / (4 V).
CHUNK_BUDGET_BYTES = {"cpu": 32 << 20, "cuda": 256 << 20}


def default_chunk_rows(rows: int, vocab: int, device: torch.device) -> int:
    """Rows per chunk for a float32 `[rows, V]` logits buffer within CHUNK_BUDGET_BYTES
    (32 MiB on a CPU, 256 MiB on a GPU): 256 rows at V = 32768 on a CPU."""
    budget = CHUNK_BUDGET_BYTES.get(device.type, CHUNK_BUDGET_BYTES["cpu"])
    return max(1, min(rows, budget // (4 * vocab)))


@dataclass(frozen=True)
class LinearPass:
    """How one fused-linear call runs: everything but its tensors."""

    inv_temperature: float
    backend_name: str
    chunk: int
    weight_grad_fp32: bool
    shard: VocabShard | None = None  # vocab-parallel: the weight holds this rank's vocab slice
    reduce_hidden_grad: bool = True  # with a shard: sum d hidden over the tensor-parallel group
    fused: bool = False  # the Triton kernels with logits only in on-chip tiles (fused_linear_tiled.py)
    filter_eps: float = 0.0  # fused: skip tiles whose probabilities are all below this (0: never)


class FusedLinearTokenStats(torch.autograd.Function):
    """(hidden `[N, H]`, weight `[V, H]`, bias) -> (logp, entropy) `[N]`, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, row_mask, how: LinearPass):
        backend = backends.get(how.backend_name)
        rows = hidden.shape[0]
        stats_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        logp, entropy, lse = (torch.empty(rows, dtype=stats_dtype, device=hidden.device) for _ in range(3))
        owned = None
        if how.shard is not None:
            targets, owned = how.shard.local_targets(targets)
        ops = Operands(weight, bias)
        for start in range(0, rows, how.chunk):
            part = slice(start, min(start + how.chunk, rows))
            logits = ops.logits(hidden[part])
            logp[part], entropy[part], lse[part] = backend.token_stats(logits, targets[part], how.inv_temperature)
        if how.shard is not None:
            # One merge for all rows after the loop: two collectives per call, not per chunk.
            logp, entropy, lse = how.shard.merge(logp, entropy, lse, owned)  # lse NaN where no single owner
        else:
            lse = nan_lse_for_bad_targets(lse, targets, weight.shape[0])  # for the vocab sweep's blocks
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy, row_mask, owned)
        ctx.how = how
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse, entropy, row_mask, owned = ctx.saved_tensors
        how = ctx.how
        none = (None,) * 3
        if grad_logp is None and grad_entropy is None:
            return (None, None, None) + none
        backend = backends.get(how.backend_name)
        need = tuple(ctx.needs_input_grad[:3])
        grad_logp, grad_entropy = upstream_grads(grad_logp, grad_entropy, lse)
        saved = SavedPass(hidden, weight, bias, owned,
                          GradInputs(targets, lse, entropy, grad_logp, grad_entropy, row_mask, how.inv_temperature))
        reduce_hidden = how.shard is not None and how.reduce_hidden_grad
        sweep = choose_sweep(hidden.shape[0], weight.shape[0], need[0], need[1], how.weight_grad_fp32, weight.dtype)
        if sweep == "vocab":
            d_hidden, d_weight, d_bias = vocab_sweep(backend, saved, how.chunk, need)
        else:
            # A slice's partial d hidden is summed over ranks in float32, then rounded once.
            d_hidden, d_weight, d_bias = rows_sweep(backend, saved, how.chunk, need, reduce_hidden,
                                                    how.weight_grad_fp32)
        if d_hidden is not None and reduce_hidden:
            dist.all_reduce(d_hidden, op=dist.ReduceOp.SUM, group=how.shard.group)
        return (None if d_hidden is None else d_hidden.to(hidden.dtype),
                None if d_weight is None else d_weight.to(weight.dtype),
                None if d_bias is None else d_bias.to(bias.dtype)) + none


def _check_linear(hidden, weight, bias, chunk_size):
    """Validates the operands; returns hidden as `[N, H]` rows (a view when its layout allows)."""
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be (B, T, H) padded or (N, H) packed; got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (V, H) with H = {hidden.shape[-1]} (hidden's last dim); "
                         f"got shape {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("weight has an empty vocab dimension (V = 0)")
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"hidden must be float32, bfloat16 or float16 (float64 on backend='torch'); got {hidden.dtype}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dtype != hidden.dtype:
            raise TypeError(f"{name} is {t.dtype} but hidden is {hidden.dtype}: pass one dtype")
        if t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},) (one per vocab entry); got {tuple(bias.shape)}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive int or None; got {chunk_size!r}")
    return hidden.reshape(-1, hidden.shape[-1])


def _logits_stand_in(hidden, weight):
    """A zero-storage tensor shaped like the logits, for the checks that speak of them."""
    shape = tuple(hidden.shape[:-1]) + (weight.shape[0],)
    return torch.empty_strided(shape, (0,) * len(shape), dtype=hidden.dtype, device=hidden.device)


@dataclass(frozen=True)
class LinearOptions:
    """The fused-linear keywords of a call, before they are checked and resolved."""

    temperature: float
    backend: str
    chunk_size: int | None
    weight_grad_fp32: bool
    tp_group: object = None
    vocab_start: int | None = None
    reduce_hidden_grad: bool = True
    fused: bool = False
    grad_filter_eps: float = DEFAULT_FILTER_EPS

    def resolve(self, rows: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> LinearPass:
        for name in ("weight_grad_fp32", "reduce_hidden_grad", "fused"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool; got {type(value).__name__}")
        eps = self.grad_filter_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < 1:
            raise ValueError(f"grad_filter_eps must be a probability in [0, 1) (0: no filtering); got {eps!r}")
        # fused=True is the Triton tile kernels: 'auto' means them.
        backend = "triton" if self.fused and self.backend == "auto" else self.backend
        resolved = backends.resolve(backend, _logits_stand_in(hidden, weight))
        if self.fused:
            _check_fused(resolved, hidden)
        chunk = self.chunk_size or default_chunk_rows(rows.shape[0], weight.shape[0], hidden.device)
        shard = VocabShard.of(self.tp_group, self.vocab_start, weight.shape[0])
        return LinearPass(1.0 / self.temperature, resolved, chunk, self.weight_grad_fp32, shard,
                          self.reduce_hidden_grad, self.fused, float(eps) if self.fused else 0.0)


def _check_fused(resolved_backend: str, hidden: torch.Tensor) -> None:
    if resolved_backend != "triton":
        raise ValueError(f"fused=True runs the Triton kernels; got backend {resolved_backend!r} (use 'auto' or "
                         "'triton')")
    if not triton_linear_available(hidden.device):
        raise ValueError(f"fused=True needs CUDA tensors, or Triton's interpreter for CPU tensors (TRITON_INTERPRET=1 "
                         f"before gspo_kernels is imported); got {hidden.device}")


def _stats(rows, hidden, weight, bias, targets_flat, row_mask, options: LinearOptions):
    how = options.resolve(rows, hidden, weight)
    function = TiledLinearTokenStats if how.fused else FusedLinearTokenStats
    return function.apply(rows, weight, bias, targets_flat, row_mask, how)


def fused_linear_gspo_loss(hidden, weight, target_ids, old_logprobs, advantages, *, bias=None, chunk_size=None,
                           weight_grad_fp32=True, mask=None, cu_seqlens=None, ref_logprobs=None, rollout_logprobs=None,
                           normalizer=None, entropy_threshold=None, tp_group=None, vocab_start=None, cp_group=None,
                           reduce_hidden_grad=True, fused=False, grad_filter_eps=DEFAULT_FILTER_EPS,
                           config: GSPOConfig | None = None, **options):
    """gspo_loss on the logits `hidden @ weight.T + bias`, never holding them whole.

    hidden: `(B, T, H)` or `(N, H)` (strided rows such as `hidden[:, :-1]` are copied once into
    rows); weight: `(V, H)`, the lm_head weight; bias: `(V,)` or None; all one dtype and
    device. Every other argument and option is gspo_loss's. chunk_size: rows per chunk (None:
    default_chunk_rows). Gradients flow to hidden, weight and bias; `d weight` accumulates in
    float32 unless weight_grad_fp32=False (then in the weight's dtype: half the buffer).

    Distributed: tp_group when weight (and bias) hold this rank's vocab slice (vocab_start as
    in gspo_loss); `d hidden` is then summed over tp_group, unless reduce_hidden_grad=False,
    for a framework whose own layer all-reduces the input gradient (Megatron's
    copy_to_tensor_model_parallel_region does). cp_group as in gspo_loss.

    fused=True: the Triton kernels with the logits only in on-chip tiles (CUDA tensors, or CPU
    tensors under TRITON_INTERPRET=1): float32 atomics in backward (not bit-reproducible).
    grad_filter_eps > 0 turns on gradient filtering: a tile in which each row's probability
    mass is below it skips its backward products (off by default). README, "Fused kernel".
    """
    if config is None:
        config = GSPOConfig(**options)
    elif options:
        raise TypeError(f"pass options either in config or as keywords, not both; got config and {sorted(options)}")
    rows = _check_linear(hidden, weight, bias, chunk_size)
    batch = prepare_batch(config, _logits_stand_in(hidden, weight), target_ids, old_logprobs, advantages, mask=mask,
                          cu_seqlens=cu_seqlens, ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs,
                          normalizer=normalizer, entropy_threshold=entropy_threshold, cp_group=cp_group)
    options = LinearOptions(config.temperature, config.backend, chunk_size, weight_grad_fp32, tp_group, vocab_start,
                            reduce_hidden_grad, fused, grad_filter_eps)
    logp, entropy = _stats(rows, hidden, weight, bias, batch.targets, batch.mask, options)
    return gspo_objective(config, batch, logp, entropy)


def fused_linear_selective_log_softmax(hidden, weight, target_ids, *, bias=None, temperature=1.0,
                                       return_entropy=False, chunk_size=None, backend="auto", mask=None,
                                       weight_grad_fp32=True, tp_group=None, vocab_start=None,
                                       reduce_hidden_grad=True, fused=False, grad_filter_eps=DEFAULT_FILTER_EPS):
    """selective_log_softmax on the logits `hidden @ weight.T + bias`, chunk by chunk, with
    the full backward (entropy gradient included) to hidden, weight and bias. tp_group,
    vocab_start, reduce_hidden_grad, fused and grad_filter_eps as in fused_linear_gspo_loss."""
    temperature = check_temperature(temperature)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    rows = _check_linear(hidden, weight, bias, chunk_size)
    targets_flat = check_logits_and_targets(_logits_stand_in(hidden, weight), target_ids)
    row_mask = None if mask is None else check_mask(mask, target_ids.shape, hidden.device)
    options = LinearOptions(temperature, backend, chunk_size, weight_grad_fp32, tp_group, vocab_start,
                            reduce_hidden_grad, fused, grad_filter_eps)
    logp, entropy = _stats(rows, hidden, weight, bias, targets_flat, row_mask, options)
    logp = logp.reshape(target_ids.shape)
    return (logp, entropy.reshape(target_ids.shape)) if return_entropy else logp


class FusedLinearGSPOLoss(torch.nn.Module):
    """nn.Module form for trainers that hold the lm_head as a module:

        loss_fn = FusedLinearGSPOLoss(level="sequence", chunk_size=None)
        loss, metrics = loss_fn(hidden, model.lm_head, target_ids, old_logprobs, advantages, mask=mask)
    """

    def __init__(self, chunk_size: int | None = None, weight_grad_fp32: bool = True, fused: bool = False,
                 grad_filter_eps: float = DEFAULT_FILTER_EPS, **options) -> None:
        super().__init__()
        self.chunk_size = chunk_size
        self.weight_grad_fp32 = weight_grad_fp32
        self.fused = fused
        self.grad_filter_eps = grad_filter_eps
        self.config = GSPOConfig(**options)

    def forward(self, hidden, lm_head: torch.nn.Linear, target_ids, old_logprobs, advantages, **tensors):
        return fused_linear_gspo_loss(hidden, lm_head.weight, target_ids, old_logprobs, advantages,
                                      bias=lm_head.bias, chunk_size=self.chunk_size,
                                      weight_grad_fp32=self.weight_grad_fp32, fused=self.fused,
                                      grad_filter_eps=self.grad_filter_eps, config=self.config, **tensors)

    def extra_repr(self) -> str:
        return (f"chunk_size={self.chunk_size}, weight_grad_fp32={self.weight_grad_fp32}, fused={self.fused}, "
                f"grad_filter_eps={self.grad_filter_eps}, {self.config!r}")
