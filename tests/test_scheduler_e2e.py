"""End-to-end: real `scrapy crawl` workers sharing one frontier in a real Redis, against a local site."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from crawlproject import kill_one_of_three, lost_and_dupes, make_project
from helpers import wait_for_pages

from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.wire.codec import encode_request

pytestmark = pytest.mark.slow

LINKS = CrawlKeys("links")


def test_three_workers_crawl_every_page(tmp_path: Path, redis_url: str, site_factory: Any) -> None:
    site = site_factory(pages=1000, delay=0.002)
    project = make_project(tmp_path, {"REDIS_URL": redis_url, "SCHEDULER_IDLE_BEFORE_CLOSE": 2})
    project.crawl(args={"seed": site.page_url(0)})
    wait_for_pages(site, 1)
    project.crawl()
    project.crawl()
    assert project.wait_all(120) == [0, 0, 0], project.logs()[-4000:]
    lost, dupes = lost_and_dupes(site)
    assert lost == 0
    assert dupes == 0
    per_worker = [project.stats(i).get("response_received_count", 0) for i in range(3)]
    assert sum(per_worker) == 1000
    assert sum(1 for n in per_worker if n > 0) >= 2, per_worker  # the work was shared
    assert all(project.stats(i)["finish_reason"] == "finished" for i in range(3))
    client = redis.Redis.from_url(redis_url)
    assert client.zcard(LINKS.queue) == 0 and client.zcard(LINKS.leases) == 0
    assert client.exists(LINKS.bloom)  # SCHEDULER_PERSIST defaults to True


def test_sigkilled_worker_loses_nothing(tmp_path: Path, redis_url: str, site_factory: Any) -> None:
    site = site_factory(pages=1000, delay=0.01)
    client = redis.Redis.from_url(redis_url)
    kill_one_of_three(tmp_path, redis_url, site, client, [LINKS.leases], min_pages=350)
    assert client.zcard(LINKS.queue) == 0 and client.zcard(LINKS.leases) == 0


def test_sigkilled_worker_loses_nothing_when_its_rounds_span_several_calls(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    """Rounds once a second with a deep prefetch: each carries far more than CALL_RECORDS discovered
    requests, so it goes as several concurrent sync calls, and acks wait for the whole round to land. A
    SIGKILL at any point of that still loses nothing."""
    site = site_factory(pages=1000, delay=0.01)
    client = redis.Redis.from_url(redis_url)
    kill_one_of_three(
        tmp_path, redis_url, site, client, [LINKS.leases], min_pages=350,
        settings={"SCHEDULER_FLUSH_INTERVAL": 1.0, "SCHEDULER_PREFETCH": 256, "SCHEDULER_FLUSH_BATCH": 5000},
    )
    assert client.zcard(LINKS.queue) == 0 and client.zcard(LINKS.leases) == 0


def test_all_workers_killed_then_fresh_ones_finish(tmp_path: Path, redis_url: str, site_factory: Any) -> None:
    site = site_factory(pages=1200, delay=0.01)
    project = make_project(
        tmp_path,
        {"REDIS_URL": redis_url, "CONCURRENT_REQUESTS": 8, "SCHEDULER_LEASE_SECONDS": 3,
         "SCHEDULER_IDLE_BEFORE_CLOSE": 2},
    )
    first = [project.crawl(args={"seed": site.page_url(0)})]
    wait_for_pages(site, 1)
    first += [project.crawl(), project.crawl()]
    wait_for_pages(site, 400)
    for proc in first:
        project.kill(proc)
    assert len(site.fetch_counts()) < 1200
    project.procs.clear()
    project.crawl()
    project.crawl()
    assert project.wait_all(150) == [0, 0], project.logs()[-4000:]
    lost, _ = lost_and_dupes(site)
    assert lost == 0


SPIDERS_WITH_META = '''
import scrapy


class NoFollowSpider(scrapy.Spider):
    name = "nofollow"

    async def start(self):
        for url in (self.urls.split(",") if getattr(self, "urls", None) else []):
            # an object in meta cannot travel through Redis: crawled locally, error logged once
            yield scrapy.Request(url, meta={"handle": object()}, callback=self.parse_other)

    def parse(self, response):
        yield {"url": response.url, "via": "parse"}

    def parse_other(self, response):
        yield {"url": response.url, "via": "parse_other"}
'''


def test_garbage_in_the_queue_is_rejected_and_the_crawl_goes_on(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    site = site_factory(pages=10)
    client = redis.Redis.from_url(redis_url)
    keys = CrawlKeys("nofollow")
    seq = iter(range(1, 100))

    def put(payload: bytes, score: float = 0) -> None:
        client.zadd(keys.queue, {next(seq).to_bytes(6, "big") + payload: score})

    from scrapy import Request

    put(encode_request(Request(site.page_url(1))))
    put(b"garbage")  # no version byte
    put(b"\x01" + msgpack.packb({"u": "file:///etc/passwd"}))  # scheme not allowed
    put(b"\x01" + msgpack.packb({"u": site.page_url(2), "cb": "_private"}))  # private callback
    put(b"\x01" + msgpack.packb([1, 2, 3]))  # not a map
    put(b"\x01\xc1")  # invalid msgpack
    put(b"\x01" + msgpack.packb({"u": site.page_url(3), "h": [[b"X-A", [b"a\r\nInjected: 1"]]]}))
    put(encode_request(Request(site.page_url(4), priority=-1)), score=1)
    client.zadd(keys.queue, {b"x": 0})  # too short to even hold a sequence number
    project = make_project(tmp_path, {"REDIS_URL": redis_url}, spiders=SPIDERS_WITH_META)
    project.crawl("nofollow", args={"urls": site.page_url(5)})
    assert project.wait_all(60) == [0], project.logs()[-3000:]
    fetched = set(site.fetch_counts())
    assert fetched == {"/page/1", "/page/4", "/page/5"}
    import json

    records = [json.loads(r) for r in client.lrange(keys.queue_rejected, 0, -1)]
    reasons = sorted(r["reason"] for r in records)
    assert reasons == sorted(
        ["bad_version", "bad_scheme", "bad_callback", "bad_payload", "bad_msgpack", "header_injection",
         "bad_version"]
    ), reasons
    assert all(r["worker"] and r["at"] > 0 and "raw" in r for r in records)
    stats = project.stats(0)
    assert stats["scheduler/rejected"] == 7
    assert stats["scheduler/unserializable"] == 1
    log = project.logs()
    assert "meta.handle" in log and "scheduler/unserializable" in log
    assert client.zcard(keys.leases) == 0


def test_non_persistent_crawl_removes_its_keys_when_finished(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    site = site_factory(pages=50)
    project = make_project(tmp_path, {"REDIS_URL": redis_url, "SCHEDULER_PERSIST": False})
    project.crawl(args={"seed": site.page_url(0)})
    assert project.wait_all(60) == [0], project.logs()[-3000:]
    assert len(site.fetch_counts()) == 50
    client = redis.Redis.from_url(redis_url)
    assert [k for k in client.keys("*") if b"{links}" in k] == []


def test_a_worker_without_the_addon_is_not_shown_lost_after_a_clean_close(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    # the two classic settings, no add-on: the scheduler runs ClusterStats itself, which marks the worker
    # closed, as with the add-on (without it, a worker that finished normally was shown lost)
    from scrapy_dist.monitor import read_status

    site = site_factory(pages=20)
    project = make_project(tmp_path, {"REDIS_URL": redis_url})
    project.crawl(args={"seed": site.page_url(0)})
    assert project.wait_all(60) == [0], project.logs()[-4000:]
    assert project.stats(0)["finish_reason"] == "finished"
    client = redis.Redis.from_url(redis_url)
    summary = read_status(client, LINKS)["workers_summary"]
    assert (summary["lost"], summary["closed"]) == (0, 1)
    client.close()
