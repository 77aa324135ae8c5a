"""TRL 1.16's own loss code as the oracle of the TRL drop-in's option mapping (issue 24, item 5).

A TRLCase is every value test_trl_mapping_fuzz.py draws: TRL's options (GRPOConfig arguments and
the trainer state the loss reads) and a batch recipe (shape, a seed, how off-policy it is, which
optional inputs are present). `build` turns it into float64 tensors with a torch.Generator, and
`check` computes the same step's loss three ways, on the same differentiable leaves (per-token
log-probs and entropies):

- trl: `trl.GRPOTrainer._compute_loss`, called unbound on a `TrainerStandIn` that carries the
  attributes it reads, its `_get_per_token_logps_and_entropies` replaced by a function that
  returns the drawn leaves. TRL's own helpers (get_high_entropy_mask, get_off_policy_mask,
  get_gamma_weights) run as they are: nothing of TRL's loss is re-derived here.
- policy_loss: `gk.policy_loss(logp, old, advantages, mask=, entropy=, ref_logprobs=,
  rollout_logprobs=, normalizer=, entropy_threshold=, config=gspo_config(settings))` with
  settings = `TRLSettings.of(stand-in)` (the drop-in's own reading of a trainer), the normalizer
  from the drop-in's `_trl_normalizer` (options.normalizer), the threshold from its
  `_entropy_threshold` and the entropy bonus from its `_with_entropy_bonus`, each called unbound
  on the stand-in; only the call's argument wiring (which mask, which inputs reach the loss) is
  written here, after the drop-in's _compute_loss.
- drop_in: the drop-in's own `GRPOTrainer._compute_loss`, unbound on the same stand-in, its
  `_gspo_stats` (the fused-linear model pass) replaced by the drawn leaves: the wiring above as
  the drop-in actually does it.

Each loss and its gradients with respect to the log-probs and the entropies must equal TRL's to
1e-6 relative (float64; NaN never passes). Cases within 1e-9 of a kink that TRL and
gspo_kernels might compute on different sides of by rounding alone (a clip bound, delta, cispo's
cap, the off-policy mask's threshold) are reported by `near_kink` and skipped by the test; exact
ties (eps 0 on-policy: a ratio of exactly 1 on a bound, or an off-policy KL of exactly 0 at a
threshold of 0) are kept, both sides must follow autograd there.

Not covered: TRL's vLLM importance-sampling correction (`importance_sampling_ratio` is made in
TRL's generation step, not in _compute_loss), so `vllm_correction` stays False; sampler
log-probs still reach the off-policy mask.

Repro (the line a failing test prints):

    TRITON_INTERPRET=1 .venv/bin/python tests/fuzz/trl_oracle.py "TRLCase(loss_type='vespo', ...)"

prints each path's loss, the errors against TRL, and "passed" or the broken checks (exit 1).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import types
from collections import defaultdict
from dataclasses import dataclass

if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before gspo_kernels defines its Triton kernels
    HERE = os.path.dirname(os.path.abspath(__file__))
    # This checkout's package (not whichever one an editable install points at), then the fuzz's modules.
    sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), HERE]

import torch  # noqa: E402
import trl  # noqa: E402

import gspo_kernels as gk  # noqa: E402
from gspo_kernels.integrations.trl import options  # noqa: E402
from gspo_kernels.integrations.trl.options import TRLSettings  # noqa: E402
from gspo_kernels.integrations.trl.trainer import GRPOTrainer as DropIn  # noqa: E402
from gspo_kernels.testing.verify import relative_error  # noqa: E402

TOL = 1e-6
# Norm below which an error is measured absolutely (TOL * FLOOR): float64 rounding of the loss's
# terms (|term| <= ~10) is ~1e-15, so a loss or gradient that cancels to ~0 is not asked for 1e-6 of itself.
FLOOR = 1e-6
KINK = 1e-9  # relative distance to a kink below which rounding alone may pick the side
# How far old log-probs are from the current ones: "none" is on-policy (no old_per_token_logps in
# the inputs, TRL takes logp.detach()), "equal" passes them equal (a ratio of exactly 1).
OLD_SPREAD = {"none": None, "equal": 0.0, "near": 0.05, "moderate": 0.5, "far": 3.0}
SAMPLING = ("absent", "present", "nan")  # sampler log-probs in the inputs; "nan": some unscorable tokens


@dataclass(frozen=True)
class TRLCase:
    # GRPOConfig arguments / trainer attributes that TRL's _compute_loss reads.
    loss_type: str = "grpo"
    importance_sampling_level: str = "token"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    delta: float | None = None
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    entropy_coef: float = 0.0
    temperature: float = 1.0  # the log-probs are given: no effect on either side
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    max_completion_length: int = 8
    # Where in the step the loss runs (its denominators).
    training: bool = True
    accumulation_steps: int = 1
    steps_per_generation: int = 1
    num_processes: int = 1
    num_items_in_batch: int = 8
    # The batch.
    rows: int = 2
    tokens: int = 4
    seed: int = 0
    old: str = "moderate"  # a key of OLD_SPREAD
    sampling: str = "absent"  # one of SAMPLING
    tool_mask: bool = False
    entropy_ties: bool = False  # entropies from {0.25, 0.5, 1.0}: ties at the quantile
    zero_advantages: bool = False  # some advantages exactly 0

    def repro(self) -> str:
        return f'TRITON_INTERPRET=1 .venv/bin/python tests/fuzz/trl_oracle.py "{self!r}"'


@dataclass
class Batch:
    logp: torch.Tensor  # (B, T) float64 leaf
    entropy: torch.Tensor  # (B, T) float64 leaf
    inputs: dict  # as TRL's _generate_and_score_completions hands them to _compute_loss


def build(case: TRLCase) -> Batch:
    """The case's tensors. Every draw is made whatever the flags, so that a flag changes only
    its own input (hypothesis shrinks one field without reshuffling the rest)."""
    B, T = case.rows, case.tokens
    g = torch.Generator().manual_seed(case.seed)
    f64 = dict(dtype=torch.float64, generator=g)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    tool = (torch.rand(B, T, generator=g) < 0.75).int()
    logp = -(torch.rand(B, T, **f64) * 3.0 + 0.01)
    noise_old = torch.randn(B, T, **f64)
    ref = logp + 0.3 * torch.randn(B, T, **f64)
    noise_sampling = 0.2 * torch.randn(B, T, **f64)
    unscorable = torch.rand(B, T, generator=g) < 0.25
    entropy = torch.rand(B, T, **f64) * 2.0
    tie_values = torch.tensor([0.25, 0.5, 1.0], dtype=torch.float64)[torch.randint(0, 3, (B, T), generator=g)]
    advantages = torch.randn(B, **f64)
    zeros = torch.rand(B, generator=g) < 0.4

    if case.entropy_ties:
        entropy = tie_values
    # TRL's entropy quantile runs in float32: float32-exact entropies keep both sides' thresholds exact.
    entropy = entropy.float().double()
    if case.zero_advantages:
        advantages = torch.where(zeros, torch.zeros_like(advantages), advantages)
    spread = OLD_SPREAD[case.old]
    old = None if spread is None else logp + spread * noise_old
    completion_mask = (torch.arange(T)[None, :] < lengths[:, None]).int()
    inputs = dict(prompt_ids=torch.zeros(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1, dtype=torch.int),
                  completion_ids=torch.zeros(B, T, dtype=torch.long), completion_mask=completion_mask,
                  advantages=advantages, num_items_in_batch=torch.tensor(case.num_items_in_batch))
    if old is not None:
        inputs["old_per_token_logps"] = old
    if case.beta != 0.0:  # TRL computes reference log-probs only with a KL term
        inputs["ref_per_token_logps"] = ref
    if case.sampling != "absent":
        sampling = (logp if old is None else old) + noise_sampling
        if case.sampling == "nan":
            sampling = torch.where(unscorable, torch.full_like(sampling, math.nan), sampling)
        inputs["sampling_per_token_logps"] = sampling
    if case.tool_mask:
        inputs["tool_mask"] = tool
    return Batch(logp.requires_grad_(), entropy.requires_grad_(), inputs)


class _Accelerator:
    """One process: gather, pad and reduce are identities. num_processes only scales TRL's
    num_items_in_batch denominator (the loss reads nothing else of the world)."""

    def __init__(self, num_processes: int) -> None:
        self.num_processes = num_processes
        self.sync_gradients = True

    def gather(self, x):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x

    def reduce(self, x, reduction="sum"):
        return x

    def unwrap_model(self, model):
        return model

    def autocast(self):
        return contextlib.nullcontext()


class TrainerStandIn:
    """The attributes TRL's and the drop-in's _compute_loss read, set as GRPOTrainer.__init__ sets
    them from a GRPOConfig (e.g. epsilon_low = args.epsilon), and their helper methods: TRL's own
    and the drop-in's own, taken from the classes unchanged."""

    get_high_entropy_mask = trl.GRPOTrainer.get_high_entropy_mask
    get_off_policy_mask = staticmethod(trl.GRPOTrainer.get_off_policy_mask)
    get_gamma_weights = staticmethod(trl.GRPOTrainer.get_gamma_weights)
    _gspo_plan = DropIn._gspo_plan
    _gspo_unsupported = DropIn._gspo_unsupported
    _gspo_unsupported_model = DropIn._gspo_unsupported_model
    _trl_config = DropIn._trl_config
    _trl_normalizer = DropIn._trl_normalizer
    _entropy_threshold = DropIn._entropy_threshold
    _with_entropy_bonus = DropIn._with_entropy_bonus

    def __init__(self, case: TRLCase, batch: Batch) -> None:
        self.args = types.SimpleNamespace(
            use_bias_correction_kl=case.use_bias_correction_kl, delta=case.delta,
            sapo_temperature_pos=case.sapo_temperature_pos, sapo_temperature_neg=case.sapo_temperature_neg,
            vespo_k_pos=case.vespo_k_pos, vespo_lambda_pos=case.vespo_lambda_pos, vespo_k_neg=case.vespo_k_neg,
            vespo_lambda_neg=case.vespo_lambda_neg, steps_per_generation=case.steps_per_generation,
            cast_lm_head_to_fp32=False, batch_invariant=False)
        self.loss_type = case.loss_type
        self.importance_sampling_level = case.importance_sampling_level
        self.epsilon_low = case.epsilon_low
        self.epsilon_high = case.epsilon_high
        self.beta = case.beta
        self.temperature = case.temperature
        self.top_entropy_quantile = case.top_entropy_quantile
        self.off_policy_mask_threshold = case.off_policy_mask_threshold
        self.max_completion_length = case.max_completion_length
        self.entropy_coef = case.entropy_coef
        self.use_adaptive_entropy = False
        self._entropy_bonus_enabled = case.entropy_coef != 0.0
        self.aux_loss_enabled = False
        # Sampler log-probs (when drawn) come from vLLM; its importance-sampling correction stays off.
        self.use_vllm = case.sampling != "absent"
        self.vllm_importance_sampling_correction = False
        self.vllm_importance_sampling_mode = "sequence_mask"
        self.vllm_importance_sampling_clip_min = None
        self.vllm_importance_sampling_clip_max = 3.0
        self.current_gradient_accumulation_steps = case.accumulation_steps
        self.model = types.SimpleNamespace(training=case.training, config=types.SimpleNamespace())
        self.accelerator = _Accelerator(case.num_processes)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._gspo_warned: set[str] = set()
        self._gspo_in_fallback = False
        self._batch = batch

    # The model passes, replaced by the drawn differentiable leaves.
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        return self._batch.logp, self._batch.entropy, None

    def _gspo_stats(self, model, input_ids, attention_mask, completion_len, kept_ids=None):
        assert kept_ids is None, "the drawn batches carry no engine kept sets"
        return self._batch.logp, self._batch.entropy

    def _gspo_fallback(self, reason: str) -> None:
        raise AssertionError(f"the drop-in fell back to TRL's code: {reason}")


