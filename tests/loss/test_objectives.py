"""The policy-loss family (objectives, clip variants, rollout correction, token selection,
peer options) on every backend against the float64 reference, plus proof that the test
problems take every branch."""


import pytest
import torch

import gspo_kernels as gk
from gspo_kernels.testing import reference
from gspo_kernels.config import LOSS_AGGS, OBJECTIVE_LEVELS, ROLLOUT_CORRECTIONS
from gspo_kernels.testing.problems import ProblemSpec, make_problem
from gspo_kernels.testing.verify import relative_error, run_case

from conftest import BACKENDS, device_for

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OBJECTIVE_CASES = [(o, lvl) for o, levels in OBJECTIVE_LEVELS.items() for lvl in levels]
# Rotated through the grid, so every objective meets every correction somewhere.
CORRECTIONS = [
    {},
    {"rollout_correction": "sequence-mask", "rollout_is_min": 0.4},
    {"rollout_correction": "token-truncate", "top_entropy_quantile": 0.5},
    {"off_policy_mask_threshold": 0.5, "beta": 0.05, "use_bias_correction_kl": True, "kl_clamp": 0.05},
    {"rollout_correction": "token-mask", "rollout_is_min": 0.4, "off_policy_mask_threshold": 0.5},
]


def _problem(backend, seed, packed, dtype=torch.float32, **kw):
    spec = ProblemSpec(dtype=dtype, empty_sequence=True, with_rollout=True, with_ref=True,
                       device=device_for(backend), seed=seed, **kw)
    problem = make_problem(spec)
    return problem.to_packed() if packed else problem


