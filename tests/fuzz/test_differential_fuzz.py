"""The property-based differential fuzz (docs: /work/shared/DESIGN.md, "Semantics are held by
search, not by examples"; issue 24).

Each test draws whole problems (fuzz_strategies.py: padded and packed layouts, empty sequences and
batches, views and strides of every input, every dtype and mask form, NaN/inf logits and
out-of-range ids inside and outside the response, ratios in and beyond the clip range and exactly
on it, every GSPOConfig option) for one entry point and backend, runs it next to the float64
reference, and fails on any broken rule (fuzz_oracle.py). The failure message ends in a one-line
repro; the profile (ci or long) and the example budgets are in fuzz_profiles.py.
"""

import contextlib

import pytest
import torch
from hypothesis import assume, given, note
from hypothesis import strategies as st

from conftest import BACKENDS
from gspo_kernels.backends import triton_backend

from fuzz_build import build
from fuzz_invalid import applicable, invalid_call
from fuzz_profiles import fuzz_settings
from fuzz_run import check_built
from fuzz_strategies import fuzz_cases

# The fuzz builds CPU tensors, so it runs the backends that take them (Triton through its
# interpreter); the cuda backend, and Triton on a GPU, would need the problems moved there.
CPU_BACKENDS = [b for b in BACKENDS if b in ("torch", "cpu") or (b == "triton" and triton_backend.INTERPRETED)]


class RuleBroken(AssertionError):
    """A rule broken on a valid input. Subclasses name the kind, so that hypothesis (which tells
    bugs apart by exception type and place) shrinks and reports each kind on its own."""


class Crashed(RuleBroken):
    pass


class NaNPlacement(RuleBroken):
    pass


class PaddingNotZero(RuleBroken):
    pass


class OutOfRange(RuleBroken):
    pass


class Mismatch(RuleBroken):
    pass


def _kind(failure: str) -> type:
    if " raised " in failure:
        return Crashed
    if "NaN" in failure or "finite where" in failure or "inf mismatch" in failure:
        return NaNPlacement
    if "not exactly 0.0" in failure:
        return PaddingNotZero
    if "outside [0, 1]" in failure or "< 0" in failure or "negative" in failure or "seq_ratio 0" in failure:
        return OutOfRange
    return Mismatch


# When one case breaks several rules, it is reported as the kind earliest here: a crash or an
# impossible metric says more than the value mismatch it drags along.
_PRIORITY = (Crashed, OutOfRange, PaddingNotZero, NaNPlacement, Mismatch)


def _check(case) -> None:
    built = build(case)
    # Within rounding of a kink float32 and float64 may fall on different sides: not a defect.
    assume(built.near_tie is None)
    failures = check_built(built)
    if failures:
        note(f"options after resolving thresholds: {built.options}")
        kind = min((_kind(f) for f in failures), key=_PRIORITY.index)
        raise kind("\n".join(failures) + f"\nrepro: {case.repro()}")


@contextlib.contextmanager
def _one_thread():
    """The problems are tiny: one intra-op thread runs them as fast as two, and does not slow
    ten-fold when another test process shares this 2-core machine (threads spinning against
    each other). Restored after, so other tests run as they would."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _fuzz(entry: str, backend: str) -> None:
    @fuzz_settings(entry, backend)
    @given(case=fuzz_cases(entry, backend))
    def run(case):
        _check(case)

    with _one_thread():
        run()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_gspo_loss_matches_the_reference(backend):
    _fuzz("gspo_loss", backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_fused_linear_matches_the_materialised_reference(backend):
    _fuzz("fused_linear", backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_selective_log_softmax_matches_the_reference(backend):
    _fuzz("selective_log_softmax", backend)


def test_policy_loss_matches_the_reference():
    _fuzz("policy_loss", "torch")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_invalid_input_raises_a_clear_error(backend):
    """A valid problem with one thing broken raises TypeError/ValueError with a message: never a
    kernel's RuntimeError, never a result (float masks: TypeError, on every entry point)."""

    @fuzz_settings("invalid", backend)
    @given(data=st.data())
    def run(data):
        entry = data.draw(st.sampled_from(["gspo_loss", "fused_linear", "policy_loss", "selective_log_softmax"]),
                          label="entry")
        case = data.draw(fuzz_cases(entry, backend), label="case")
        built = build(case)
        corruption = data.draw(st.sampled_from(applicable(built)), label="corruption")
        variant = data.draw(st.integers(0, 11), label="variant")
        thunk, expected = invalid_call(built, corruption, variant)
        repro = case.repro(f"invalid={corruption}:{variant}")
        try:
            thunk()
        except expected as exc:
            assert str(exc).strip(), f"{type(exc).__name__} without a message: {repro}"
            return
        except Exception as exc:  # noqa: BLE001 - the wrong kind of error is the finding
            raise Crashed(f"raised {type(exc).__name__} ({exc}) instead of "
                          f"{getattr(expected, '__name__', expected)}: {repro}") from exc
        raise Mismatch(f"no error raised: {repro}")

    with _one_thread():
        run()
