"""Runs one backend on one problem next to the float64 reference and measures the gap.

Shared by the test suite and `python -m gspo_kernels check`, so both hold every backend
to the same tolerances.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..linear import fused_linear_gspo_loss
from ..loss import gspo_loss
from ..token_stats.on_logits import selective_log_softmax
from . import reference
from .problems import Problem

# Fractions of tokens: one token's difference is >= 1/N, so these must agree to rounding.
_COUNT_METRICS = ("clip_frac", "clip_frac_low", "clip_frac_high", "seq_clip_frac_low", "seq_clip_frac_high",
                  "rollout_masked_frac", "entropy_kept_frac", "off_policy_masked_frac")


@dataclass(frozen=True)
class Tolerance:
    """Largest accepted ||out - ref|| / ||ref|| (absolute error for the clip fractions)."""

    loss: float = 1e-5
    grad: float = 1e-5
    stats: float = 1e-5  # token log-probs, entropy, sequence ratios, KL
    counts: float = 1e-6

    @staticmethod
    def for_dtype(dtype: torch.dtype, objective: str = "clip") -> "Tolerance":
        # The loss and statistics are accumulated in fp32 whatever the logits' dtype; only the
        # gradient is rounded once to a 16-bit output (unit roundoff 2**-8 for bf16).
        tol = Tolerance(grad=1e-2) if dtype in (torch.bfloat16, torch.float16) else Tolerance()
        if objective == "vespo":
            # VESPO's weight is a function of the sequence's summed (not averaged) log-ratio: the
            # float32 log-probs' rounding (~1e-6 each) adds up over the tokens and moves the weight,
            # hence each term, by up to ~1e-5 relative (6e-5 seen on the loss in a 9-token grid case).
            tol = replace(tol, loss=1e-4, grad=max(tol.grad, 1e-4))
        return tol


def relative_error(out: torch.Tensor, ref: torch.Tensor, floor: float = 1e-12) -> float:
    """||out - ref|| / max(||ref||, floor) in float64; NaN or inf anywhere gives inf."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: {tuple(out.shape)} vs reference {tuple(ref.shape)}")
    diff = float((out - ref).norm())
    if not math.isfinite(diff):
        return math.inf
    return diff / max(float(ref.norm()), floor)


def worst(errors: "dict[str, float] | list[float]") -> float:
    """The largest of `errors` where a NaN or inf counts as the largest: Python's max() keeps a NaN
    only when it comes first, so a NaN error listed after a finite one would pass a bound."""
    values = list(errors.values()) if isinstance(errors, dict) else list(errors)
    if not values:
        raise ValueError("no errors to compare: nothing was checked")
    return math.inf if any(not math.isfinite(v) for v in values) else max(values)


def relative_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                    floor: float = 1e-12) -> dict[str, float]:
    """relative_error of every entry, by name: the two must name the same entries, and an entry
    whose reference is exactly zero is compared too (any non-zero value of ours there is
    ||out|| / floor, far above a tolerance)."""
    if got.keys() != want.keys():
        raise ValueError(f"entries differ: only ours {sorted(got.keys() - want.keys())}, "
                         f"only the reference's {sorted(want.keys() - got.keys())}")
    return {name: relative_error(got[name], want[name], floor) for name in want}


@dataclass
class CaseResult:
    errors: dict[str, float]
    limits: dict[str, float]

    def failures(self) -> list[str]:
        return [
            f"{name}: {err:.3g} > {self.limits[name]:.3g}"
            for name, err in self.errors.items()
            if not err <= self.limits[name]
        ]

    @property
    def passed(self) -> bool:
        return not self.failures()


def _terms_summed(problem: Problem, loss_agg: str | None) -> float:
    """How many per-token terms the loss adds up without dividing by their count."""
    if loss_agg == "token-sum":
        return float(problem.mask.sum())
    if loss_agg == "seq-mean-token-sum":
        return float(problem.mask.reshape(-1).sum() if problem.packed else problem.mask.sum(-1).max())
    return 1.0


