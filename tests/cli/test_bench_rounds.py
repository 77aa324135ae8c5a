"""bench --rounds: the contenders timed in rounds of alternating order, their rows merged."""

from gspo_kernels.bench.runner import BenchRow, SuiteConfig, measure_in_rounds, timing_note


def _row(provider, ms, status="ok", peak=None):
    return BenchRow(provider=provider, batch=1, seq_len=1, vocab=1, tokens=1, dtype="bf16", mode="fwd+bwd",
                    device="cpu", status=status, median_ms=ms, peak_mem_mib=peak, floor_fraction=None if ms is None else 1.0 / ms)


def test_rounds_alternate_the_order_and_take_the_median():
    calls = []
    times = {("a", 0): 10.0, ("b", 0): 20.0, ("a", 1): 14.0, ("b", 1): 12.0, ("a", 2): 11.0, ("b", 2): 40.0}

    def measure_one(cfg, name):
        index = sum(1 for n, _ in calls if n == name)
        calls.append((name, cfg.measure_memory))
        return [_row(name, times[(name, index)], peak=5.0 if cfg.measure_memory else None)]

    cfg = SuiteConfig(shapes=(), rounds=3, reps=2, warmup=1)
    rows = measure_in_rounds(cfg, ("a", "b"), measure_one)
    assert [n for n, _ in calls] == ["a", "b", "b", "a", "a", "b"]
    assert [m for _, m in calls] == [True, True, False, False, False, False]  # memory in round one only
    assert [(r.provider, r.median_ms, r.peak_mem_mib) for r in rows] == [("a", 11.0, 5.0), ("b", 20.0, 5.0)]
    assert abs(rows[0].floor_fraction - 1 / 11.0) < 1e-12
    assert "3 rounds" in timing_note(cfg) and "1 warm-up" in timing_note(cfg)


def test_a_round_that_fails_is_reported_not_averaged():
    outcomes = iter([_row("a", 10.0), _row("a", None, status="error")])
    rows = measure_in_rounds(SuiteConfig(shapes=(), rounds=2), ("a",), lambda cfg, name: [next(outcomes)])
    assert rows[0].status == "error"


def test_one_round_is_the_plain_suite():
    rows = measure_in_rounds(SuiteConfig(shapes=()), ("a", "b"), lambda cfg, name: [_row(name, 3.0)])
    assert [r.provider for r in rows] == ["a", "b"] and all(r.median_ms == 3.0 for r in rows)


def test_once_contenders_are_measured_in_the_first_round_only():
    calls = []

    def measure_one(cfg, name):
        calls.append(name)
        return [_row(name, 1.0)]

    measure_in_rounds(SuiteConfig(shapes=(), rounds=2), ("a", "slow", "b"), measure_one, once=("slow",))
    assert calls == ["a", "slow", "b", "b", "a"]


def test_rounds_are_matched_by_mode():
    def row(mode, ms):
        r = _row("a", ms)
        r.mode = mode
        return r

    # a round may list its modes in another order (measure puts failed or untimed modes first)
    outcomes = iter([[row("forward", 1.0), row("backward", 2.0)], [row("backward", 4.0), row("forward", 3.0)]])
    merged = measure_in_rounds(SuiteConfig(shapes=(), rounds=2), ("a",), lambda cfg, name: next(outcomes))
    assert {r.mode: r.median_ms for r in merged} == {"forward": 2.0, "backward": 3.0}
