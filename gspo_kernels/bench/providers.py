"""Every implementation the benchmark times, behind one interface.

A provider turns a BenchProblem into a Step: a leaf logits tensor and `loss()`, a scalar
differentiable in it. All compute GSPO at sequence level with seq-mean-token-mean
aggregation, on every row of the batch. Baselines:

    eager      the usual trainer code: log_softmax(logits.float()) + gather + GSPO formula
    eager_trl  the same objective with log-probs taken one sequence at a time, as TRL's
               selective_log_softmax does to save memory (log_softmax per row for 16-bit
               logits, logsumexp per row for fp32)
    compile    torch.compile of `eager`
    reference  gspo_kernels.reference.gspo_loss: the float64 oracle
    liger      Liger-Kernel's triton_grpo_loss(importance_sampling_level="sequence")
and this package's backends: torch, triton, cpu, cuda; and the stage-2 variants obj_* (FAMILY
below) on the auto backend, whose time should match plain GSPO's.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from .. import backends
from ..testing import reference
from ..loss import gspo_loss
from ..token_stats.on_logits import selective_log_softmax
from .problem import EPS_HIGH, EPS_LOW, BenchProblem


def gspo_from_logprobs(logp, old, adv, mask):
    """Sequence-level GSPO from per-token log-probs, as a trainer would write it."""
    m = mask.to(logp.dtype)
    count = m.sum(1)
    seq_ratio = torch.exp(((logp - old) * m).sum(1) / count.clamp(min=1))
    per_seq = -torch.minimum(seq_ratio * adv, seq_ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * adv)
    has_response = (count > 0).to(logp.dtype)
    return (per_seq * has_response).sum() / has_response.sum().clamp(min=1)


def _eager_logprobs(logits, targets):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _trl_style_logprobs(logits, targets):
    if logits.dtype in (torch.float32, torch.float64):
        picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return picked - lse
    rows = [torch.log_softmax(row, dim=-1).gather(-1, t.unsqueeze(-1)).squeeze(-1) for row, t in zip(logits, targets)]
    return torch.stack(rows).float()


def _eager_loss(logits, targets, old, adv, mask):
    return gspo_from_logprobs(_eager_logprobs(logits, targets), old, adv, mask)


def compiled_for_timing(fn):
    """torch.compile of `fn` with donated buffers off, as the backward timing ran it when it replayed
    one graph's backward (retain_graph=True, which a compiled backward with donated buffers refused
    at N = 16384, V = 151936 on an H200, torch 2.11); each timed backward now has a forward of its
    own, and the setting stays so that the compiled contender's figures compare with the earlier ones."""
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False
    return torch.compile(fn)


@functools.lru_cache(maxsize=None)
def _compiled_eager():
    return compiled_for_timing(_eager_loss)


def requires(module: str, package: str, gpu_only: bool = False):
    """An availability check: the reason a provider cannot run here, or None."""

    def unavailable(device: str) -> str | None:
        if gpu_only and device != "cuda":
            return "needs a CUDA GPU"
        try:
            importlib.import_module(module)
        except ImportError:
            return f"{package} not installed (pip install {package})"
        return None

    return unavailable


_liger_available = requires("liger_kernel.transformers.grpo_loss", "liger-kernel", gpu_only=True)


@dataclass
class Step:
    leaf: torch.Tensor  # requires grad; its .grad is the logits gradient
    loss: Callable[[], torch.Tensor]
    other_leaves: tuple = ()  # fused linear: the weight (and bias) beside the hidden states

    def clear_grads(self) -> None:
        for t in (self.leaf, *self.other_leaves):
            t.grad = None

    def run(self) -> None:
        """One forward + backward from cleared gradients."""
        self.clear_grads()
        self.loss().backward()


def _on_logits(fn):
    """A Step over the problem's own (B, T, V) logits."""

    def build(p: BenchProblem) -> Step:
        leaf = p.logits.detach().requires_grad_()
        return Step(leaf, lambda: fn(leaf, p))

    return build