def run_case(problem: Problem, backend: str, **options) -> CaseResult:
    """Loss, dLoss/dlogits and metrics of `backend` against the float64 reference."""
    base = problem.logits_base.detach().clone().requires_grad_()
    args, kwargs = problem.loss_args(base[problem.view])
    loss, metrics = gspo_loss(*args, **kwargs, backend=backend, **options)
    loss.backward()

    ref_base = problem.logits_base.detach().double().requires_grad_()
    ref_args, ref_kwargs = problem.loss_args(ref_base[problem.view])
    ref_loss, ref_metrics = reference.gspo_loss(*ref_args, **ref_kwargs, **options)
    ref_loss.backward()

    tol = Tolerance.for_dtype(problem.logits_base.dtype, options.get("objective", "clip"))
    errors = {
        # The loss is a signed mean of terms of size |A| ~ 1, each through an exp of fp32
        # log-probs (ulp ~1e-6 at logp ~ -10): it is known to ~1e-7 absolute, and a loss that
        # cancels to near zero is held to 1e-6 absolute rather than to 1e-5 of itself. A sum
        # over tokens (token-sum, seq-mean-token-sum) adds that much per token it sums.
        "loss": relative_error(loss, ref_loss, floor=0.1 * _terms_summed(problem, options.get("loss_agg"))),
        "grad": relative_error(base.grad, ref_base.grad),
    }
    limits = {"loss": tol.loss, "grad": tol.grad}
    for name, ref_value in ref_metrics.items():
        if name not in metrics:
            errors[name], limits[name] = math.inf, 0.0
            continue
        if name in _COUNT_METRICS:
            errors[name] = float((metrics[name].double().cpu() - ref_value.cpu()).abs())
            limits[name] = tol.counts
        else:
            # A KL estimate is a signed mean of log-prob differences, known only to the fp32
            # log-probs' absolute precision (~1e-6): below 0.1 it is held to that, not to 1e-5 of itself.
            floor = 0.1 if name == "kl" else 1e-6
            errors[name] = relative_error(metrics[name], ref_value, floor=floor)
            limits[name] = tol.stats
    return CaseResult(errors=errors, limits=limits)


# Worst absolute error of a log-prob or entropy against float64 that `check` accepts: float32
# statistics of V ~ 1e4 logits land at 1-2e-6 (the torch backend's own level).
STATS_LIMIT = 3e-6

# Rows of several kernel blocks (the CPU kernel's block is 4096 logits), so that a row's max
# can sit in any block, as it does in real logits.
_STATS_PROBE_VOCAB = 3 * 4096 + 100


def stats_probe_logits(rows: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    """Logits that stress the token statistics: half Gaussian rows (std 4), half peaked rows
    (std 2.5 plus one token 5-15 above, as an LLM's sampled distribution), the peak anywhere."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, _STATS_PROBE_VOCAB, generator=gen) * 4.0
    peaked = torch.arange(rows) % 2 == 1
    x[peaked] *= 2.5 / 4.0
    top = torch.randint(0, _STATS_PROBE_VOCAB, (rows,), generator=gen)
    x[peaked, top[peaked]] += 5.0 + 10.0 * torch.rand(int(peaked.sum()), generator=gen)
    return x.to(dtype).to(device)


def token_stats_errors(backend: str, dtype: torch.dtype, device: str, rows: int = 64, seed: int = 0):
    """Largest absolute error of `backend`'s log-probs and entropies against float64, on
    stats_probe_logits. Returns (logp_error, entropy_error); NaN anywhere gives inf."""
    logits = stats_probe_logits(rows, dtype, device, seed)
    targets = torch.randint(0, logits.shape[-1], (rows,), generator=torch.Generator().manual_seed(seed + 1))
    logp, entropy = selective_log_softmax(logits, targets.to(device), return_entropy=True, backend=backend)
    log_probs = torch.log_softmax(logits.double().cpu(), dim=-1)
    ref_logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_entropy = -(log_probs.exp() * log_probs).sum(-1)

    def worst(out, ref):
        err = float((out.double().cpu() - ref).abs().max())
        return err if math.isfinite(err) else math.inf

    return worst(logp, ref_logp), worst(entropy, ref_entropy)


def linear_operands(problem: Problem, hidden_size: int = 24, seed: int = 0):
    """(hidden, weight, bias) for fused-linear checks, laid out like the problem's logits:
    `(B, T, H)` padded or `(N, H)` packed, weight `(V, H)`, bias `(V,)`, in its dtype."""
    gen = torch.Generator().manual_seed(seed)
    rows = tuple(problem.logits.shape[:-1])
    vocab = problem.logits.shape[-1]
    dtype, device = problem.logits.dtype, problem.logits.device
    tensors = (torch.randn(*rows, hidden_size, generator=gen) * 0.6, torch.randn(vocab, hidden_size, generator=gen) * 0.6,
               torch.randn(vocab, generator=gen) * 0.2)
    return [t.to(dtype).to(device) for t in tensors]


def _cpu_bf16_logits(weight: torch.Tensor) -> bool:
    from ..linear.products import Operands
    return Operands(weight[:1], None).cpu_bf16


def _bf16_product(hidden, weight, bias):
    """hidden @ weight.T + bias as a CPU's bf16 product rounds it: once, bias included."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    z = rows @ weight.t() if bias is None else torch.addmm(bias, rows, weight.t())
    return z.reshape(*hidden.shape[:-1], weight.shape[0])


def run_linear_case(problem: Problem, backend: str, operands, chunk_size=5, weight_grad_fp32=None, fused=False,
                    grad_filter_eps=0.0, batch_invariant=False, **options) -> CaseResult:
    """fused_linear_gspo_loss of `backend` (the Triton tile kernels with fused=True) against the
    materialized float64 reference (hidden @ weight.T + bias in float64, then
    reference.gspo_loss; where a CPU's bf16 products make the path's logits, those bf16 values
    with the exact product's gradient): the loss, the token log-probs, and the gradients of
    hidden, weight and bias. `operands` may hold bias None."""
    args, kwargs = problem.loss_args()
    kwargs.pop("temperature")
    kwargs.pop("logit_scale", None)
    kwargs.pop("logit_softcap", None)
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in operands]
    loss, metrics = fused_linear_gspo_loss(leaves[0], leaves[1], *args[1:], bias=leaves[2], chunk_size=chunk_size,
                                           weight_grad_fp32=weight_grad_fp32, fused=fused,
                                           grad_filter_eps=grad_filter_eps, batch_invariant=batch_invariant,
                                           backend=backend, **kwargs, **options)
    loss.backward()
    refs = [None if t is None else t.detach().double().cpu().requires_grad_() for t in operands]
    logits = refs[0] @ refs[1].t() + (0 if refs[2] is None else refs[2])
    if not fused and _cpu_bf16_logits(operands[1]):
        # The path's logits are the CPU's bf16 products (docs/fused_linear.md, "Precision"): the
        # reference takes those values, with the exact product's gradient.
        logits = _bf16_product(*operands).double() + (logits - logits.detach())
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    ref_loss, ref_metrics = reference.gspo_loss(logits, *[a.cpu() for a in args[1:]], **cpu, **options)
    ref_loss.backward()
    tol = Tolerance.for_dtype(operands[0].dtype)
    errors = {"loss": relative_error(loss, ref_loss, floor=0.1 * _terms_summed(problem, options.get("loss_agg"))),
              "token_logprobs": relative_error(metrics["token_logprobs"], ref_metrics["token_logprobs"], floor=1e-6)}
    limits = {"loss": tol.loss, "token_logprobs": tol.stats}
    for name, leaf, ref in zip(("grad_hidden", "grad_weight", "grad_bias"), leaves, refs):
        if leaf is not None:
            errors[name], limits[name] = relative_error(leaf.grad, ref.grad), tol.grad
    return CaseResult(errors=errors, limits=limits)


