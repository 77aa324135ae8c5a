"""Stages 1 and 3 behind one autograd Function, shared by every backend.

Forward reads the logits once (stage 1) and keeps only O(N) statistics next to a reference
to the logits. Backward receives dLoss/dlogp and dLoss/dH from whatever PyTorch code used
them (stage 2, or a trainer's own objective) and reads the logits once more to write the
gradient (stage 3). So the upstream gradient, grad_output included, is folded into the one
gradient pass: no extra `[N, V]` scaling pass and no host sync to test for grad_output == 1.
"""

from __future__ import annotations

import torch

from . import backends
from .backends.layout import writable_in_place
from .config import BACKENDS
from .inputs import check_logits_and_targets


class TokenStatsFunction(torch.autograd.Function):
    """(logits, targets) -> (logp, entropy), both `[N]`; backward computes dLoss/dlogits."""

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, backend_name: str, inplace: bool):
        backend = backends.get(backend_name)
        inv_temperature = 1.0 / temperature
        logp, entropy, lse = backend.token_stats(logits, targets, inv_temperature)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.inv_temperature = inv_temperature
        ctx.backend_name = backend_name
        ctx.inplace = inplace
        # Unused outputs arrive as None, so stage 3 can skip the entropy term entirely.
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        if (grad_logp is None and grad_entropy is None) or not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        logits, targets, lse, entropy = ctx.saved_tensors
        # Autograd may hand over expanded (stride-0) gradients; the kernels index rows directly.
        grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp.to(lse.dtype).contiguous()
        if grad_entropy is not None:
            grad_entropy = grad_entropy.to(lse.dtype).contiguous()
        backend = backends.get(ctx.backend_name)
        args = (targets, lse, entropy, grad_logp, grad_entropy, ctx.inv_temperature)
        if ctx.inplace and writable_in_place(logits):
            grad = backend.logits_grad_(logits, *args)
            # The saved logits now hold the gradient: a second backward must fail loudly.
            torch.autograd.graph.increment_version(logits)
        else:
            grad = backend.logits_grad(logits, *args)
        return grad, None, None, None, None


def token_stats(logits, targets_flat, temperature: float, backend_name: str, inplace: bool = False):
    """Stage 1 with autograd: `[N]` logp and entropy in float32 (float64 for float64 logits)."""
    return TokenStatsFunction.apply(logits, targets_flat, temperature, backend_name, inplace)


def selective_log_softmax(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    backend: str = "auto",
    inplace: bool = False,
):
    """log_softmax(logits / temperature) gathered at target_ids, without a `[N, V]` buffer.

    logits: `(B, T, V)` or `(N, V)`, float32/bfloat16/float16 (float64 on backend='torch');
    rows may be strided views. target_ids: the leading shape, int64 or int32.
    Returns float32 log-probs shaped like target_ids, and the per-token entropy of
    softmax(logits / temperature) when return_entropy is True. Differentiable: backward
    writes dlogits in one pass over the logits (into their storage when inplace=True, unless
    their rows share memory or their vocab dim is not contiguous).
    A target id outside [0, V) gives NaN for that token.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a positive float; got {temperature!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    targets_flat = check_logits_and_targets(logits, target_ids)
    resolved = backends.resolve(backend, logits)
    logp, entropy = token_stats(logits, targets_flat, float(temperature), resolved, inplace)
    logp = logp.reshape(target_ids.shape)
    if return_entropy:
        return logp, entropy.reshape(target_ids.shape)
    return logp
