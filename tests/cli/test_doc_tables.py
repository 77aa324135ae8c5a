"""The pages' exact figures (the distributed splits' collectives and payloads, which depend on
the code, not the machine) against a fresh count by `bench --distributed`'s own workers, and
scripts/doc_tables.py's tables made from that result."""

import importlib.util
import pathlib

from gspo_kernels.bench.distributed import DistributedBench, run

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("doc_tables", ROOT / "scripts" / "doc_tables.py")
doc_tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(doc_tables)


def test_the_pages_state_todays_collectives_and_payloads(tmp_path):
    # Counted at N = 16384 as the pages state them; the timed part is made tiny.
    result = run(DistributedBench(rows=512, vocab=64, reps=1))
    assert doc_tables.check_docs(result) == []
    table = doc_tables.distributed_table(result)
    assert all(row in table for row in doc_tables.distributed_rows(result).values())
    # and the check can fail: a page that states another payload is caught
    stale = tmp_path / "performance.md"
    stale.write_text(doc_tables.PAGES[0].read_text().replace("| cp | 4 / 0 | 900 B |", "| cp | 6 / 2 | 912 B |"))
    prose = tmp_path / "distributed.md"
    prose.write_text(doc_tables.PAGES[1].read_text().replace("900 B", "912 B"))
    assert len(doc_tables.check_docs(result, (stale, prose))) == 2
