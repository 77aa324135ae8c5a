"""The fused-linear entry points: the loss (or the token stats) from hidden states and the
lm_head weight, without the `[N, V]` logits (docs/fused_linear.md).

Each call checks its operands, resolves one LinearPlan (plan.py) from the validated
LinearConfig, and runs the chunked path (chunked.py, every backend) or the Triton tile path
(tiled.py, fused=True); stage 2 is the same `sequence.gspo_objective` as for logits.
"""

from __future__ import annotations

import torch

from ..config import LinearConfig, check_backend, resolve_config, split_linear_options
from ..config.values import check_logit_scale, check_logit_softcap, check_sampling, check_temperature
from ..token_stats.kept_set import SamplingFilter
from ..inputs.batch import CallInputs, prepare_batch
from ..inputs.checks import TokenLayout, check_mask, check_targets
from ..config.logit_map import LogitMap
from ..sequence.gspo_objective import gspo_objective
from ..token_stats.on_kept_tokens import check_kept_tokens, no_other_kept_set
from .chunked import FusedLinearTokenStats
from .kept_rows import KeptRowsTokenStats
from .one_pass import OnePassLoss, one_pass_loss
from .plan import LinearPlan
from .tiled import TiledLinearTokenStats


def _check_linear(hidden, weight, bias):
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
    return hidden.reshape(-1, hidden.shape[-1])


def _token_stats(rows, weight, bias, targets, row_mask, plan: LinearPlan, kept_tokens=None):
    if kept_tokens is not None:
        target_pos = check_kept_tokens(kept_tokens, targets, row_mask, weight.shape[0], plan.tp_slice)
        return KeptRowsTokenStats.apply(rows, weight, bias, targets, row_mask, plan, kept_tokens, target_pos)
    function = TiledLinearTokenStats if plan.linear.fused else FusedLinearTokenStats
    return function.apply(rows, weight, bias, targets, row_mask, plan)


def fused_linear_gspo_loss(hidden, weight, target_ids, old_logprobs, advantages, *, bias=None, mask=None,
                           cu_seqlens=None, ref_logprobs=None, rollout_logprobs=None, normalizer=None,
                           entropy_threshold=None, tp_group=None, vocab_start=None, cp_group=None,
                           kept_tokens=None, config=None, linear: LinearConfig | None = None, **options):
    """gspo_loss on the logits `hidden @ weight.T + bias`, never holding them whole.

    hidden: `(B, T, H)` or `(N, H)` (strided rows such as `hidden[:, :-1]` are copied once into
    rows); weight: `(V, H)`, the lm_head weight; bias: `(V,)` or None; all one dtype and
    device. Gradients flow to hidden, weight and bias.

    Options: the fields of LinearConfig (chunk_size, weight_grad_fp32, reduce_hidden_grad,
    fused, grad_filter_eps, batch_invariant, schedule), as keywords or as
    `linear=LinearConfig(...)`, say how it runs;
    every other keyword is a loss option of gspo_loss (or pass `config=GSPOConfig(...)`).
    The per-call tensors are gspo_loss's.

    Distributed: tp_group when weight (and bias) hold this rank's vocab slice (vocab_start as
    in gspo_loss); `d hidden` is then summed over tp_group unless reduce_hidden_grad=False.
    cp_group as in gspo_loss.

    fused=True: the Triton kernels with the logits only in on-chip tiles (CUDA tensors, or CPU
    tensors under TRITON_INTERPRET=1): float32 atomics in backward (not bit-reproducible).
    grad_filter_eps > 0 turns on gradient filtering (docs/fused_linear.md, "Gradient filtering").

    kept_tokens (a KeptTokens, as in gspo_loss): only the weight rows of each token's kept ids
    are multiplied, N k H multiply-adds in place of N V H (docs/fused_linear.md, "The engine's
    kept sets"); chunk_size, fused, schedule and grad_filter_eps do not apply then.
    """
    linear, options = split_linear_options(linear, options)
    config = resolve_config(config, options)
    rows = _check_linear(hidden, weight, bias)
    layout = TokenLayout(hidden.shape[:-1], hidden.device)
    call = CallInputs(mask=mask, cu_seqlens=cu_seqlens, ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs,
                      normalizer=normalizer, entropy_threshold=entropy_threshold, cp_group=cp_group, tp_group=tp_group,
                      vocab_start=vocab_start, kept_tokens=kept_tokens)
    batch = prepare_batch(config, layout, target_ids, old_logprobs, advantages, call)
    no_other_kept_set(kept_tokens, SamplingFilter.of(config), None)
    plan = LinearPlan.of(linear, config.logit_map, config.backend, rows, weight, tp_group, vocab_start,
                         SamplingFilter.of(config))
    groups = None if kept_tokens is not None else plan.schedule(config, batch)
    if groups is not None:
        loss, metrics = one_pass_loss(rows, weight, bias, plan, OnePassLoss(config, batch, groups))
    else:
        row_mask = None if batch.row_mask is None else batch.row_mask.reshape(-1)
        logp, entropy = _token_stats(rows, weight, bias, batch.targets.reshape(-1), row_mask, plan, kept_tokens)
        loss, metrics = gspo_objective(config, batch, logp.view(batch.token_shape), entropy.view(batch.token_shape))
    # The schedule that ran, as a number a trainer's logger takes (docs/fused_linear.md, "Schedules").
    metrics["fused_linear_one_pass"] = torch.full((), float(groups is not None), device=hidden.device)
    return loss, metrics


