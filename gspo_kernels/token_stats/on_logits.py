"""Stages 1 and 3 behind one autograd Function, shared by every backend.

Forward reads the logits once (stage 1) and keeps only O(N) statistics next to a reference
to the logits. Backward receives dLoss/dlogp and dLoss/dH from whatever PyTorch code used
them (stage 2, or a trainer's own objective) and reads the logits once more to write the
gradient (stage 3). So the upstream gradient, grad_output included, is folded into the one
gradient pass: no extra `[N, V]` scaling pass and no host sync to test for grad_output == 1.
"""

from __future__ import annotations

import torch

from .. import backends
from ..backends.contract import GradInputs, StatsInputs
from ..backends.layout import writable_in_place
from ..config import check_backend
from ..config.values import check_logit_scale, check_logit_softcap, check_sampling, check_temperature
from ..distributed.vocab_parallel import VocabSlice
from ..inputs.checks import TokenLayout, check_mask, check_targets
from ..config.logit_map import LogitMap
from .kept_set import SamplingFilter, kept_set_stats
from .on_kept_tokens import kept_token_stats, no_other_kept_set
from .upstream import upstream_grads
from .slice_grad import slice_logits_grad


class TokenStatsFunction(torch.autograd.Function):
    """(logits, targets) -> (logp, entropy), both of the targets' shape (the token shape, or
    `[N]`); backward computes dLoss/dlogits.

    row_mask (bool, the targets' shape, or None for every row) marks the rows in the loss: the
    others get an exact zero gradient whatever their logits hold (see GradInputs for the whole
    row rule). Targets and row_mask are contiguous: the kernels read them as rows.
    """

    @staticmethod
    def forward(ctx, logits, targets, row_mask, logit_map: LogitMap, backend_name: str, inplace: bool,
                tp_slice: VocabSlice | None, kept_min: torch.Tensor | None = None,
                sampling: SamplingFilter | None = None):
        backend = backends.get(backend_name)
        owned = None
        if tp_slice is not None:
            targets, owned = tp_slice.local_targets(targets)
        if sampling is not None:  # the sampler's kept set, selected here
            logp, entropy, lse, kept_min = kept_set_stats(backend, logits, StatsInputs(targets, logit_map), sampling,
                                                          backend_name)
        else:
            logp, entropy, lse = backend.token_stats(logits, StatsInputs(targets, logit_map, kept_min))
        if tp_slice is not None:
            logp, entropy, lse = tp_slice.merge(logp, entropy, lse, owned)  # batch-invariant: rank order
        # Saving an output costs autograd a detach to save and one to unpack: a detached alias
        # costs one op.
        ctx.save_for_backward(logits, targets, lse, entropy.detach(), row_mask, owned, kept_min)
        ctx.tp_slice = tp_slice
        ctx.logit_map = logit_map
        ctx.backend_name = backend_name
        ctx.inplace = inplace
        # Unused outputs arrive as None, so stage 3 can skip the entropy term entirely.
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        no_grads = (None,) * 9
        if (grad_logp is None and grad_entropy is None) or not ctx.needs_input_grad[0]:
            return no_grads
        if getattr(ctx, "wrote_in_place", False):  # before saved_tensors, whose error names no cause
            raise RuntimeError("gspo_kernels: inplace=True wrote the logits' gradient into their storage in the "
                               "first backward, so a second backward through the same loss cannot read them; "
                               "use inplace=False (the default) to backward twice (retain_graph=True)")
        logits, targets, lse, entropy, row_mask, owned, kept_min = ctx.saved_tensors
        grad_logp, grad_entropy = upstream_grads(grad_logp, grad_entropy, lse)
        inputs = GradInputs(targets, lse, entropy, grad_logp, grad_entropy, row_mask, ctx.logit_map, kept_min)
        backend = backends.get(ctx.backend_name)
        grad = slice_logits_grad(backend, logits, inputs, None if ctx.tp_slice is None else owned,
                                 ctx.inplace and writable_in_place(logits))
        if grad is logits:
            # The saved logits now hold the gradient: a second backward must fail loudly.
            torch.autograd.graph.increment_version(logits)
            ctx.wrote_in_place = True
        return (grad,) + no_grads[1:]


def token_stats(logits, targets, logit_map: LogitMap, backend_name: str, inplace: bool = False,
                row_mask: torch.Tensor | None = None, tp_slice: VocabSlice | None = None,
                sampling: SamplingFilter | None = None, sampling_threshold: torch.Tensor | None = None,
                kept_tokens=None):
    """Stage 1 with autograd: logp and entropy in float32 (float64 for float64 logits) of the
    targets' shape (contiguous int64: the token shape or `[N]` rows). With a vocab slice (tp_slice) the
    logits are this rank's slice and the results are the global ones. sampling (or a given
    sampling_threshold, the raw logits' per-token minimum kept): the log-probs and entropies of
    the sampler's kept set (kept_set.py); kept_tokens (a KeptTokens): those of the engine's own
    sets (on_kept_tokens.py)."""
    if kept_tokens is not None:
        no_other_kept_set(kept_tokens, sampling, sampling_threshold)
        return kept_token_stats(logits, targets, logit_map, kept_tokens, inplace, row_mask, tp_slice)
    active = sampling is not None and sampling.active
    if active and sampling_threshold is None and tp_slice is None:  # selected in the forward
        return TokenStatsFunction.apply(logits, targets, row_mask, logit_map, backend_name, inplace, tp_slice, None,
                                        sampling)
    kept_min = given_kept_min(logits, targets.shape, sampling, sampling_threshold, tp_slice)
    return TokenStatsFunction.apply(logits, targets, row_mask, logit_map, backend_name, inplace, tp_slice, kept_min)