def settings_of(case: TRLCase, batch: Batch | None = None) -> TRLSettings:
    """The drop-in's reading of a trainer with these options (TRLSettings.of)."""
    return TRLSettings.of(TrainerStandIn(case, batch or build(case)))


def refused(case: TRLCase) -> str | None:
    """Why the drop-in runs TRL's own code for this case instead of gspo_kernels' (then the
    comparison is void), or None."""
    settings = settings_of(case)
    reason = options.unsupported_setting(settings)
    if reason is not None:
        return reason
    try:
        options.gspo_config(settings)
    except ValueError as error:
        return f"gspo_config: {error}"
    return None


def trl_loss(case: TRLCase, batch: Batch) -> torch.Tensor:
    """TRL 1.16's loss: its own _compute_loss."""
    trainer = TrainerStandIn(case, batch)
    return trl.GRPOTrainer._compute_loss(trainer, trainer.model, dict(batch.inputs))


def policy_loss(case: TRLCase, batch: Batch) -> torch.Tensor:
    """gk.policy_loss with gspo_config(TRLSettings.of(trainer)), wired as the drop-in's _compute_loss."""
    trainer = TrainerStandIn(case, batch)
    inputs = batch.inputs
    config = options.gspo_config(TRLSettings.of(trainer))
    mask = inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
    mask = mask != 0
    threshold = (trainer._entropy_threshold(batch.entropy.detach(), mask)
                 if config.top_entropy_quantile < 1.0 else None)
    rollout = (inputs.get("sampling_per_token_logps")
               if config.rollout_correction or config.off_policy_mask_threshold is not None else None)
    loss, _ = gk.policy_loss(
        batch.logp, inputs.get("old_per_token_logps"), inputs["advantages"], mask=mask, entropy=batch.entropy,
        ref_logprobs=inputs.get("ref_per_token_logps") if case.beta != 0.0 else None, rollout_logprobs=rollout,
        normalizer=trainer._trl_normalizer(inputs, mask), entropy_threshold=threshold, config=config)
    if trainer.entropy_coef != 0.0:
        loss = trainer._with_entropy_bonus(loss, batch.entropy, mask, threshold)
    return loss