def _liger_step(p: BenchProblem) -> Step:
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    # Liger takes (B, T + 1, V) logits and drops the last position itself: give it its own input.
    pad = torch.zeros(p.shape.batch, 1, p.shape.vocab, dtype=p.dtype, device=p.logits.device)
    leaf = torch.cat([p.logits.detach(), pad], dim=1).requires_grad_()

    def loss():
        value, _ = triton_grpo_loss(leaf, p.old_logprobs, None, p.target_ids, p.advantages, p.mask,
                                    temperature=1.0, beta=0.0, eps_low=EPS_LOW, eps_high=EPS_HIGH, inplace=False,
                                    loss_type="grpo", importance_sampling_level="sequence", reduce=True)
        return value

    return Step(leaf, loss)


def _ours(backend: str):
    def loss(logits, p):
        value, _ = gspo_loss(logits, p.target_ids, p.old_logprobs, p.advantages, mask=p.mask,
                             eps_low=EPS_LOW, eps_high=EPS_HIGH, backend=backend)
        return value

    return _on_logits(loss)


# Variants on the auto backend (the cpu kernel on a CPU, Triton on a GPU). The stage-2
# objectives run the same kernels, so their time should stay within a few percent of plain GSPO;
# the model's logit transforms run inside them: a scale folds into the temperature (free), a
# soft-cap adds one tanh per logit to each pass; the sampler's kept set adds a pre-pass.
FAMILY = {
    "tx_scale": dict(logit_scale=0.0625),  # Cohere's value
    "tx_softcap": dict(logit_softcap=30.0),  # Gemma 2's value
    "obj_cispo": dict(objective="cispo"),
    "obj_sapo": dict(objective="sapo"),
    "obj_gmpo": dict(objective="gmpo", eps_low=0.4, eps_high=0.4),
    "obj_clip_corrected": dict(rollout_correction="sequence-mask", rollout_is_min=0.5, top_entropy_quantile=0.2,
                               off_policy_mask_threshold=0.5, delta=2.0),
    # The sampler's kept set: a selection pass before the kernels, without a sort (the cpu
    # backend's csrc/cpu/kept_set.cpp; on a GPU the Triton one, triton/kept_set_kernels.py).
    "tx_top_k": dict(sampling_top_k=50),
    "tx_top_p": dict(sampling_top_p=0.9),
    "tx_min_p": dict(sampling_min_p=0.1),
}
# The variants' price is their forward + backward against plain GSPO's: the quick suite (the main
# job) times that mode alone, the full suite each pass too.
FAMILY_FULL_ONLY_MODES = ("forward", "backward")


# The options that change the log-probs themselves (the logits' transforms and the kept set).
LOGIT_OPTIONS = ("logit_scale", "logit_softcap", "sampling_top_k", "sampling_top_p", "sampling_min_p")


def _variant_targets(p: BenchProblem, options) -> torch.Tensor:
    """The problem's targets, or for a kept-set variant each row's largest logit: a sampler only
    emits kept tokens, and the random targets fell outside a top-k of 50 for all but 0.1% of the
    rows (top-p 0.9: 77%), whose log-probs were then -inf and whose rows got no gradient (the
    backward zero-filled every row: 8 x 512 x 32768, 2026-12-06)."""
    if not any(k.startswith("sampling_") for k in options):
        return p.target_ids
    return p.logits.argmax(-1)


def _old_logprobs(p: BenchProblem, options, targets: torch.Tensor) -> torch.Tensor:
    """Old log-probs a little off the variant's own (the problem's offsets from its plain ones):
    against the plain log-probs a transform's ratios left the clip range for half the sequences
    (seq_clip_frac_high 0.5 with logit_scale 0.0625 or logit_softcap 30 at 8 x 512 x 32768),
    whose rows then got no gradient and were skipped in backward, which flattered the variant."""
    transform = {k: v for k, v in options.items() if k in LOGIT_OPTIONS}
    if not transform and targets is p.target_ids:
        return p.old_logprobs
    with torch.no_grad():
        offsets = p.old_logprobs - selective_log_softmax(p.logits, p.target_ids)
        return selective_log_softmax(p.logits, targets, **transform) + offsets


