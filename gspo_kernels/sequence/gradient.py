"""The loss handed to autograd with its gradient already known.

Stage 2 computes the loss and its two per-token coefficients g = dLoss/dlogp and
h = dLoss/dH in one no-grad pass (gspo_objective.py), instead of recording a graph for autograd to
walk back: every recorded op would cost one or more ops again in backward, and on a GPU each
op is a launch that a small micro-batch cannot hide. Backward then only scales g and h by the
loss's upstream gradient, which the token-stats Function passes on to the one gradient kernel.
"""

from __future__ import annotations

import torch


class LossWithGradient(torch.autograd.Function):
    """(per-token weighted terms, their total) -> the loss, whose gradient with respect to logp
    (and entropy, when h is given) is grad * g (grad * h)."""

    @staticmethod
    def forward(ctx, weighted, total, logp, entropy, g, h):
        ctx.save_for_backward(g, h)
        ctx.shape = logp.shape
        ctx.has_h = h is not None
        return total(weighted)

    @staticmethod
    def backward(ctx, grad):
        g, h = ctx.saved_tensors
        grad_h = _shaped(grad * h, ctx.shape) if ctx.has_h else None
        return None, None, _shaped(grad * g, ctx.shape), grad_h, None, None


def _shaped(t: torch.Tensor, shape) -> torch.Tensor:
    # policy_loss hands over log-probs of the token shape already: no view to dispatch then.
    return t if t.shape == shape else t.reshape(shape)


def attach_gradient(weighted: torch.Tensor, total, logp: torch.Tensor, entropy: torch.Tensor, g: torch.Tensor,
                    h: torch.Tensor | None) -> torch.Tensor:
    """The loss total(weighted) (a 0-d tensor), differentiable with respect to logp (and entropy)
    with gradient g (h), both of the token shape."""
    if not (logp.requires_grad or (h is not None and entropy.requires_grad)):
        return total(weighted)
    return LossWithGradient.apply(weighted, total, logp, entropy, g, h)