@pytest.mark.triton_pairwise
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
@pytest.mark.parametrize("objective,level", OBJECTIVE_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_objective_matches_reference(backend, objective, level, loss_agg, dtype, packed, seed):
    index = OBJECTIVE_CASES.index((objective, level)) + LOSS_AGGS.index(loss_agg) + DTYPES.index(dtype)
    options = dict(CORRECTIONS[index % len(CORRECTIONS)])
    problem = _problem(backend, seed, packed, dtype)
    if "rollout_correction" not in options and "off_policy_mask_threshold" not in options:
        problem.rollout_logprobs = None
    if objective == "gmpo":
        options.update(eps_low=1.5e-3, eps_high=2.5e-3)  # log-space bounds
    result = run_case(problem, backend, objective=objective, level=level, loss_agg=loss_agg, max_len=9, **options)
    assert result.passed, result.failures()


# The form of the sequence weight matters in the sequence modes only.
ROLLOUT_MODES = [(m, "geometric-mean") for m in ROLLOUT_CORRECTIONS if m] + [
    (m, "product") for m in ROLLOUT_CORRECTIONS if m and m.startswith("sequence")]


@pytest.mark.parametrize("mode,weight", ROLLOUT_MODES)
@pytest.mark.parametrize("level", ["sequence", "token"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_rollout_correction_modes(backend, mode, level, weight, seed):
    problem = _problem(backend, seed, packed=level == "token")
    result = run_case(problem, backend, level=level, rollout_correction=mode, rollout_is_min=0.4, rollout_is_max=2.0,
                      rollout_sequence_weight=weight)
    assert result.passed, result.failures()


@pytest.mark.parametrize(
    "options",
    [
        {"delta": 1.001},
        {"clip_ratio_c": 1.001},
        {"delta": 1.001, "clip_ratio_c": 1.0005},
        {"log_ratio_clamp": (None, 1e-3)},  # verl's GSPO clamps the combined log-ratio from above only
        {"log_ratio_clamp": (None, None)},
        {"top_entropy_quantile": 0.3},
        {"top_entropy_quantile": 0.3, "entropy_threshold": 4.0},
        {"objective": "sapo", "sapo_tau_pos": 2.0, "sapo_tau_neg": 0.5},
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
@pytest.mark.parametrize("level", ["sequence", "sequence_token", "token"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_clip_variants_and_options(backend, level, options, seed):
    options = dict(options)
    threshold = options.pop("entropy_threshold", None)
    problem = _problem(backend, seed, packed=level == "token")
    problem.rollout_logprobs = None
    base = problem.logits_base.detach().clone().requires_grad_()
    args, kwargs = problem.loss_args(base[problem.view])
    if threshold is not None:
        kwargs["entropy_threshold"] = threshold
    result = run_case(problem, backend, level=level, **options) if threshold is None else None
    if result is not None:
        assert result.passed, result.failures()
        return
    loss, _ = gk.gspo_loss(*args, **kwargs, backend=backend, level=level, **options)
    ref_loss, _ = reference.gspo_loss(*problem.loss_args(problem.logits.double())[0],
                                      **{**problem.loss_args()[1], "entropy_threshold": threshold}, level=level,
                                      **options)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * max(abs(ref_loss.item()), 0.1)


def _ref_metrics(problem, **options):
    args, kwargs = problem.loss_args(problem.logits.double())
    return reference.gspo_loss(*args, **kwargs, **options)


def test_problems_take_every_branch(seed):
    """Each correction and variant must both act and not act on the test problems."""
    # 12 sequences: every case of problems.py twice, one copy of the clipped-low case non-empty.
    problem = _problem("torch", seed, packed=False, batch=12)
    for mode in ("token-mask", "sequence-mask"):
        _, m = _ref_metrics(problem, rollout_correction=mode, rollout_is_min=0.4)
        assert 0 < m["rollout_masked_frac"] < 1, mode
    for mode in ("token-truncate", "sequence-truncate"):
        _, m = _ref_metrics(problem, rollout_correction=mode, rollout_is_min=0.4)
        assert m["rollout_is_max"] == 2.0, mode  # some weight truncated at the top
        assert m["rollout_is_mean"] < 2.0
    _, product = _ref_metrics(problem, rollout_correction="sequence-mask", rollout_is_min=0.4,
                              rollout_sequence_weight="product")
    assert 0 < product["rollout_masked_frac"] < 1
    _, m = _ref_metrics(problem, top_entropy_quantile=0.5)
    assert 0 < m["entropy_kept_frac"] < 1
    _, m = _ref_metrics(problem, off_policy_mask_threshold=0.5)
    assert 0 < m["off_policy_masked_frac"] < 1
    no_rollout = _problem("torch", seed, packed=False, batch=12)
    no_rollout.rollout_logprobs = None
    for objective, level in OBJECTIVE_CASES:
        if objective in ("sapo", "vespo"):  # soft weights: they never clip
            continue
        options = {"eps_low": 1.5e-3, "eps_high": 2.5e-3} if objective == "gmpo" else {}
        _, m = _ref_metrics(no_rollout, objective=objective, level=level, **options)
        assert m["clip_frac_low"] > 0 and m["clip_frac_high"] > 0, (objective, level)
        assert m["clip_frac"] < 1
    # The two-sided cap, the dual clip and the one-sided clamp each change the loss.
    plain, _ = _ref_metrics(no_rollout, level="token")
    for options in ({"delta": 1.001}, {"clip_ratio_c": 1.001}, {"log_ratio_clamp": (None, 1e-3)}):
        changed, _ = _ref_metrics(no_rollout, level="token", **options)
        assert abs(changed.item() - plain.item()) > 1e-7, options
    kl_plain, _ = _ref_metrics(no_rollout, beta=0.1)
    kl_clamped, _ = _ref_metrics(no_rollout, beta=0.1, kl_clamp=0.05)
    kl_corrected, _ = _ref_metrics(no_rollout, beta=0.1, use_bias_correction_kl=True)
    assert kl_clamped.item() != kl_plain.item() and kl_corrected.item() != kl_plain.item()


# VESPO's weight is a stop-gradient that moves with the logits (CISPO's is clipped, hence
# constant, on these problems): its gradient is by definition not the value's derivative, so it
# is checked against the float64 reference's autograd (test_objective_matches_reference) instead.
@pytest.mark.parametrize("objective,level", [case for case in OBJECTIVE_CASES if case[0] != "vespo"])
def test_family_gradcheck(objective, level, seed):
    problem = make_problem(ProblemSpec(batch=4, seq_len=5, vocab=6, dtype=torch.float64, with_ref=True,
                                       with_rollout=True, empty_sequence=True, seed=seed))
    args, kwargs = problem.loss_args()
    options = dict(objective=objective, level=level, beta=0.1, use_bias_correction_kl=True,
                   rollout_correction="sequence-truncate", top_entropy_quantile=0.6, off_policy_mask_threshold=0.5)
    if objective == "gmpo":
        options.update(eps_low=1.5e-3, eps_high=2.5e-3)
    if level == "sequence_token":
        # Its stop-gradients make the gradient differ from the value's derivative unless every
        # token of a sequence is weighted alike: no token selection, no token-level KL weight.
        options.update(top_entropy_quantile=1.0, use_bias_correction_kl=False)

    def f(x):
        loss, _ = gk.gspo_loss(x, *args[1:], **kwargs, backend="torch", **options)
        return loss

    x = problem.logits.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(f, (x,), eps=1e-7, atol=1e-7, rtol=1e-4)


def test_bad_family_options():
    problem = make_problem(ProblemSpec(with_rollout=True))
    args, kwargs = problem.loss_args()
    bad = [
        ({"objective": "ppo"}, ValueError, "objective must be one of"),
        ({"objective": "gmpo", "level": "token"}, ValueError, "defined at level 'sequence'"),
        ({"objective": "cispo", "level": "sequence_token"}, ValueError, "defined at level"),
        ({"objective": "sapo", "delta": 2.0}, ValueError, "need objective='clip'"),
        ({"delta": 1.0001}, ValueError, "must exceed 1 \\+ eps_high"),
        ({"clip_ratio_c": 0.9}, ValueError, "must be > 1"),
        ({"rollout_correction": "token"}, ValueError, "rollout_correction must be one of"),
        ({"rollout_correction": "token-mask", "rollout_is_max": None}, ValueError, "needs rollout_is_max"),
        ({"rollout_correction": "token-mask", "rollout_is_min": 3.0}, ValueError, "rollout_is_min < rollout_is_max"),
        ({"top_entropy_quantile": 0.0}, ValueError, "top_entropy_quantile must be in"),
        ({"sapo_tau_neg": 0.0}, ValueError, "must be > 0"),
        ({"kl_clamp": -1.0}, ValueError, "kl_clamp must be > 0"),
        ({"rollout_is_min": 0.5}, ValueError, "set rollout_correction"),
        ({"sapo_tau_pos": 2.0}, ValueError, "objective='sapo' only"),
        ({"rollout_correction": "sequence-mask", "rollout_sequence_weight": "sum"}, ValueError,
         "rollout_sequence_weight must be one of"),
        ({"log_ratio_clamp": (1.0, -1.0)}, ValueError, "low < high"),
        ({"log_ratio_clamp": 20.0}, ValueError, "a \\(low, high\\) pair"),
        ({"use_bias_correction_kl": 1}, TypeError, "must be a bool"),
        ({"objective": "vespo", "level": "sequence_token"}, ValueError, "defined at level 'sequence' or 'token'"),
        ({"vespo_k_pos": 1.0}, ValueError, "objective='vespo' only"),
        ({"objective": "vespo", "vespo_lambda_neg": 0.0}, ValueError, "must be > 0"),
    ]
    for options, error, pattern in bad:
        with pytest.raises(error, match=pattern):
            gk.gspo_loss(*args, **kwargs, **options)
    no_rollout = {k: v for k, v in kwargs.items() if k != "rollout_logprobs"}
    with pytest.raises(ValueError, match="needs rollout_logprobs"):
        gk.gspo_loss(*args, **no_rollout, rollout_correction="token-truncate")
    with pytest.raises(ValueError, match="read only by rollout_correction"):
        gk.gspo_loss(*args, **kwargs)
    with pytest.raises(ValueError, match="set top_entropy_quantile < 1"):
        gk.gspo_loss(*args, **no_rollout, entropy_threshold=1.0)
    with pytest.raises(TypeError, match="not both"):
        gk.gspo_loss(*args, **no_rollout, config=gk.GSPOConfig(), level="token")


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_vespo_weight_acts(backend, packed, seed):
    """VESPO's gamma weight far from 1: old log-probs moved so that each sequence's summed
    log-ratio spans about [-2, 2], on both advantage signs, with non-default (k, lambda)."""
    problem = _problem(backend, seed, packed)
    problem.rollout_logprobs = None
    rows = problem.old_logprobs.shape[0] if not packed else problem.cu_seqlens.numel() - 1
    shift = torch.linspace(-0.3, 0.3, rows, device=problem.old_logprobs.device)
    if packed:
        lengths = (problem.cu_seqlens[1:] - problem.cu_seqlens[:-1]).tolist()
        shift = torch.repeat_interleave(shift, torch.tensor(lengths, device=shift.device))
    else:
        shift = shift[:, None]
    problem.old_logprobs = problem.old_logprobs + shift
    options = dict(objective="vespo", vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.0, vespo_lambda_neg=1.5)
    result = run_case(problem, backend, **options)
    assert result.passed, result.failures()
    # The weight moves the loss: the same problem without it (CISPO with no clip) differs.
    loss, _ = _ref_metrics(problem, **options)
    plain, _ = _ref_metrics(problem, objective="cispo", eps_low=1 - 1e-9, eps_high=1e9)
    assert abs(loss.item() - plain.item()) > 1e-3 * abs(plain.item())


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_vespo_token_level_kl_correction(backend, packed, seed):
    """Issue 24 (TRL's vespo at importance_sampling_level="token"): the weight stays the
    sequence's product ratio, and the KL's bias correction multiplies by each token's ratio.
    The problem tells the levels apart: the reference's gradients at the two levels differ by
    ~2e-3 relative, 20x the tolerance."""
    problem = _problem(backend, seed, packed)
    problem.rollout_logprobs = None
    options = dict(objective="vespo", beta=0.1, use_bias_correction_kl=True)
    result = run_case(problem, backend, level="token", **options)
    assert result.passed, result.failures()
    grads = {}
    for level in ("token", "sequence"):
        base = problem.logits_base.detach().double().requires_grad_()
        args, kwargs = problem.loss_args(base[problem.view])
        reference.gspo_loss(*args, **kwargs, level=level, **options)[0].backward()
        grads[level] = base.grad
    assert relative_error(grads["token"], grads["sequence"]) > 1e-3


@pytest.mark.parametrize("q", [0.0, 0.1, 0.5, 0.73, 1.0])
def test_sync_free_quantile_matches_torch_quantile(q):
    from gspo_kernels.sequence.corrections import quantile_of_masked

    values = torch.randn(37, dtype=torch.float64)
    mask = torch.rand(37) < 0.6
    expected = torch.quantile(values[mask], q)
    assert torch.allclose(quantile_of_masked(values, mask, q), expected, rtol=0, atol=1e-12)
    one = torch.zeros(37, dtype=torch.bool)
    one[5] = True
    assert quantile_of_masked(values, one, q) == values[5]
