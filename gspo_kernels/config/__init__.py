"""The options of every entry point: frozen dataclasses, each validated once when it is built.

GSPOConfig holds the loss options (stage 2, and the temperature and backend of stages 1 and 3);
LinearConfig how the fused-linear path runs. `resolve_config` is the one place that turns an
entry point's "config=... or **options" into a validated object.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields

from .logit_map import LogitMap
from .values import (check_bool, check_choice, check_logit_scale, check_logit_softcap, check_optional_real,
                     check_real, check_sampling, check_temperature)

LEVELS = ("sequence", "sequence_token", "token")
LOSS_AGGS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")
OBJECTIVES = ("clip", "cispo", "sapo", "gmpo", "vespo")
ROLLOUT_CORRECTIONS = (None, "token-truncate", "token-mask", "sequence-truncate", "sequence-mask")
ROLLOUT_SEQUENCE_WEIGHTS = ("geometric-mean", "product")
# Levels each objective is defined at. CISPO's ratio is a detached weight, so "sequence_token"
# (value s_i, gradient through each token) would be "sequence" again; GMPO is a geometric mean
# over the sequence by definition. VESPO's weight is always the sequence's product ratio
# whatever the level, so the level only picks the ratio that use_bias_correction_kl multiplies
# the KL by: each token's at "token" (TRL's default importance_sampling_level), s_i at "sequence".
OBJECTIVE_LEVELS = {
    "clip": LEVELS,
    "sapo": LEVELS,
    "cispo": ("sequence", "token"),
    "gmpo": ("sequence",),
    "vespo": ("sequence", "token"),
}
# VESPO's gamma weight phi(w) = exp(lambda + k log w - lambda w), (k, lambda) by the sign of A:
# TRL's defaults.
VESPO_DEFAULTS = {"vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0}
KL_ESTIMATORS = ("k1", "k2", "k3")
BACKENDS = ("auto", "triton", "torch", "cpu", "cuda")
# Gradient filtering (LinearConfig.fused) is off unless asked for: what it drops is bounded
# (docs/fused_linear.md, "Gradient filtering"), what it saves is unmeasured (docs/performance.md,
# "Unmeasured").
DEFAULT_FILTER_EPS = 0.0


def check_backend(value) -> str:
    check_choice("backend", value, BACKENDS)
    return value


class _NamedOptions:
    """Base of the option dataclasses: a keyword that is no option is refused with the nearest
    valid name and the list of them (_raise_unknown), where Python's own error names neither.
    The valid names are module constants: torch.compile cannot trace dataclasses.fields."""

    __slots__ = ()

    def __new__(cls, *args, **kwargs):
        valid = _OPTION_NAMES.get(cls)
        if kwargs and valid is not None:
            unknown = [name for name in kwargs if name not in valid]
            if unknown:
                _raise_unknown(cls, unknown, valid)
        return super().__new__(cls)


@dataclass(frozen=True)
class GSPOConfig(_NamedOptions):
    """Options of the GSPO loss. docs/semantics.md says what each one does.

    Floats stay Python floats: the kernels take them as runtime arguments, so a new value
    never triggers a recompile.
    """

    level: str = "sequence"
    eps_low: float = 3e-4
    eps_high: float = 4e-4
    temperature: float = 1.0
    logit_scale: float = 1.0  # the model's multiplier on its logits, applied before the temperature
    logit_softcap: float | None = None  # the model's soft-cap c: logits -> c * tanh(logits / c)
    # The sampler's truncation (vLLM's min-p, then top-k, then top-p): log-probs of the kept set.
    sampling_top_k: int | None = None
    sampling_top_p: float | None = None
    sampling_min_p: float | None = None
    loss_agg: str = "seq-mean-token-mean"
    max_len: int | None = None
    beta: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    backend: str = "auto"
    inplace: bool = False
    # The policy-loss family (docs/semantics.md, "Objectives and corrections"): all stage 2.
    objective: str = "clip"
    delta: float | None = None  # two-sided clip (TRL): cap on the unclipped ratio
    clip_ratio_c: float | None = None  # dual clip (verl): loss <= -A * c for A < 0
    sapo_tau_pos: float = 1.0  # SAPO gate temperatures (TRL's defaults)
    sapo_tau_neg: float = 1.05
    vespo_k_pos: float = 2.0  # VESPO's gamma weight (objective="vespo"), TRL's defaults
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    rollout_correction: str | None = None  # how rollout_logprobs correct the policy term
    rollout_is_min: float | None = None
    rollout_is_max: float | None = 2.0  # verl's default threshold (TRL's: 3.0)
    rollout_sequence_weight: str = "geometric-mean"  # or "product", as TRL and verl
    top_entropy_quantile: float = 1.0  # keep tokens whose entropy is in the top fraction
    off_policy_mask_threshold: float | None = None  # drop A < 0 sequences this far off-policy
    use_bias_correction_kl: bool = False  # KL term times the importance ratio (TRL)
    kl_clamp: float | None = None  # per-token KL clamped to [-c, c] (verl: 10)
    log_ratio_clamp: tuple = (-20.0, 20.0)  # bounds of every log-ratio before exp; None = open

    def __post_init__(self) -> None:
        check_choice("level", self.level, LEVELS)
        check_choice("loss_agg", self.loss_agg, LOSS_AGGS)
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        check_backend(self.backend)
        for name in ("eps_low", "eps_high", "beta", "entropy_coef"):
            object.__setattr__(self, name, check_real(name, getattr(self, name)))
        object.__setattr__(self, "temperature", check_temperature(self.temperature))
        object.__setattr__(self, "logit_scale", check_logit_scale(self.logit_scale))
        object.__setattr__(self, "logit_softcap", check_logit_softcap(self.logit_softcap))
        check_sampling(self.sampling_top_k, self.sampling_top_p, self.sampling_min_p)
        if not 0.0 <= self.eps_low < 1.0:
            raise ValueError(f"eps_low must be in [0, 1) so that 1 - eps_low > 0; got {self.eps_low}")
        if self.eps_high < 0.0:
            raise ValueError(f"eps_high must be >= 0; got {self.eps_high}")
        if self.beta < 0.0:
            raise ValueError(f"beta (KL coefficient) must be >= 0; got {self.beta}")
        if self.max_len is not None and (
            isinstance(self.max_len, bool) or not isinstance(self.max_len, int) or self.max_len <= 0
        ):
            raise ValueError(f"max_len must be a positive int or None; got {self.max_len!r}")
        check_bool("inplace", self.inplace)
        self._check_family()

    @property
    def logit_map(self) -> LogitMap:
        """The kernels' map of temperature, logit_scale and logit_softcap (a ratio outside float
        range is refused when a call asks for it)."""
        return LogitMap.of(self.temperature, self.logit_scale, self.logit_softcap)

    def _check_family(self) -> None:
        check_choice("objective", self.objective, OBJECTIVES)
        if self.level not in OBJECTIVE_LEVELS[self.objective]:
            raise ValueError(
                f"objective={self.objective!r} is defined at level "
                f"{' or '.join(map(repr, OBJECTIVE_LEVELS[self.objective]))}; got level={self.level!r}"
            )
        if self.rollout_correction not in ROLLOUT_CORRECTIONS:
            raise ValueError(f"rollout_correction must be one of {ROLLOUT_CORRECTIONS}; got {self.rollout_correction!r}")
        for name in ("delta", "clip_ratio_c", "rollout_is_min", "rollout_is_max", "off_policy_mask_threshold",
                     "kl_clamp"):
            object.__setattr__(self, name, check_optional_real(name, getattr(self, name)))
        for name in ("sapo_tau_pos", "sapo_tau_neg", "top_entropy_quantile", *VESPO_DEFAULTS):
            object.__setattr__(self, name, check_real(name, getattr(self, name)))
        if (self.delta is not None or self.clip_ratio_c is not None) and self.objective != "clip":
            raise ValueError("delta and clip_ratio_c shape the clipped objective; they need objective='clip'")
        if self.delta is not None and not self.delta > 1.0 + self.eps_high:
            raise ValueError(f"delta caps the unclipped ratio and must exceed 1 + eps_high; got {self.delta}")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1.0:
            raise ValueError(f"clip_ratio_c (dual clip) must be > 1; got {self.clip_ratio_c}")
        if self.sapo_tau_pos <= 0 or self.sapo_tau_neg <= 0:
            raise ValueError("sapo_tau_pos and sapo_tau_neg must be > 0")
        if not 0.0 < self.top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile must be in (0, 1]; got {self.top_entropy_quantile}")
        check_choice("rollout_sequence_weight", self.rollout_sequence_weight, ROLLOUT_SEQUENCE_WEIGHTS)
        low, high = self.rollout_is_min, self.rollout_is_max
        if self.rollout_correction is not None and low is None and high is None:
            raise ValueError("rollout_correction needs rollout_is_max and/or rollout_is_min")
        # Options that would be read by nothing: refused rather than silently ignored.
        if self.rollout_correction is None and low is not None:
            raise ValueError("rollout_is_min bounds the rollout_correction weights; set rollout_correction")
        if self.objective != "sapo" and (self.sapo_tau_pos, self.sapo_tau_neg) != (1.0, 1.05):
            raise ValueError("sapo_tau_pos and sapo_tau_neg shape objective='sapo' only")
        if self.objective != "vespo" and any(getattr(self, n) != v for n, v in VESPO_DEFAULTS.items()):
            raise ValueError("vespo_k_pos, vespo_lambda_pos, vespo_k_neg and vespo_lambda_neg shape objective='vespo' only")
        if self.vespo_lambda_pos <= 0 or self.vespo_lambda_neg <= 0:
            raise ValueError("vespo_lambda_pos and vespo_lambda_neg must be > 0")
        if (low is not None and low < 0) or (high is not None and high <= 0) or (
                low is not None and high is not None and low >= high):
            raise ValueError(f"need 0 <= rollout_is_min < rollout_is_max; got {low}, {high}")
        if self.kl_clamp is not None and self.kl_clamp <= 0:
            raise ValueError(f"kl_clamp must be > 0; got {self.kl_clamp}")
        if not isinstance(self.use_bias_correction_kl, bool):
            raise TypeError("use_bias_correction_kl must be a bool")
        clamp = self.log_ratio_clamp
        if not isinstance(clamp, (tuple, list)) or len(clamp) != 2:
            raise ValueError(f"log_ratio_clamp must be a (low, high) pair, None for an open side; got {clamp!r}")
        low, high = (check_optional_real("log_ratio_clamp", v) for v in clamp)
        if low is not None and high is not None and not low < high:
            raise ValueError(f"log_ratio_clamp needs low < high; got {clamp!r}")
        object.__setattr__(self, "log_ratio_clamp", (low, high))


SCHEDULES = ("auto", "one_pass", "two_pass")


@dataclass(frozen=True)
class LinearConfig(_NamedOptions):
    """How fused_linear_gspo_loss and fused_linear_selective_log_softmax run (docs/fused_linear.md).

    chunk_size: rows of float32 logits formed at a time (None: a memory budget decides).
    weight_grad_fp32: accumulate `d weight` in float32 (False: in the weight's dtype, one
    rounding per chunk; None: float32 unless the products are rounded to bf16 already, as a CPU's
    native bf16 products are: docs/fused_linear.md, "Precision").
    reduce_hidden_grad: with tp_group, sum `d hidden` over the group (False for a framework whose
    own layer all-reduces the input gradient, as Megatron's does).
    fused: the Triton tile kernels, logits only in on-chip tiles.
    grad_filter_eps: with fused, skip the backward products of tiles whose rows each hold less
    probability mass than this (0: never).
    batch_invariant: each row's log-prob, entropy and `d hidden` row bitwise independent of the
    other rows (their number, order, layout) and of chunk_size; loss, `d weight` and `d bias`
    bitwise the same from run to run (docs/fused_linear.md, "Batch invariance").
    schedule: "auto", "one_pass" or "two_pass" (docs/fused_linear.md, "Schedules"): the loss's
    gradient formed in forward while each group of whole sequences' logits are at hand (one
    pass: 6NVH), or the logits formed again in backward (two passes: 8NVH); "auto" takes one
    pass wherever the loss allows it, "one_pass" refuses a call where it does not.
    """

    chunk_size: int | None = None
    weight_grad_fp32: bool | None = None
    reduce_hidden_grad: bool = True
    fused: bool = False
    grad_filter_eps: float = DEFAULT_FILTER_EPS
    batch_invariant: bool = False
    schedule: str = "auto"

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(map(repr, SCHEDULES))}; got {self.schedule!r}")
        size = self.chunk_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size <= 0):
            raise ValueError(f"chunk_size must be a positive int or None; got {size!r}")
        for name in ("reduce_hidden_grad", "fused", "batch_invariant"):
            check_bool(name, getattr(self, name))
        if self.weight_grad_fp32 is not None:
            check_bool("weight_grad_fp32", self.weight_grad_fp32)
        eps = self.grad_filter_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < 1:
            raise ValueError(f"grad_filter_eps must be a probability in [0, 1) (0: no filtering); got {eps!r}")
        object.__setattr__(self, "grad_filter_eps", float(eps))
        if eps > 0 and not self.fused:
            # Only the tile kernels skip tiles; the chunked path would silently ignore it.
            raise ValueError(f"grad_filter_eps={eps!r} filters the fused tile kernels' backward: pass fused=True "
                             "with it (the chunked path, fused=False, has no tiles to skip)")
        if self.batch_invariant and eps > 0:
            # A tile is skipped by what all its rows hold: a row's gradient would follow its neighbours.
            raise ValueError("grad_filter_eps > 0 skips tiles by the mass of all their rows, which is not "
                             "batch-invariant: use it without batch_invariant=True")


LINEAR_OPTIONS = frozenset(f.name for f in fields(LinearConfig))
_OPTION_NAMES = {kind: tuple(f.name for f in fields(kind)) for kind in (GSPOConfig, LinearConfig)}


# The trainers' names for our options, for the error on an unknown keyword (TRL's GRPOConfig,
# verl's actor config; docs/trainers.md maps the rest).
TRAINER_NAMES = {"epsilon": "eps_low", "epsilon_low": "eps_low", "epsilon_high": "eps_high",
                 "clip_ratio": "eps_low and eps_high", "clip_ratio_low": "eps_low", "clip_ratio_high": "eps_high",
                 "importance_sampling_level": "level", "loss_agg_mode": "loss_agg",
                 "loss_type": "objective (and loss_agg)", "entropy_coeff": "entropy_coef",
                 "sapo_temperature_pos": "sapo_tau_pos", "sapo_temperature_neg": "sapo_tau_neg",
                 "tau_pos": "sapo_tau_pos", "tau_neg": "sapo_tau_neg", "top_k": "sampling_top_k",
                 "top_p": "sampling_top_p", "min_p": "sampling_min_p",
                 "final_logit_softcapping": "logit_softcap"}


def _raise_unknown(kind: type, unknown: list, valid: tuple) -> None:
    hints = []
    for name in unknown:
        if name in TRAINER_NAMES:
            hints.append(f"{name!r}: ours is {TRAINER_NAMES[name]}")
        elif near := difflib.get_close_matches(name, valid, n=1):
            hints.append(f"{name!r}: did you mean {near[0]!r}?")
        elif kind is not LinearConfig and (near := difflib.get_close_matches(name, sorted(LINEAR_OPTIONS), n=1)):
            hints.append(f"{name!r}: did you mean {near[0]!r} (a LinearConfig option: the fused-linear entry "
                         "points only)?")
        else:
            hints.append(repr(name))
    raise TypeError(f"unknown {kind.__name__} option(s) {'; '.join(hints)} (valid: {', '.join(valid)})")


def resolve_config(config, options: dict, kind: type = GSPOConfig, argument: str = "config"):
    """`config` when given (then no keyword options may come with it), else kind(**options).
    argument: the entry point's name for `config`, for the errors."""
    if config is None:
        return kind(**options)  # an unknown option is refused by name there (_NamedOptions)
    if not isinstance(config, kind):
        raise TypeError(f"{argument} must be a {kind.__name__}; got {type(config).__name__}")
    if options:
        raise TypeError(f"pass {kind.__name__} options either as {argument}= or as keywords, not both; got "
                        f"{argument}= and {sorted(options)}")
    return config


def split_linear_options(linear, options: dict) -> tuple[LinearConfig, dict]:
    """(the LinearConfig, the other options) from an entry point's keywords: the fields of
    LinearConfig go to it (or must be absent when `linear` is given), the rest are left."""
    mine = {name: options[name] for name in options if name in LINEAR_OPTIONS}
    rest = {name: value for name, value in options.items() if name not in LINEAR_OPTIONS}
    return resolve_config(linear, mine, LinearConfig, "linear"), rest
