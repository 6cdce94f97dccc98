"""Workers killed (SIGKILL) and stopped past their lease (SIGSTOP, then resumed) during a small local crawl:
the output is counted item by item. ``RedisPipeline`` (LIST and STREAM): every item of every page exactly
once. Feed exports (one local JSON Lines file per worker): every item at least once."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
from crawlproject import lease_parts, make_project

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the benchmarks package beside tests/

from benchmarks.processes import link_spider  # noqa: E402

SPIDER = link_spider('ItemsSpider', 'pages', 3)

PAGES = 300
LEASE = 3


def _redis_items(client: redis.Redis, stream: bool) -> list[dict[str, Any]]:
    if stream:
        return [json.loads(fields[b"item"]) for _, fields in client.xrange("pages:items")]
    return [json.loads(v) for v in client.lrange("pages:items", 0, -1)]


def _feed_items(root: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(root.glob("feed-*.jsonl")):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a killed worker's last line may be cut short
                out.append(json.loads(line))
    return out


def _wait(cond: Any, what: str, project: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}\n{project.logs()[-3000:]}"
        time.sleep(0.05)


def _crawl_with_kill_and_stop(
    tmp_path: Path, site: Any, redis_url: str, output: str, resume_at_sweep: bool = False
) -> Any:
    settings: dict[str, Any] = {
        "REDIS_URL": redis_url, "CONCURRENT_REQUESTS": 8, "SCHEDULER_LEASE_SECONDS": LEASE,
        "SCHEDULER_IDLE_BEFORE_CLOSE": 2,
    }
    if output in ("list", "stream"):
        settings["ITEM_PIPELINES"] = {"scrapy_dist.pipelines.RedisPipeline": 300}
        settings["REDIS_ITEMS_STREAM"] = output == "stream"
    project = make_project(tmp_path, settings, spiders=SPIDER)

    def crawl(i: int, seed: str | None = None) -> Any:
        feed = {str(tmp_path / f"feed-{i}.jsonl"): {"format": "jsonlines"}}
        extra = {"FEEDS": feed} if output == "feed" else {}
        return project.crawl("pages", args={"seed": seed} if seed else {}, settings=extra)

    try:
        crawl(0, site.page_url(0))
        killed, stopped = crawl(1), crawl(2)
        project.wait_until_open()
        _wait(lambda: len(site.fetch_counts()) >= PAGES // 4, "the crawl did not get going", project)
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        _wait(lambda: len(site.fetch_counts()) >= PAGES // 2, "the crawl stalled after the kill", project)
        stopped.send_signal(signal.SIGSTOP)
        if resume_at_sweep:  # resumed as soon as its leases are back in the queue, before others take all
            time.sleep(LEASE)
            tag = f":{stopped.pid}:".encode()
            with redis.Redis.from_url(redis_url) as client:
                _wait(lambda: not any(tag in (lease_parts(lease)[2] or b"") for lease in client.zrange(
                    "pages:leases", 0, -1)), "the stopped worker's leases were never swept", project)
        else:
            time.sleep(LEASE + 2)  # its leases run out and other workers take its pages
        stopped.send_signal(signal.SIGCONT)
        codes = project.wait_all(timeout=150)
        assert codes[0] == 0 and codes[2] == 0, project.logs()[-4000:]
    finally:
        project.stop_all()
    return project


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["list", "stream"])
def test_redis_pipeline_items_exactly_once_through_kill_and_stop(
    tmp_path: Path, site_factory: Any, redis_url: str, redis_client: redis.Redis, stream: bool
) -> None:
    site = site_factory(pages=PAGES, links=6, slow=100, slow_delay=0.3)
    project = _crawl_with_kill_and_stop(tmp_path, site, redis_url, "stream" if stream else "list")
    seen = Counter((item["url"], item["part"]) for item in _redis_items(redis_client, stream))
    expected = {(site.page_url(i), part) for i in range(PAGES) for part in range(3)}
    assert set(seen) == expected, f"lost: {sorted(expected - set(seen))[:5]}"
    doubled = {k: n for k, n in seen.items() if n > 1}
    assert not doubled, f"{len(doubled)} items written more than once: {sorted(doubled)[:5]}"
    assert sum(site.fetch_counts().values()) > PAGES  # some pages were fetched twice, their items kept once
    stopped_log = project.log_text(project.procs[2][1])
    # the resumed worker's acks and items, said in one WARNING with the counts
    assert stopped_log.count("The frontier refused") == 1, stopped_log[-3000:]
    assert project.stats(2).get("redis_items/refused", 0) > 0


@pytest.mark.slow
def test_a_worker_resumed_as_its_leases_are_swept_writes_each_item_once(
    tmp_path: Path, site_factory: Any, redis_url: str, redis_client: redis.Redis
) -> None:
    site = site_factory(pages=PAGES, links=6, slow=100, slow_delay=0.3)
    _crawl_with_kill_and_stop(tmp_path, site, redis_url, "list", resume_at_sweep=True)
    seen = Counter((item["url"], item["part"]) for item in _redis_items(redis_client, False))
    expected = {(site.page_url(i), part) for i in range(PAGES) for part in range(3)}
    assert set(seen) == expected, f"lost: {sorted(expected - set(seen))[:5]}"
    doubled = {k: n for k, n in seen.items() if n > 1}
    assert not doubled, f"{len(doubled)} items written more than once: {sorted(doubled)[:5]}"


@pytest.mark.slow
def test_feed_exports_lose_no_item_through_kill_and_stop(
    tmp_path: Path, site_factory: Any, redis_url: str
) -> None:
    site = site_factory(pages=PAGES, links=6, slow=100, slow_delay=0.3)
    project = _crawl_with_kill_and_stop(tmp_path, site, redis_url, "feed")
    seen = Counter((item["url"], item["part"]) for item in _feed_items(tmp_path))
    expected = {(site.page_url(i), part) for i in range(PAGES) for part in range(3)}
    assert set(seen) == expected, f"lost {len(expected - set(seen))}: {sorted(expected - set(seen))[:5]}"
    assert project.stats(0).get("feeds/fsyncs", 0) > 0
    # the resumed worker knows which of its exported pages another fetch exports again
    assert project.stats(2).get("feeds/duplicate_pages", 0) > 0


PIPELINES = '''

import asyncio
import os

from twisted.internet import defer


class _Record:
    def __init__(self, path):
        self.path = path

    @classmethod
    def from_crawler(cls, crawler):
        return cls(os.path.join(crawler.settings["RECORD_DIR"], f"{cls.__name__}-{os.getpid()}.txt"))

    def record(self, item):
        # one line per finished process_item, on disk before it returns (a SIGKILL keeps it)
        with open(self.path, "a") as fh:
            fh.write(f"{item['url']} {item['part']}\\n")


class RaisingPipeline(_Record):
    def process_item(self, item):
        if item["part"] == 1:
            self.record(item)
            raise ValueError("part 1 is refused")
        return item


class SlowAsyncPipeline(_Record):
    async def process_item(self, item):
        await asyncio.sleep(0.3)
        self.record(item)
        return item


class SlowDeferredPipeline(_Record):
    def process_item(self, item):
        from twisted.internet import reactor

        d = defer.Deferred()
        reactor.callLater(0.2, d.callback, item)
        d.addCallback(lambda it: (self.record(it), it)[1])
        return d
'''


def _records(root: Path, name: str) -> Counter[tuple[str, int]]:
    out: Counter[tuple[str, int]] = Counter()
    for path in root.glob(f"{name}*.txt"):
        for line in path.read_text().splitlines():
            url, _, part = line.rpartition(" ")
            if url:
                out[(url, int(part))] += 1
    return out


@pytest.mark.slow
def test_a_page_is_acknowledged_only_once_every_pipeline_finished_its_items(
    tmp_path: Path, site_factory: Any, redis_url: str
) -> None:
    """Slow pipelines (a coroutine, a Deferred) and one that raises: a worker SIGKILLed mid-crawl has
    acknowledged no page whose items were still in a pipeline, so each item finished every pipeline."""
    site = site_factory(pages=150, links=6)
    mod = "proj.spiders.test_spiders"
    project = make_project(tmp_path, {
        "REDIS_URL": redis_url, "CONCURRENT_REQUESTS": 8, "SCHEDULER_LEASE_SECONDS": LEASE,
        "SCHEDULER_IDLE_BEFORE_CLOSE": 2, "RECORD_DIR": str(tmp_path),
        "ITEM_PIPELINES": {f"{mod}.RaisingPipeline": 100, f"{mod}.SlowAsyncPipeline": 200,
                           f"{mod}.SlowDeferredPipeline": 300},
    }, spiders=SPIDER + PIPELINES)
    try:
        project.crawl("pages", args={"seed": site.page_url(0)})
        victim = project.crawl("pages")
        project.wait_until_open()
        mine = f"SlowDeferredPipeline-{victim.pid}"
        _wait(lambda: len(_records(tmp_path, mine)) >= 20, "the victim's items did not go through", project)
        victim.send_signal(signal.SIGKILL)
        assert project.wait_all(timeout=150)[0] == 0, project.logs()[-4000:]
    finally:
        project.stop_all()
    urls = {site.page_url(i) for i in range(150)}
    for name, parts in (("RaisingPipeline", (1,)), ("SlowAsyncPipeline", (0, 2)),
                        ("SlowDeferredPipeline", (0, 2))):
        done = _records(tmp_path, name)
        missing = {(u, p) for u in urls for p in parts} - set(done)
        assert not missing, f"{name}: {len(missing)} items never finished: {sorted(missing)[:5]}"
