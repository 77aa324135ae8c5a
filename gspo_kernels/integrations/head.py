"""The lm_head read the way a sharded model expects: through the head module's own call.

A trainer's fused forward needs the lm_head's weight, not its output. Read as
`model.lm_head.weight` outside the head's forward, a sharded head is only a shard: under FSDP2
a DTensor (verl wraps an untied lm_head as its own unit, so no enclosing forward has unsharded
it), under DeepSpeed ZeRO-3 an empty partition. Running the token stats as the head module's
forward instead lets the hooks the wrapper put on it do their work: FSDP2 unshards the weight
for the call, reshards it after, unshards it again for backward and reduce-scatters its
gradient into the shard; ZeRO-3 gathers the partition for the call and routes the gradient to
it. No full-weight gradient buffer outlives the one unsharded step, as for the head's own forward.
"""

from __future__ import annotations

import torch

from ..config import LinearConfig
from ..linear import fused_linear_selective_log_softmax
from ..token_stats.kept_set import SamplingFilter


def _sampling_options(sampling: SamplingFilter | None) -> dict:
    if sampling is None:
        return {}
    return {"sampling_top_k": sampling.top_k, "sampling_top_p": sampling.top_p, "sampling_min_p": sampling.min_p}


def call_as_forward(module: torch.nn.Module, fn, *args, **kwargs):
    """fn(*args, **kwargs) as `module`'s forward for one call, its hooks included (a sharded
    wrapper's unshard and reshard, its casts of the inputs)."""
    had_own = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    module.forward = fn
    try:
        return module(*args, **kwargs)
    finally:
        if had_own:
            module.forward = previous
        else:
            del module.forward


def head_token_stats(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                     mask: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                     linear: LinearConfig | None = None, logit_scale: float = 1.0,
                     logit_softcap: float | None = None, sampling: SamplingFilter | None = None,
                     kept_tokens=None):
    """(log-probs, entropies) of `targets` under softmax(softcap(head(hidden) * logit_scale) /
    temperature) (the model's own multiplier and soft-cap: model_logits.py; sampling: the
    generation's kept set, token_stats/kept_set.py), from
    fused_linear_selective_log_softmax on the head's weight and bias as its own forward sees
    them. dtype: what hidden, weight and bias are cast to (float32 for TRL's
    cast_lm_head_to_fp32; verl's fused forwards use the hidden states'); None: the weight's.
    linear: how the fused-linear call runs (the trainer's batch_invariant); None: the defaults.
    kept_tokens: the engine's kept sets of the rows (a KeptTokens), instead of `sampling`.
    The head's products are formed by the kernels (float32 results), not by autocast.

    A PEFT adapter on the head itself is refused: its delta never enters `head.weight`, so it
    would be ignored and never trained (TRL refuses it on its fused head for the same reason)."""
    if hasattr(head, "base_layer") and hasattr(head, "active_adapters"):
        raise ValueError("the lm_head carries a PEFT adapter ('lm_head' is in the adapter's target_modules): the "
                         "fused forward reads the head's weight, so the adapter would never be trained; remove "
                         "'lm_head' from target_modules, or turn the fused kernels off")

    def stats(hidden):
        weight, bias = head.weight, head.bias
        if hasattr(weight, "full_tensor"):  # a DTensor no enclosing unit unsharded (FSDP2 without a unit here)
            weight = weight.full_tensor()
            bias = None if bias is None else bias.full_tensor()
        if dtype is not None:
            weight = weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            return fused_linear_selective_log_softmax(hidden.to(weight.dtype), weight, targets, bias=bias,
                                                      temperature=temperature, return_entropy=True, mask=mask,
                                                      logit_scale=logit_scale, logit_softcap=logit_softcap,
                                                      linear=linear, kept_tokens=kept_tokens,
                                                      **_sampling_options(sampling))

    return call_as_forward(head, stats, hidden)


RANGE_BLOCK_BYTES = 64 << 20  # logits formed at a time by head_logit_range (counted as float32)


def head_logit_range(head: torch.nn.Module, hidden: torch.Tensor, *, logit_scale: float = 1.0,
                     logit_softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's smallest and largest logit of the model (the head's product in the weight's
    dtype, with the model's multiplier and soft-cap, before any temperature), returned as
    float32, without gradient: a trainer's statistic that reads every logit. The product is
    formed again, a block of rows at a time (one more forward product of the head), as the
    head's own call so that a sharded head is whole for it."""

    def ranges(hidden):
        weight, bias = head.weight, head.bias
        if hasattr(weight, "full_tensor"):
            weight = weight.full_tensor()
            bias = None if bias is None else bias.full_tensor()
        rows = hidden.shape[0]
        low = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        high = torch.empty_like(low)
        step = max(1, RANGE_BLOCK_BYTES // (4 * max(1, weight.shape[0])))
        with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, rows, step):
                part = slice(start, min(start + step, rows))
                # In the weight's dtype, as the model's own head forms its logits (bf16 on a bf16
                # model); min and max need no wider sum.
                logits = torch.nn.functional.linear(hidden[part].to(weight.dtype), weight, bias)
                low[part], high[part] = torch.aminmax(logits, dim=-1)
        # The multiplier (positive) and the soft-cap are increasing: they map the bounds.
        low, high = low * logit_scale, high * logit_scale
        if logit_softcap is not None:
            low, high = (logit_softcap * torch.tanh(t / logit_softcap) for t in (low, high))
        return low, high

    return call_as_forward(head, ranges, hidden.detach())
