"""Invalid inputs: a valid built problem with one thing broken, and the error it must raise.

docs/semantics.md refuses these with a TypeError (a wrong type or dtype: float masks above all,
where a weight other than 0/1 would silently change the loss) or a ValueError (a wrong shape or
value). Anything else (an internal RuntimeError from a kernel, an IndexError, or a result) is a
failure: the caller learns nothing from it, or trains on garbage.
"""

from __future__ import annotations

import torch

import gspo_kernels as gk

from fuzz_build import Built

EITHER = (TypeError, ValueError)


def applicable(built: Built) -> list[str]:
    """The corruptions that make sense for this problem (and entry point)."""
    entry, case = built.case.entry, built.case
    out = ["float_mask"]
    if entry != "gspo_loss":
        return out
    out += ["int_mask_value", "targets_float", "old_16bit", "advantages_shape", "mask_shape", "normalizer_bad",
            "logits_1d", "beta_without_ref", "unknown_option", "advantages_int", "targets_shape", "bad_option",
            "threshold_unread"]
    if case.backend != "torch":
        out.append("logits_float64")
    if case.packed:
        out += ["cu_start", "cu_decreasing", "cu_end", "cu_float", "cu_missing"]
    else:
        out.append("cu_on_padded")
    if built.options.get("rollout_correction") is None and built.options.get("off_policy_mask_threshold") is None:
        out.append("rollout_unread")
    return out


def _float_mask(built: Built, variant: int) -> torch.Tensor:
    dtype = (torch.float32, torch.float64, torch.bfloat16, torch.float16)[variant % 4]
    flags = built.in_response.reshape(built.token_shape)
    return flags.to(dtype)


def invalid_call(built: Built, corruption: str, variant: int):
    """(thunk, exception types it must raise) for `corruption` of the built problem."""
    case = built.case
    if corruption == "float_mask":
        mask = _float_mask(built, variant)
        if case.entry == "selective_log_softmax":
            return (lambda: gk.selective_log_softmax(built.view(built.base), built.targets, backend=case.backend,
                                                     mask=mask)), TypeError
        if case.entry == "policy_loss":
            lp = built.lp64.reshape(built.token_shape).float()
            kw = {**built.call_kwargs(), "mask": mask}
            opts = _no_entropy(built.options)
            return (lambda: gk.policy_loss(lp, built.old, built.advantages, **kw, **opts)), TypeError
        if case.entry == "fused_linear":
            kw = {**built.call_kwargs(), "mask": mask}
            return (lambda: gk.fused_linear_gspo_loss(built.view(built.base), built.weight_view(built.weight),
                                                      built.targets, built.old, built.advantages, bias=built.bias,
                                                      backend=case.backend, **kw, **built.options)), TypeError

    logits = built.view(built.base)
    args = [logits, built.targets, built.old, built.advantages]
    kwargs = {**built.call_kwargs(), **built.options, "backend": case.backend}
    expect = EITHER
    shape = built.token_shape
    if corruption == "float_mask":
        kwargs["mask"], expect = _float_mask(built, variant), TypeError
    elif corruption == "int_mask_value":
        mask = built.in_response.reshape(shape).to(torch.int64)
        if mask.numel() == 0:
            mask = torch.full(shape, 0, dtype=torch.int64)
            kwargs["mask"], expect = mask.to(torch.float32), TypeError
        else:
            mask.view(-1)[variant % mask.numel()] = (2, -1, 5)[variant % 3]
            kwargs["mask"], expect = mask, ValueError
    elif corruption == "targets_float":
        args[1], expect = built.targets.float(), TypeError
    elif corruption == "old_16bit":
        old = built.old if built.old is not None else built.lp64.reshape(shape)
        args[2], expect = old.to((torch.bfloat16, torch.float16)[variant % 2]), TypeError
    elif corruption == "advantages_shape":
        # Neither (S,) nor the token shape: longer than both the sequence and the token count.
        args[3] = torch.ones(max(len(built.seq_rows), built.in_response.numel()) + 1 + variant % 3)
    elif corruption == "advantages_int":
        args[3], expect = built.advantages.to(torch.int64), TypeError
    elif corruption == "mask_shape":
        kwargs["mask"] = torch.ones(built.in_response.numel() + 1, dtype=torch.bool)
    elif corruption == "targets_shape":
        args[1] = built.targets.reshape(-1)[:-1] if built.targets.numel() else torch.zeros(1, dtype=torch.int64)
    elif corruption == "normalizer_bad":
        bad = (0.0, -1.0, float("nan"), float("inf"))[variant % 4]
        kwargs["normalizer"] = bad if variant % 2 else torch.tensor(bad)
        expect = ValueError
    elif corruption == "logits_1d":
        args[0] = logits.reshape(-1)
    elif corruption == "logits_float64":
        args[0], expect = logits.double(), TypeError
    elif corruption == "beta_without_ref":
        kwargs.pop("ref_logprobs", None)
        kwargs["beta"] = 0.1
    elif corruption == "unknown_option":
        kwargs["eps_clip"], expect = 0.2, TypeError
    elif corruption == "bad_option":
        name, value = (("eps_low", 1.0), ("level", "tokens"), ("loss_agg", "mean"), ("temperature", 0.0),
                       ("kl_estimator", "k4"), ("top_entropy_quantile", 0.0))[variant % 6]
        kwargs[name] = value
    elif corruption == "threshold_unread":
        kwargs["entropy_threshold"], kwargs["top_entropy_quantile"] = 0.5, 1.0
    elif corruption == "rollout_unread":
        kwargs["rollout_logprobs"] = torch.zeros(shape)
    elif corruption == "logits_float64":
        args[0] = logits.double()
    elif corruption == "cu_start":
        cu = built.cu_seqlens.clone()
        cu[0] = 1
        kwargs["cu_seqlens"] = cu
    elif corruption == "cu_decreasing":
        cu = built.cu_seqlens.clone()
        if cu.numel() == 2:
            cu = torch.cat([cu[:1], cu[1:] + 1, cu[-1:]])
        elif bool((cu == cu[0]).all()):  # every sequence empty: flipped it would still be valid
            cu[1] = cu[-1] + 1
        else:
            cu = cu.flip(0)
        kwargs["cu_seqlens"] = cu
    elif corruption == "cu_end":
        cu = built.cu_seqlens.clone()
        cu[-1] = cu[-1] + 1 + variant % 3
        kwargs["cu_seqlens"] = cu
    elif corruption == "cu_float":
        kwargs["cu_seqlens"], expect = built.cu_seqlens.float(), TypeError
    elif corruption == "cu_missing":
        kwargs.pop("cu_seqlens")
    elif corruption == "cu_on_padded":
        kwargs["cu_seqlens"] = torch.tensor([0, built.in_response.numel()])
    return (lambda: gk.gspo_loss(*args, **kwargs)), expect


def _no_entropy(options: dict) -> dict:
    return {k: v for k, v in options.items() if k not in ("entropy_coef", "top_entropy_quantile")}