def given_kept_min(logits, token_shape, sampling, sampling_threshold, tp_slice):
    """The per-row kept-set thresholds passed as sampling_threshold (float32, contiguous,
    token_shape), checked, or None without one; refuses it beside the sampling options, and
    those options with a vocab slice."""
    active = sampling is not None and sampling.active
    if sampling_threshold is None and not active:
        return None
    if sampling_threshold is not None and active:
        raise ValueError("pass the sampler's kept set either as sampling_threshold or as sampling_top_k/_top_p/"
                         "_min_p options, not both")
    if tp_slice is not None:
        raise NotImplementedError("the sampler's kept set over vocab-parallel logits (tp_group) needs a selection "
                                  "across ranks, which is not implemented: compute the log-probs without "
                                  "tp_group, or without the sampling options")
    if not isinstance(sampling_threshold, torch.Tensor) or not sampling_threshold.dtype.is_floating_point:
        raise TypeError("sampling_threshold must be a float tensor: per token, the smallest raw logit the sampler "
                        "kept")
    if sampling_threshold.shape != token_shape or sampling_threshold.device != logits.device:
        raise ValueError(f"sampling_threshold must be shaped like target_ids {tuple(token_shape)} on "
                         f"{logits.device}; got {tuple(sampling_threshold.shape)} on {sampling_threshold.device}")
    return sampling_threshold.detach().float().contiguous()


def selective_log_softmax(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    backend: str = "auto",
    inplace: bool = False,
    mask: torch.Tensor | None = None,
    tp_group=None,
    vocab_start: int | None = None,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    sampling_top_k: int | None = None,
    sampling_top_p: float | None = None,
    sampling_min_p: float | None = None,
    sampling_threshold: torch.Tensor | None = None,
    kept_tokens=None,
):
    """log_softmax(softcap(logits * logit_scale) / temperature) gathered at target_ids, without
    a `[N, V]` buffer. logit_scale and logit_softcap (c: y -> c * tanh(y / c)) are what the
    model does to its logits (1 and None for most models; docs/semantics.md).

    logits: `(B, T, V)` or `(N, V)`, float32/bfloat16/float16 (float64 on backend='torch');
    rows may be strided views. target_ids: the leading shape, int64 or int32.
    Returns float32 log-probs shaped like target_ids, and the per-token entropy of
    softmax(logits / temperature) when return_entropy is True. Differentiable: backward
    writes dlogits in one pass over the logits (into their storage when inplace=True, unless
    their rows share memory or their vocab dim is not contiguous).

    mask: bool (or 0/1 integer) like target_ids, True for the tokens your objective uses.
    Rows outside it get an exact zero gradient whatever they hold (NaN logits, pad ids such
    as -100), and backward does not read them. Without a mask every row is in use: a target
    id outside [0, V), or a row with a NaN or +inf logit (or all -inf), gives a NaN log-prob
    and a NaN gradient row, whatever the upstream gradient.

    tp_group: vocab-parallel logits (docs/distributed.md): `logits` hold this rank's slice
    [vocab_start, vocab_start + V_local) of the vocabulary (vocab_start defaults to rank *
    V_local), target_ids are global ids, the results are the global ones on every rank, and
    backward writes this slice's gradient.

    sampling_top_k, sampling_top_p, sampling_min_p (as vLLM applies them), or sampling_threshold
    (per token, the smallest raw logit the sampler kept): log-probs and entropies of the
    distribution the engine sampled from, the softmax renormalised over the kept tokens
    (docs/semantics.md, "The sampler's kept set"); a target outside it gets a -inf log-prob.

    kept_tokens (a KeptTokens: per token row, the ids the engine's sampler kept, as vLLM and
    SGLang report them): the same over those sets exactly (docs/semantics.md, "The engine's kept
    sets"); O(nnz) work, only the kept logits get a gradient, and a row in the loss whose target
    is not in its set is an error.
    """
    check_sampling(sampling_top_k, sampling_top_p, sampling_min_p)
    logit_map = LogitMap.of(check_temperature(temperature), check_logit_scale(logit_scale),
                            check_logit_softcap(logit_softcap))
    check_backend(backend)
    layout = TokenLayout.of_logits(logits)
    targets = check_targets(target_ids, layout)
    row_mask = None if mask is None else check_mask(mask, layout)
    resolved = backends.resolve(backend, logits.device, logits.dtype)
    tp_slice = VocabSlice.of_rank(tp_group, vocab_start, logits.shape[-1])
    logp, entropy = token_stats(logits, targets, logit_map, resolved, inplace, row_mask, tp_slice,
                                SamplingFilter(sampling_top_k, sampling_top_p, sampling_min_p), sampling_threshold,
                                kept_tokens)
    return (logp, entropy) if return_entropy else logp
