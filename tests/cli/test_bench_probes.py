"""The CPU memory probes: run after every timing, PROBES_AT_ONCE at a time, their bytes on the
rows that asked for them, and never written out."""

import threading
import time
from dataclasses import dataclass

from gspo_kernels.bench.memory import PROBES_AT_ONCE, CpuProbe
from gspo_kernels.bench.runner import BenchRow, SuiteConfig, SuiteResult, measure_in_rounds

# Every probe waits here for the others of its batch: probes run one at a time would time out.
_together = threading.Barrier(PROBES_AT_ONCE, timeout=10)


@dataclass(frozen=True)
class _FakeProbe(CpuProbe):
    bytes_: int = 0

    def run(self) -> int:
        _together.wait()
        if self.bytes_ < 0:
            raise RuntimeError("the child died")
        return self.bytes_


def _rows(name, modes, probe):
    return [BenchRow(provider=name, batch=1, seq_len=1, vocab=1, tokens=1, dtype="bf16", mode=mode, device="cpu",
                     status="ok", median_ms=1.0, probe=probe) for mode in modes]


def test_probes_run_after_the_timings_together_and_fill_every_row_of_their_provider():
    sizes = {"a": 3 * 2**20, "b": -1}  # b's probe fails
    timed_after_probes = []

    def measure_one(cfg, name):
        timed_after_probes.append(_together.n_waiting)
        probe = _FakeProbe(name, "1x1x1", "bf16", bytes_=sizes[name]) if cfg.measure_memory else None
        return _rows(name, ("forward", "fwd+bwd"), probe)

    rows = measure_in_rounds(SuiteConfig(shapes=(), rounds=2), ("a", "b"), measure_one)
    assert timed_after_probes == [0, 0, 0, 0]  # no probe was waiting while a contender was timed
    by = {(r.provider, r.mode): r for r in rows}
    assert by[("a", "forward")].peak_mem_mib == 3.0 and by[("a", "fwd+bwd")].peak_mem_mib == 3.0
    assert by[("b", "forward")].peak_mem_mib is None and "memory probe failed: the child died" in by[("b", "forward")].note
    assert all(r.probe is None for r in rows)
    assert all("probe" not in row for row in SuiteResult(meta={}, rows=rows).to_json()["rows"])


def test_probes_run_at_once_up_to_the_limit():
    started = []

    @dataclass(frozen=True)
    class _Timed(CpuProbe):
        def run(self) -> int:
            started.append(time.perf_counter())
            time.sleep(0.3)
            return 2**20

    names = [f"p{i}" for i in range(2 * PROBES_AT_ONCE)]
    rows = measure_in_rounds(SuiteConfig(shapes=()), names,
                             lambda cfg, name: _rows(name, ("fwd+bwd",), _Timed(name, "1x1x1", "bf16")))
    assert all(r.peak_mem_mib == 1.0 for r in rows)
    first_batch = sorted(started)[:PROBES_AT_ONCE]
    assert first_batch[-1] - first_batch[0] < 0.25  # started together, not one after the other