def drop_in_loss(case: TRLCase, batch: Batch) -> torch.Tensor:
    """The drop-in's own _compute_loss."""
    trainer = TrainerStandIn(case, batch)
    return DropIn._compute_loss(trainer, trainer.model, dict(batch.inputs))


PATHS = {"trl": trl_loss, "policy_loss": policy_loss, "drop_in": drop_in_loss}


def near_kink(case: TRLCase, batch: Batch) -> str | None:
    """A kink within KINK (relative, not exactly on it) of a response token's value, computed as
    TRL does: there float64 rounding alone may put the two sides on different branches."""
    inputs = batch.inputs
    logp = batch.logp.detach()
    mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
    maskf = mask.double()
    old = inputs.get("old_per_token_logps", logp)
    checks = []
    log_ratio = logp - old
    if case.importance_sampling_level == "sequence":
        coef = torch.exp((log_ratio * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0))[:, None].expand_as(logp)
    else:
        coef = torch.exp(log_ratio)
    if case.loss_type == "cispo":
        checks.append(("cispo cap epsilon_high", coef, case.epsilon_high))
    elif case.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        checks += [("1 - epsilon_low", coef, 1 - case.epsilon_low), ("1 + epsilon_high", coef, 1 + case.epsilon_high)]
        if case.delta is not None:
            checks.append(("delta", coef, case.delta))
    if case.off_policy_mask_threshold is not None:
        sampling = inputs.get("sampling_per_token_logps", old)
        kl = torch.nan_to_num(sampling - logp, nan=0.0)
        avg = ((kl * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0))[:, None].expand_as(logp)
        checks.append(("off_policy_mask_threshold", avg, case.off_policy_mask_threshold))
    for name, values, bound in checks:
        gap = (values - bound).abs()
        near = (mask != 0) & (gap > 0) & (gap <= KINK * max(1.0, abs(bound)))
        if near.any():
            return f"{name}={bound!r} at {near.nonzero().tolist()[:3]}"
    return None


