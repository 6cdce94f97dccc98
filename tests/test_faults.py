"""Faults on hosts of their own: each worker, Redis and the site in a network namespace (benchmarks/netns.py),
a fault injected mid-crawl, and the checker's verdict from the site's access log, the items and the logs.

The short form of ``python -m benchmarks faults``. Needs root and iproute2 (tests/netns/ensure_tools.sh):
without them the tests fail in CI (``$CI`` set) and are skipped elsewhere, with one line saying why.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the benchmarks package beside tests/

from zygote import Zygote  # noqa: E402

from benchmarks.faultcheck import check, summarize_log  # noqa: E402
from benchmarks.faultcrawl import CrawlConfig  # noqa: E402
from benchmarks.faults import FAULTS, FaultRun, run_fault  # noqa: E402
from benchmarks.netns import HarnessUnavailable, Network, check_available  # noqa: E402

SMALL = CrawlConfig(
    pages=300, workers=3, concurrency=4, page_delay=0.2, lease=4.0, idle_close=2.0, socket_timeout=2.0,
    timeout=120.0,
)
OUTAGE = "Redis is unreachable"


@pytest.fixture
def namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        check_available()
    except HarnessUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(str(exc), pytrace=False)
        pytest.skip(str(exc))
    if Zygote.enabled():
        monkeypatch.setattr(Network, "spawn", _spawn_forked)


_spawn = Network.spawn


def _spawn_forked(net: Network, host: str, argv: Sequence[str], log: Path, **kw: Any) -> Any:
    """``Network.spawn``, but a ``scrapy crawl`` worker is forked from the tests' zygote (already imported)
    into its host's namespace, with its hostname: the same process for the harness (pid, signals, exit)."""
    if list(argv[:3]) != [sys.executable, "-m", "scrapy"] or not kw.get("hostname"):
        return _spawn(net, host, argv, log, **kw)
    with open(log, "ab") as fh:
        proc = Zygote.start(list(argv[3:]), kw["cwd"], kw["env"], fh.fileno(), net.hosts[host].namespace,
                            kw["hostname"])
    net.procs.append(proc)  # type: ignore[arg-type]
    return proc


def survived(run: FaultRun) -> None:
    """Nothing lost, re-work within the bound, the crawl closed by itself, no traceback; duplicate items
    only where the fault still allows them (benchmarks.faults.EXACTLY_ONCE_ITEMS)."""
    v = run.verdict
    assert run.problems() == [], (run.problems(), run.info)
    assert v.pages_never_fetched == 0 and v.items_lost == 0
    assert v.closed_by_itself and v.tracebacks == 0 and v.errors == 0, v.logs
    if not FAULTS[run.fault].duplicate_items_allowed():
        assert v.duplicate_items == 0


@pytest.mark.slow
def test_worker_cut_from_redis_past_its_lease_while_downloading(namespaces: None, tmp_path: Path) -> None:
    run = run_fault("partition-zombie", SMALL, tmp_path)
    survived(run)
    victim = run.verdict.logs["w2"]
    assert any(OUTAGE in w for w in victim.warnings), victim.warnings
    assert not any(OUTAGE in w for w in run.verdict.logs["w1"].warnings)


@pytest.mark.slow
def test_redis_cut_from_every_worker(namespaces: None, tmp_path: Path) -> None:
    run = run_fault("redis-partition", SMALL, tmp_path)
    survived(run)
    assert all(any(OUTAGE in w for w in log.warnings) for log in run.verdict.logs.values()), run.verdict.logs


@pytest.mark.slow
def test_jittery_latency_to_redis_for_the_whole_crawl(namespaces: None, tmp_path: Path) -> None:
    run = run_fault("latency", replace(SMALL, pages=200), tmp_path)  # each sync waits 20 ms: fewer pages
    survived(run)
    assert run.verdict.duplicate_items == 0 and run.verdict.duplicate_fetches == 0
    assert run.verdict.warnings == 0, run.verdict.logs


# -- the checker, on made-up crawls ----------------------------------------------------------------
def _access(paths: list[str], status: int = 200) -> list[tuple[float, int, str]]:
    return [(0.0, status, p) for p in paths]


def test_checker_counts_a_page_never_fetched_and_its_missing_item() -> None:
    access = _access(["/page/0", "/page/2"]) + _access(["/page/1"], status=503)
    v = check(3, access, ["http://s/page/0", "http://s/page/2"], {}, {"w1": 0}, [], 0)
    assert (v.pages_never_fetched, v.items_lost, v.duplicate_fetches) == (1, 1, 0)
    assert v.problems(duplicate_items_allowed=True) == ["1 pages never fetched", "1 items lost"]


def test_checker_counts_duplicates_against_the_bound() -> None:
    access = _access(["/page/0", "/page/0", "/page/0", "/page/1"])
    items = ["http://s/page/0", "http://s/page/0", "http://s/page/1"]
    v = check(2, access, items, {}, {"w1": 0, "w2": -9}, ["w2"], duplicate_fetch_bound=1)
    assert (v.duplicate_fetches, v.duplicate_items, v.closed_by_itself) == (2, 1, True)
    assert v.problems(duplicate_items_allowed=True) == ["2 duplicate fetches > bound 1"]
    assert "1 duplicate items" in v.problems(duplicate_items_allowed=False)


def test_checker_sees_a_worker_that_did_not_close_and_a_traceback() -> None:
    log = (
        "2026-01-01 00:00:00 [scrapy_dist.redis.outage] WARNING: Redis is unreachable (x)\n"
        "Traceback (most recent call last):\n"
        "2026-01-01 00:00:01 [scrapy.core.engine] INFO: Spider closed (finished)\n"
    )
    logs, codes = {"w1": log, "w2": ""}, {"w1": 0, "w2": None}
    v = check(1, _access(["/page/0"]), ["http://s/page/0"], logs, codes, [], 0)
    assert not v.closed_by_itself and v.tracebacks == 1 and v.warnings == 1
    assert summarize_log(log).finished and not v.logs["w2"].finished


def test_without_root_the_harness_stops_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(HarnessUnavailable) as info:
        check_available()
    assert "needs root" in str(info.value) and "\n" not in str(info.value)
