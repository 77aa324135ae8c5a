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


def test_the_check_fails_both_ways(tmp_path):
    """A result with no splits checks nothing and says so; a page row whose split the bench no
    longer measures is flagged (the check reads the page against the result, not only back)."""
    result = run(DistributedBench(rows=512, vocab=64, reps=1))
    assert doc_tables.check_docs({**result, "splits": {}}) == [
        "the distributed result holds no splits: nothing to check the pages against"]
    gone = dict(result, splits={k: v for k, v in result["splits"].items() if k != "dp"})
    problems = doc_tables.check_docs(gone)
    assert problems == ["performance.md: documents a dp row that the result no longer has"], problems


def test_readme_quotes_only_held_figures(tmp_path):
    """README's measured figures are the ones RESULTS.md or docs/performance.md hold, as they hold
    them; planted stale and rounded figures are caught, each by name."""
    assert doc_tables.unheld_figures() == []
    readme = doc_tables.QUOTING[0].read_text()
    main_job = doc_tables.FIGURE.search(readme, readme.index("after set-up"))  # the main job's time
    # A stale time: the nearest one above the quoted time that no holder states (an older run's
    # time may sit in RESULTS.md's history, and would rightly count as held).
    held = " ".join(page.read_text() for page in doc_tables.HOLDERS)
    seconds = next(str(t) for t in range(int(main_job.group(1)) + 1, 100000) if f"{t} s" not in held)
    stale = tmp_path / "README.md"
    stale.write_text((readme[:main_job.start()] + f"{seconds} s" + readme[main_job.end():])
                     .replace("86.8 ms", "87 ms", 1).replace("139.4 ms", "39.4 ms", 1).replace("69.2%", "69%", 1))
    problems = doc_tables.unheld_figures((stale,))
    # A rounded figure, the tail of a held one ("39.4 ms" of "139.4 ms"), and one that only an
    # unrelated table cell holds ("| 69 |" in a table of op counts) are all caught.
    assert sorted(problems) == sorted(f"README.md: {figure!r} is held by none of RESULTS.md, performance.md"
                                      for figure in (f"{seconds} s", "87 ms", "39.4 ms", "69%")), problems
