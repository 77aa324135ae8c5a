"""Bad input is refused before any kernel runs, with an error that names the argument."""

import pytest
import torch

import gspo_kernels as gk
from gspo_kernels import backends
from gspo_kernels.testing.problems import ProblemSpec, make_problem


@pytest.fixture
def problem(seed):
    return make_problem(ProblemSpec(seed=seed))


def _call(problem, **changes):
    args, kwargs = problem.loss_args()
    names = ("logits", "target_ids", "old_logprobs", "advantages")
    positional = dict(zip(names, args))
    for key in list(changes):
        if key in positional:
            positional[key] = changes.pop(key)
    kwargs.update(changes)
    return gk.gspo_loss(*positional.values(), **kwargs)


@pytest.mark.parametrize(
    "changes, error, pattern",
    [
        ({"logits": torch.randn(4, 5, 6, 7)}, ValueError, "logits must be"),
        ({"logits": torch.randint(0, 3, (6, 9, 300))}, TypeError, "logits must be float32"),
        ({"target_ids": torch.zeros(6, 8, dtype=torch.long)}, ValueError, "target_ids must have shape"),
        ({"target_ids": torch.zeros(6, 9)}, TypeError, "target_ids must be int64 or int32"),
        ({"target_ids": "tokens"}, TypeError, "target_ids must be a torch.Tensor"),
        ({"old_logprobs": torch.zeros(6, 9, dtype=torch.bfloat16)}, TypeError, "too coarse"),
        ({"old_logprobs": torch.zeros(9, 6)}, ValueError, "old_logprobs must have shape"),
        ({"advantages": torch.zeros(5)}, ValueError, "advantages must have shape"),
        ({"advantages": torch.zeros(6, dtype=torch.long)}, TypeError, "advantages must be a float"),
        ({"mask": torch.ones(6, 9)}, TypeError, "mask must be bool"),
        ({"mask": torch.ones(6, 8, dtype=torch.bool)}, ValueError, "mask must have shape"),
        ({"ref_logprobs": torch.zeros(6, 9, dtype=torch.float16)}, TypeError, "ref_logprobs must be float32"),
        ({"beta": 0.1}, ValueError, "needs ref_logprobs"),
        ({"cu_seqlens": torch.tensor([0, 54])}, ValueError, "cu_seqlens is for packed"),
        ({"level": "sentence"}, ValueError, "level must be one of"),
        ({"loss_agg": "mean"}, ValueError, "loss_agg must be one of"),
        ({"kl_estimator": "k4"}, ValueError, "kl_estimator must be one of"),
        ({"backend": "tpu"}, ValueError, "backend must be one of"),
        ({"eps_low": 1.0}, ValueError, "eps_low must be in"),
        ({"eps_low": -0.1}, ValueError, "eps_low must be in"),
        ({"eps_high": -1e-4}, ValueError, "eps_high must be"),
        ({"eps_high": float("nan")}, ValueError, "eps_high must be finite"),
        ({"eps_high": True}, TypeError, "eps_high must be a Python float"),
        ({"temperature": 0.0}, ValueError, "temperature must be > 0"),
        ({"beta": -1.0}, ValueError, "beta"),
        ({"max_len": 0}, ValueError, "max_len must be a positive int"),
        ({"normalizer": 0}, ValueError, "normalizer must be a finite number > 0"),
        ({"normalizer": float("inf")}, ValueError, "normalizer must be a finite number > 0"),
        ({"normalizer": float("nan")}, ValueError, "normalizer must be a finite number > 0"),
        ({"normalizer": torch.ones(2)}, ValueError, "normalizer must be a scalar"),
        ({"normalizer": torch.tensor(-4.0)}, ValueError, "normalizer must be finite and > 0"),
        ({"normalizer": torch.tensor(0.0)}, ValueError, "normalizer must be finite and > 0"),
        ({"normalizer": torch.tensor(float("inf"))}, ValueError, "normalizer must be finite and > 0"),
        ({"temperature": float("inf")}, ValueError, "temperature must be finite"),
        ({"mask": torch.full((6, 9), 2)}, ValueError, "integer mask must hold only 0 and 1"),
        ({"mask": torch.full((6, 9), -1, dtype=torch.int8)}, ValueError, "integer mask must hold only 0 and 1"),
        ({"inplace": "yes"}, TypeError, "inplace must be a bool"),
    ],
)
def test_padded_input_errors(problem, changes, error, pattern):
    with pytest.raises(error, match=pattern):
        _call(problem, **changes)


