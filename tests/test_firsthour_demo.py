"""The demo's tail: after the chaos kill the live view says it waits for the killed worker's
leases to expire and counts them down; the crawl-wide rate is the sum of the per-worker rates. (That a
real run says it is in tests/test_demo.py's run with a kill.)"""

from __future__ import annotations

from rich.console import Console

from scrapy_dist.demo import Snapshot, WorkerRow, combined_rate, progress_line, render_live


def _snapshot(**kw: object) -> Snapshot:
    base: dict[str, object] = dict(elapsed=20.0, crawled=4990, total=4990, rate=0.0, queued=0, inflight=61,
                                   delayed=0, dead_letters=10, retried=20, duplicates=0)
    return Snapshot(**{**base, **kw})  # type: ignore[arg-type]


def test_the_wait_for_the_killed_workers_leases_is_said_and_counted_down() -> None:
    s = _snapshot(orphaned=61, orphaned_expire_in=4.2)
    note = "waiting for the killed worker's 61 leases to expire: back in the queue in 4 s"
    assert note in progress_line(s)
    console = Console(width=120, record=True)
    console.print(render_live(s))
    assert note in console.export_text()
    later = _snapshot(orphaned=61, orphaned_expire_in=0.0)
    assert "back in the queue now" in progress_line(later)
    assert "waiting" not in progress_line(_snapshot())


def test_crawl_wide_rate_is_the_sum_of_the_worker_rates() -> None:
    rows = [WorkerRow(1, 11, "running", 100, 40.0, 5), WorkerRow(2, 12, "killed (chaos)", 50, None, 61),
            WorkerRow(3, 13, "running", 80, 35.5, 3)]
    assert combined_rate(rows, fallback=999.0) == 75.5
    assert combined_rate([WorkerRow(1, 11, "starting", None, None, None)], fallback=12.0) == 12.0