def run_group_of_one(problem: Problem, backend: str, group, operands=None) -> CaseResult:
    """The distributed code paths on a process group of one rank (tp_group and cp_group both
    set; the fused-linear form too when `operands` are given) against the same backend with
    no group: the collectives then add nothing, so the results must agree to rounding. The
    GPU script runs this on NCCL, the tests on gloo."""
    args, kwargs = problem.loss_args()
    errors, limits = {}, {}

    def both(run, limit=1e-6):
        plain, split = run({}), run({"tp_group": group, "cp_group": group})
        for name in plain:
            errors[name] = relative_error(split[name], plain[name], floor=1e-6)
            limits[name] = limit

    def logits_path(groups):
        logits = args[0].detach().clone().requires_grad_()
        loss, metrics = gspo_loss(logits, *args[1:], backend=backend, **kwargs, **groups)
        loss.backward()
        return {"loss": loss, "token_logprobs": metrics["token_logprobs"], "grad_logits": logits.grad}

    both(logits_path)
    if operands is not None:
        def linear_path(groups):
            leaves = [t.detach().clone().requires_grad_() for t in operands]
            kw = {k: v for k, v in kwargs.items() if k != "temperature"}
            loss, _ = fused_linear_gspo_loss(leaves[0], leaves[1], *args[1:], bias=leaves[2], chunk_size=7,
                                             backend=backend, **kw, **groups)
            loss.backward()
            return {f"linear_{n}": t for n, t in zip(("loss", "grad_hidden", "grad_weight"),
                                                     (loss, leaves[0].grad, leaves[1].grad))}
        # Under a tensor-parallel group the hidden gradient stays float32 until the sum over ranks
        # and is cast once; without one the product is written in the hidden dtype. In bf16/fp16
        # the two may differ by one rounding of that dtype (on an H200: 1.7e-5 relative, bf16 padded).
        low = operands[0].dtype in (torch.bfloat16, torch.float16)
        both(linear_path, torch.finfo(operands[0].dtype).eps if low else 1e-6)
    return CaseResult(errors=errors, limits=limits)