def fused_linear_selective_log_softmax(hidden, weight, target_ids, *, bias=None, temperature=1.0,
                                       return_entropy=False, backend="auto", mask=None, tp_group=None,
                                       vocab_start=None, logit_scale=1.0, logit_softcap=None, sampling_top_k=None,
                                       sampling_top_p=None, sampling_min_p=None, kept_tokens=None,
                                       linear: LinearConfig | None = None, **linear_options):
    """selective_log_softmax on the logits `hidden @ weight.T + bias` (with the model's
    logit_scale and logit_softcap), chunk by chunk, with the full backward (entropy gradient
    included) to hidden, weight and bias. tp_group, vocab_start and the LinearConfig options as
    in fused_linear_gspo_loss; the sampling options as in selective_log_softmax (chunked path only);
    kept_tokens as in fused_linear_gspo_loss."""
    linear = resolve_config(linear, linear_options, LinearConfig)
    check_sampling(sampling_top_k, sampling_top_p, sampling_min_p)
    logit_map = LogitMap.of(check_temperature(temperature), check_logit_scale(logit_scale),
                            check_logit_softcap(logit_softcap))
    check_backend(backend)
    rows = _check_linear(hidden, weight, bias)
    layout = TokenLayout(hidden.shape[:-1], hidden.device)
    targets_flat = check_targets(target_ids, layout).reshape(-1)
    row_mask = None if mask is None else check_mask(mask, layout).reshape(-1)
    sampling = SamplingFilter(sampling_top_k, sampling_top_p, sampling_min_p)
    no_other_kept_set(kept_tokens, sampling, None)
    plan = LinearPlan.of(linear, logit_map, backend, rows, weight, tp_group, vocab_start, sampling)
    logp, entropy = _token_stats(rows, weight, bias, targets_flat, row_mask, plan, kept_tokens)
    logp = logp.reshape(target_ids.shape)
    return (logp, entropy.reshape(target_ids.shape)) if return_entropy else logp


class FusedLinearGSPOLoss(torch.nn.Module):
    """nn.Module form for trainers that hold the lm_head as a module; options (LinearConfig's
    and GSPOConfig's) fixed and validated once:

        loss_fn = FusedLinearGSPOLoss(level="sequence", chunk_size=None)
        loss, metrics = loss_fn(hidden, model.lm_head, target_ids, old_logprobs, advantages, mask=mask)
    """

    def __init__(self, linear: LinearConfig | None = None, **options) -> None:
        super().__init__()
        self.linear, options = split_linear_options(linear, options)
        self.config = resolve_config(None, options)

    def forward(self, hidden, lm_head: torch.nn.Linear, target_ids, old_logprobs, advantages, **tensors):
        if not isinstance(getattr(lm_head, "weight", None), torch.Tensor):
            got = "a tensor" if isinstance(lm_head, torch.Tensor) else type(lm_head).__name__
            raise TypeError(f"FusedLinearGSPOLoss takes the lm_head module (an nn.Linear: its weight and bias); got "
                            f"{got}. For a weight tensor call gk.fused_linear_gspo_loss(hidden, weight, ..., bias=)")
        return fused_linear_gspo_loss(hidden, lm_head.weight, target_ids, old_logprobs, advantages,
                                      bias=lm_head.bias, config=self.config, linear=self.linear, **tensors)

    def extra_repr(self) -> str:
        return f"{self.linear!r}, {self.config!r}"
