"""Fused-linear benchmark problems and contenders: the loss from hidden states `(N, H)` and
the lm_head weight `(V, H)`, sequence-level GSPO, every row in the response.

Contenders:
    eager         lm_head matmul, log_softmax(float) + gather, the GSPO formula
    eager_native  the same with the lm_head matmul in the inputs' dtype, as a trainer writes it
                  (CPU with native bf16 only: AVX512-BF16 or AMX; a GPU's eager is this already)
    materialized  the trainer's own path, every ratio's base: the lm_head matmul in the inputs'
                  dtype (float32 on a CPU without native bf16), then gspo_loss on the logits
    materialized_fp32  the same with the matmul in float32 (CPU with native bf16 only)
    compile       torch.compile of eager
    liger         Liger-Kernel's LigerFusedLinearGRPOLoss (sequence level), when installed
    cce           Cut Cross Entropy's linear_cross_entropy as log-probs, the GSPO formula (GPU)
    fused         gk.fused_linear_gspo_loss (chunked; default chunk rule and schedule: one pass here)
    fused_two_pass  the same with schedule='two_pass' (the logits formed again in backward)
    fused_tiles   the same with fused=True: the Triton tile kernels (GPU)
    fused_invariant        fused with batch_invariant=True (fixed product shapes, docs/fused_linear.md)
    fused_tiles_invariant  fused_tiles with batch_invariant=True: no atomics (GPU)
    kept_64, kept_512  fused over the engine's kept sets (kept_sets.py)

On a CPU without native bf16 every contender multiplies in float32 (bf16 matmuls run 10-80x
slower there): the matmul-first contenders upcast inside their step (the copies count as their
memory). Where the CPU multiplies bf16 natively, materialized, eager_native and fused multiply
the bf16 operands as a trainer's lm_head does, and eager, compile and materialized_fp32 keep
float32. Liger, which multiplies in its inputs' dtype, gets float32 hidden states and weight on
a CPU. On a GPU every contender multiplies in the inputs' dtype, as a trainer does.

FLOPS gives each contender's FLOPs in units of NVH: 6 for one lm_head product forward and two
backward, 8 where backward forms the logits again (6NkH over the kept sets).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..linear import fused_linear_gspo_loss
from ..linear.products import cpu_has_native_bf16
from ..loss import gspo_loss
from .kept_sets import KEPT_SIZES, kept_flops, kept_loss
from .memory import cpu_peak_bytes, gpu_peak_bytes
from .problem import EPS_HIGH, EPS_LOW, parse_dims
from .providers import Provider, Step, _always, compiled_for_timing, gspo_from_logprobs, requires
from .report import huge_pages, timing_cells
from .runner import Measurement, measure
from .table import format_table
from .timing import MODES

SEQ_LEN = 512  # rows per sequence; N must be a multiple (or smaller)


@dataclass(frozen=True)
class LinearShape:
    tokens: int
    hidden: int
    vocab: int
    seq_len: int = SEQ_LEN  # rows per sequence (all N rows one sequence when N is smaller)

    def __str__(self) -> str:
        base = f"{self.tokens}x{self.hidden}x{self.vocab}"
        return base if self.seq_len == SEQ_LEN else f"{base}/{self.seq_len}"

    @staticmethod
    def parse(text: str) -> "LinearShape":
        """"NxHxV", or "NxHxV/T" for sequences of T rows (default 512)."""
        dims, _, seq = text.partition("/")
        shape = LinearShape(*parse_dims(dims, "a fused-linear shape is NxHxV or NxHxV/T (T rows a sequence), e.g. "
                                              "2048x512x32768 or 16384x4096x151936/1024"))
        if seq:
            if not seq.strip().isdigit() or int(seq) <= 0:
                raise ValueError(f"the sequence length after '/' must be a positive integer; got {text!r}")
            shape = LinearShape(shape.tokens, shape.hidden, shape.vocab, int(seq))
        return shape

    @property
    def flops(self) -> int:
        """The materialized floor: 6NVH (one matmul forward, two backward)."""
        return 6 * self.tokens * self.vocab * self.hidden


@dataclass
class LinearProblem:
    shape: LinearShape
    dtype: torch.dtype
    hidden: torch.Tensor  # (B, T, H)
    weight: torch.Tensor  # (V, H)
    target_ids: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor


def make_linear_problem(shape: LinearShape, dtype: torch.dtype, device: str, seed: int = 0) -> LinearProblem:
    """Old log-probs within ~1e-3 of the current ones, so every row gets a gradient."""
    gen = torch.Generator(device=device).manual_seed(seed)
    seq = min(shape.tokens, shape.seq_len)
    if shape.tokens % seq:
        raise ValueError(f"N = {shape.tokens} must be a multiple of the sequence length {shape.seq_len} (or smaller)")
    batch = shape.tokens // seq
    hidden = (torch.randn(batch, seq, shape.hidden, generator=gen, device=device) * 0.5).to(dtype)
    weight = (torch.randn(shape.vocab, shape.hidden, generator=gen, device=device) * 0.05).to(dtype)
    targets = torch.randint(0, shape.vocab, (batch, seq), generator=gen, device=device)
    with torch.no_grad():
        w = weight.float()
        logp = torch.stack([torch.log_softmax(hidden[i].float() @ w.t(), -1).gather(-1, targets[i, :, None])[:, 0]
                            for i in range(batch)])
        del w
    old = logp + 1e-3 * torch.randn(batch, seq, generator=gen, device=device)
    adv = torch.randn(batch, generator=gen, device=device)
    mask = torch.ones(batch, seq, dtype=torch.bool, device=device)
    return LinearProblem(shape, dtype, hidden, weight, targets, old, adv, mask)


def _matmul(h, w):
    # A CPU multiplies bf16 10-80x slower than fp32: there every contender works in fp32.
    if h.device.type == "cpu" and h.dtype != torch.float32:
        h, w = h.float(), w.float()
    return h @ w.t()


def _eager(h, w, p, logits=None):
    logits = _matmul(h, w) if logits is None else logits
    logp = torch.log_softmax(logits.float(), -1).gather(-1, p.target_ids.unsqueeze(-1)).squeeze(-1)
    return gspo_from_logprobs(logp, p.old_logprobs, p.advantages, p.mask)


def _eager_native(h, w, p):
    return _eager(h, w, p, logits=h @ w.t())


def _native_bf16_cpu(device: str) -> str | None:
    if device != "cpu":
        return "the same as eager on a GPU (its matmul is in the inputs' dtype there)"
    if not cpu_has_native_bf16():
        return "this CPU has no native bf16 (AVX512-BF16 or AMX): its bf16 matmuls run 10-80x slower"
    return None


def _fp32_differs(device: str) -> str | None:
    # Elsewhere materialized multiplies in float32 already (a CPU without native bf16), or a
    # trainer would not (a GPU).
    if device != "cpu":
        return "a GPU's lm_head multiplies in the inputs' dtype: materialized is the trainer's path there"
    if not cpu_has_native_bf16():
        return "materialized multiplies in float32 already on a CPU without native bf16"
    return None


@functools.lru_cache(maxsize=None)
def _compiled_eager():
    return compiled_for_timing(_eager)


def _native_matmul(h, w):
    """The lm_head product as a trainer runs it: in the inputs' dtype where the device multiplies
    it natively (a GPU; a CPU with AVX512-BF16 or AMX), else in float32."""
    if h.device.type == "cpu" and h.dtype == torch.bfloat16 and cpu_has_native_bf16():
        return h @ w.t()
    return _matmul(h, w)


def _materialized(h, w, p):
    return gspo_loss(_native_matmul(h, w), p.target_ids, p.old_logprobs, p.advantages, mask=p.mask, eps_low=EPS_LOW,
                     eps_high=EPS_HIGH)[0]


def _materialized_fp32(h, w, p):
    return gspo_loss(_matmul(h, w), p.target_ids, p.old_logprobs, p.advantages, mask=p.mask, eps_low=EPS_LOW,
                     eps_high=EPS_HIGH)[0]


def _fused_with(**linear):
    """gk.fused_linear_gspo_loss with these LinearConfig options (default chunk rule)."""
    def loss(h, w, p):
        return fused_linear_gspo_loss(h, w, p.target_ids, p.old_logprobs, p.advantages, mask=p.mask,
                                      eps_low=EPS_LOW, eps_high=EPS_HIGH, **linear)[0]

    return loss


_fused = _fused_with()
_fused_tiles = _fused_with(fused=True)


def _gpu_only(device: str) -> str | None:
    # Through Triton's interpreter on a CPU it runs, but at numpy speed: not a contender there.
    return None if device == "cuda" else "needs a CUDA GPU (the Triton tile kernels)"


def _liger(h, w, p):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, compiled=False, use_ref_model=False, loss_type="grpo",
                                       importance_sampling_level="sequence", epsilon_low=EPS_LOW,
                                       epsilon_high=EPS_HIGH)
    return loss_fn(h, w, p.target_ids, p.mask.float(), p.advantages, old_per_token_logps=p.old_logprobs)[0]


def _cce(h, w, p):
    from cut_cross_entropy import linear_cross_entropy

    logp = -linear_cross_entropy(h, w, p.target_ids, reduction="none").float()
    return gspo_from_logprobs(logp, p.old_logprobs, p.advantages, p.mask)


def _step(fn, cpu_inputs_fp32: bool = False):
    def build(p: LinearProblem) -> Step:
        h, w = p.hidden.detach(), p.weight.detach()
        if cpu_inputs_fp32 and h.device.type == "cpu":
            h, w = h.float(), w.float()
        h.requires_grad_()
        w.requires_grad_()
        return Step(h, lambda: fn(h, w, p), other_leaves=(w,))

    return build


# Multiply-adds of each contender in units of NVH (the default problem's schedule for fused).
FLOPS_NVH = {"eager": 6, "eager_native": 6, "materialized": 6, "materialized_fp32": 6, "compile": 6, "liger": 6,
             "cce": 8, "fused": 6, "fused_two_pass": 8, "fused_tiles": 8, "fused_invariant": 8,
             "fused_tiles_invariant": 8}

LINEAR_PROVIDERS = {
    p.name: p
    for p in [
        Provider("eager", _step(_eager), _always),
        Provider("eager_native", _step(_eager_native), _native_bf16_cpu),
        Provider("materialized", _step(_materialized), _always, ours=True),
        Provider("materialized_fp32", _step(_materialized_fp32), _fp32_differs, ours=True),
        Provider("compile", _step(lambda h, w, p: _compiled_eager()(h, w, p)), _always),
        Provider("liger", _step(_liger, cpu_inputs_fp32=True), requires("liger_kernel.chunked_loss", "liger-kernel")),
        Provider("cce", _step(_cce), requires("cut_cross_entropy", "cut-cross-entropy", gpu_only=True)),
        Provider("fused", _step(_fused), _always, ours=True),
        Provider("fused_two_pass", _step(_fused_with(schedule="two_pass")), _always, ours=True),
        Provider("fused_tiles", _step(_fused_tiles), _gpu_only, ours=True),
        Provider("fused_invariant", _step(_fused_with(batch_invariant=True)), _always, ours=True),
        Provider("fused_tiles_invariant", _step(_fused_with(fused=True, batch_invariant=True)), _gpu_only, ours=True),
        *(Provider(name, _step(kept_loss(k)), _always, ours=True) for name, k in KEPT_SIZES.items()),
    ]
}


def measure_linear(cfg, name: str, problem: LinearProblem, progress) -> list:
    """BenchRows of one contender on one fused-linear problem (cfg: a runner.SuiteConfig)."""
    shape = problem.shape
    batch, seq = problem.hidden.shape[:2]
    base = dict(provider=name, batch=batch, seq_len=seq, vocab=shape.vocab, tokens=shape.tokens, dtype=cfg.dtype,
                device=cfg.device, hidden=shape.hidden)

    def peak_bytes(step):
        peak = gpu_peak_bytes(step) if cfg.device == "cuda" else cpu_peak_bytes(name, shape, cfg.dtype, kind="linear")
        # What the contender returns (d hidden, d weight) is not its overhead: report beyond it.
        return peak - sum(t.numel() * t.element_size() for t in (step.leaf, *step.other_leaves))

    return measure(cfg, Measurement(LINEAR_PROVIDERS[name], problem, base, f"{name} {shape}", peak_bytes), progress)


def format_linear(rows, meta) -> str:
    out = []
    for key in dict.fromkeys((r.tokens, r.hidden, r.vocab) for r in rows):
        group = [r for r in rows if (r.tokens, r.hidden, r.vocab) == key]
        shape = LinearShape(*key)
        cell = {(r.provider, r.mode): r for r in group}
        base = cell.get(("materialized", "fwd+bwd"))
        table, skipped = [], []
        for name in dict.fromkeys(r.provider for r in group):
            first = next(r for r in group if r.provider == name)
            if first.status != "ok":
                why = first.note[:80] if first.status == "skipped" else f"{first.status}: {first.note[:80]}"
                skipped.append(f"{name} ({why})")
                continue
            modes, ms, mem, _ = timing_cells(cell, name)
            table.append([
                name,
                kept_flops(name, shape.vocab) if name in KEPT_SIZES else f"{FLOPS_NVH[name]}NVH",
                *modes,
                "-" if not ms else f"{shape.flops / (ms * 1e-3) / 1e9:.0f}",
                "-" if mem is None else f"{mem:.0f}",
                "-" if mem is None or not base or not base.peak_mem_mib else f"{mem / base.peak_mem_mib:.2f}x",
                "-" if not ms or not base or not base.median_ms else f"{ms / base.median_ms:.2f}x",
            ])
        out.append(f"fused linear: N={shape.tokens} in sequences of {group[0].seq_len} rows, H={shape.hidden} "
                   f"V={shape.vocab}, {group[0].dtype}, {group[0].device}")
        out.append(format_table(["provider", "FLOPs", *(f"{m} ms" for m in MODES), "GFLOP/s (6NVH)", "peak MiB",
                                 "memory vs materialized", "time vs materialized"], table))
        if skipped:
            out.append("skipped: " + "; ".join(skipped))
        out.append("")
    out.append(f"{meta.get('device')} | torch {meta.get('torch')} | {meta.get('cpu_threads')} CPU threads"
               f"{huge_pages(meta)} | {meta.get('date')}")
    out.append("peak MiB: memory beyond the inputs and the gradients returned, during one forward + backward. "
               "GFLOP/s: 6NVH (the materialized path's matmuls) / fwd+bwd time, whatever the contender does "
               "(FLOPs). The base of every ratio: materialized, the lm_head in the inputs' dtype where the "
               "device multiplies it natively, then gspo_loss.")
    if meta.get("timing"):
        out.append(meta["timing"] + ".")
    return "\n".join(out)