def test_device_mismatch_is_named(problem):
    with pytest.raises(ValueError, match="old_logprobs is on meta"):
        _call(problem, old_logprobs=problem.old_logprobs.to("meta"))
    with pytest.raises(ValueError, match="target_ids is on meta"):
        _call(problem, target_ids=problem.target_ids.to("meta"))


@pytest.mark.parametrize(
    "cu, pattern",
    [
        (None, "need cu_seqlens"),
        ([1, 10], "must start at 0"),
        ([0, 20, 10], "non-decreasing"),
        ("end", "must end at N"),
        ([[0, 3]], "1-D"),
        ([0], "1-D with S\\+1 >= 2"),
    ],
)
def test_packed_input_errors(problem, cu, pattern):
    packed = problem.to_packed()
    args, kwargs = packed.loss_args()
    if cu is None:
        kwargs.pop("cu_seqlens")
    elif cu == "end":
        kwargs["cu_seqlens"] = packed.cu_seqlens.clone()
        kwargs["cu_seqlens"][-1] -= 1
    else:
        kwargs["cu_seqlens"] = torch.tensor(cu)
    with pytest.raises(ValueError, match=pattern):
        gk.gspo_loss(*args, **kwargs)


def test_packed_cu_seqlens_dtype_and_norm_horizon(problem):
    packed = problem.to_packed()
    args, kwargs = packed.loss_args()
    with pytest.raises(TypeError, match="cu_seqlens must be int32 or int64"):
        gk.gspo_loss(*args, **{**kwargs, "cu_seqlens": packed.cu_seqlens.float()})
    with pytest.raises(ValueError, match="needs max_len"):
        gk.gspo_loss(*args, **kwargs, loss_agg="seq-mean-token-sum-norm")
    # int32 cu_seqlens are fine.
    loss, _ = gk.gspo_loss(*args, **{**kwargs, "cu_seqlens": packed.cu_seqlens.int()})
    assert torch.isfinite(loss)


@pytest.mark.parametrize("backend", ["triton", "cpu", "cuda"])
def test_float64_logits_only_on_the_torch_path(problem, backend):
    with pytest.raises(TypeError, match="float64 logits run on backend='torch'"):
        _call(problem, logits=problem.logits.double(), backend=backend)


@pytest.mark.skipif(not backends.native_available(), reason="extension gspo_kernels.backends._C not built")
def test_native_backend_on_the_wrong_device(problem):
    with pytest.raises(ValueError, match="needs logits on a cuda device"):
        _call(problem, backend="cuda")


def test_triton_on_cpu_without_interpreter_says_how(problem, monkeypatch):
    if backends.triton_backend is None:
        pytest.skip("triton not installed")
    monkeypatch.setattr(backends.triton_backend, "INTERPRETED", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        _call(problem, backend="triton")


def test_native_backend_missing_says_how_to_build(problem, monkeypatch):
    monkeypatch.setattr(backends.native_backend, "_load_error", "No module named 'gspo_kernels._C'")
    with pytest.raises(RuntimeError, match="pip install --no-build-isolation"):
        _call(problem, backend="cpu")


def test_module_validates_options_once_at_construction():
    with pytest.raises(ValueError, match="level must be one of"):
        gk.GSPOLoss(level="seq")


def test_selective_log_softmax_errors():
    logits = torch.randn(3, 5)
    with pytest.raises(ValueError, match="target_ids must have shape"):
        gk.selective_log_softmax(logits, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        gk.selective_log_softmax(logits, torch.zeros(3, dtype=torch.long), temperature=-1.0)
    # inf flattens every row to uniform; the backends would not agree on -log V vs NaN.
    with pytest.raises(ValueError, match="temperature must be finite"):
        gk.selective_log_softmax(logits, torch.zeros(3, dtype=torch.long), temperature=float("inf"))
    with pytest.raises(TypeError, match="temperature must be a Python float"):
        gk.selective_log_softmax(logits, torch.zeros(3, dtype=torch.long), temperature=torch.tensor(1.0))
    with pytest.raises(ValueError, match="integer mask must hold only 0 and 1"):
        gk.selective_log_softmax(logits, torch.zeros(3, dtype=torch.long), mask=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="mask must have shape"):
        gk.selective_log_softmax(logits, torch.zeros(3, dtype=torch.long), mask=torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="empty vocab"):
        gk.selective_log_softmax(torch.randn(3, 0), torch.zeros(3, dtype=torch.long))