def _family(options):
    def build(p: BenchProblem) -> Step:
        leaf = p.logits.detach().requires_grad_()
        targets = _variant_targets(p, options)
        old = _old_logprobs(p, options, targets)
        # Sampler log-probs a little off the old ones, so the corrections have work to do.
        rollout = old - 0.05 * torch.cos(torch.arange(old.numel(), device=leaf.device)).reshape(old.shape)
        extra = {"rollout_logprobs": rollout} if "rollout_correction" in options else {}

        def loss():
            value, _ = gspo_loss(leaf, targets, old, p.advantages, mask=p.mask, **extra,
                                 **{"eps_low": EPS_LOW, "eps_high": EPS_HIGH, **options})
            return value

        return Step(leaf, loss)

    return build


def _ours_available(backend: str):
    def available(device: str) -> str | None:
        if backend == "triton":
            if backends.triton_backend is None:
                return "triton not installed"
            if device != "cuda":
                return "CPU runs Triton only through its interpreter: a correctness path, not timed"
        if backend in ("cpu", "cuda"):
            if not backends.native_available():
                return "extension gspo_kernels.backends._C not built"
            if device != backend:
                return f"needs {backend} tensors"
            if backend == "cuda" and not backends.native_backend.with_cuda():
                return "extension built without CUDA"
        return None

    return available


def _always(device: str) -> str | None:
    return None


def _baseline(logprobs_fn):
    return _on_logits(lambda logits, p: gspo_from_logprobs(logprobs_fn(logits, p.target_ids), p.old_logprobs,
                                                           p.advantages, p.mask))


def _compiled(logits, p):
    return _compiled_eager()(logits, p.target_ids, p.old_logprobs, p.advantages, p.mask)


def _reference(logits, p):
    value, _ = reference.gspo_loss(logits, p.target_ids, p.old_logprobs, p.advantages, mask=p.mask,
                                   eps_low=EPS_LOW, eps_high=EPS_HIGH)
    return value


@dataclass(frozen=True)
class Provider:
    name: str
    build: Callable[[BenchProblem], Step]
    unavailable: Callable[[str], str | None]  # reason it cannot run on a device, or None
    ours: bool = False
    # Modes the quick suite (the main job's default) leaves to the full one: the float64
    # oracle's forward and backward alone took about 2 minutes of a 2-core AVX2 CPU's main job.
    full_only_modes: tuple[str, ...] = ()
    # Timed by one call after a warm-up, in the first round only, and without its peak memory in
    # the quick suite: the float64 oracle, 10.7 s a warm call at the default CPU problem (2-core
    # EPYC, AVX-512; its first call took 19.4 s), whose ratio needs no second digit.
    quick_once: bool = False


PROVIDERS = {
    p.name: p
    for p in [
        Provider("eager", _baseline(_eager_logprobs), _always),
        Provider("eager_trl", _baseline(_trl_style_logprobs), _always),
        Provider("compile", _on_logits(_compiled), _always),
        Provider("reference", _on_logits(_reference), _always, full_only_modes=("forward", "backward"),
                 quick_once=True),
        Provider("liger", _liger_step, _liger_available),
        Provider("torch", _ours("torch"), _ours_available("torch"), ours=True),
        Provider("triton", _ours("triton"), _ours_available("triton"), ours=True),
        Provider("cpu", _ours("cpu"), _ours_available("cpu"), ours=True),
        Provider("cuda", _ours("cuda"), _ours_available("cuda"), ours=True),
    ]
    + [Provider(name, _family(options), _always, ours=True, full_only_modes=FAMILY_FULL_ONLY_MODES)
       for name, options in FAMILY.items()]
}
BASELINE = "eager"