def _grads(loss: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    leaves = (batch.logp, batch.entropy)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return tuple(torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads))


def check(case: TRLCase) -> tuple[list[str], dict]:
    """(broken checks, report): each path's loss and gradients against TRL's."""
    batch = build(case)
    results = {}
    for name, fn in PATHS.items():
        loss = fn(case, batch)
        results[name] = (loss.detach(), *_grads(loss, batch))
    ref_loss, ref_dlogp, ref_dent = results["trl"]
    failures, report = [], {"trl loss": float(ref_loss)}
    if not bool(torch.isfinite(ref_loss)):
        failures.append(f"TRL's own loss is {float(ref_loss)} on finite inputs")
    for name in ("policy_loss", "drop_in"):
        loss, dlogp, dent = results[name]
        errors = {"loss": relative_error(loss.reshape(1), ref_loss.reshape(1), floor=FLOOR),
                  "grad logp": relative_error(dlogp, ref_dlogp, floor=FLOOR),
                  "grad entropy": relative_error(dent, ref_dent, floor=FLOOR)}
        report[f"{name} loss"] = float(loss)
        for what, err in errors.items():
            report[f"{name} {what} error"] = err
            if not err <= TOL:  # NaN never passes
                got = float(loss) if what == "loss" else (dlogp if what == "grad logp" else dent).tolist()
                want = float(ref_loss) if what == "loss" else (ref_dlogp if what == "grad logp" else ref_dent).tolist()
                failures.append(f"{name}: {what} relative error {err:.3g} > {TOL:g} against TRL "
                                f"(got {got}, TRL {want})")
    return failures, report


def main(argv) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    case = eval(argv[1], {"TRLCase": TRLCase})  # the repr a failing test printed
    why = refused(case)
    if why is not None:
        print(f"note: the drop-in runs TRL's own code here ({why}); the fuzz skips this case")
    kink = near_kink(case, build(case))
    if kink is not None:
        print(f"note: the fuzz skips this case (near a kink: {kink})")
    print(f"settings: {settings_of(case)}")
    print(f"config: {options.gspo_config(settings_of(case)) if why is None else '-'}")
    failures, report = check(case)
    for key, value in report.items():
        print(f"{key}: {value:.17g}")
    for line in failures:
        print(line)
    print("passed" if not failures else f"{len(failures)} check(s) broken")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

