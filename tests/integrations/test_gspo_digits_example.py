"""The digit-sum examples, shortened: a GSPO run on a tiny LM whose reward must rise (and its
reward-curve PNG), and the same task through TRL's trainer with the gspo_kernels drop-in."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest

from conftest import import_installed

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gspo_digits.py"


def test_reward_rises_and_curve_is_written(tmp_path):
    spec = importlib.util.spec_from_file_location("gspo_digits", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    png = tmp_path / "curve.png"
    history = module.main(["--steps", "24", "--plot", str(png)])
    assert len(history) == 24
    first = sum(h["reward"] for h in history[:8]) / 8
    last = sum(h["reward"] for h in history[-8:]) / 8
    assert last > first + 0.15, (first, last)
    assert all(0 <= h["clip_frac"] <= 1 and h["kl"] >= 0 for h in history)
    assert png.stat().st_size > 10_000


def test_trl_drop_in_learns_the_task():
    import_installed("trl")
    spec = importlib.util.spec_from_file_location("gspo_digits_trl", EXAMPLE.with_name("gspo_digits_trl.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rewards = module.main(["--steps", "40"])
    assert not [w for w in caught if str(w.message).startswith("gspo_kernels:")], "the drop-in fell back to TRL"
    assert len(rewards) == 20
    assert sum(rewards[-8:]) / 8 > sum(rewards[:8]) / 8 + 0.15, rewards
