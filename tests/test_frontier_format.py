"""Workers of two scrapy-dist versions that lay the frontier out differently never run one crawl together:
the control hash records the newest frontier format that joined; an older worker is refused, and a newer
one is refused while workers of the older format are running (they would reject its entries as garbage).
A control hash of another Redis type is moved aside at start instead of failing every worker."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import redis
from helpers import run
from scrapy import Request, Spider
from scrapy.utils.test import get_crawler

from scrapy_dist.frontier.layout import FRONTIER_FORMAT
from scrapy_dist.frontier.scheduler import Scheduler
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.settings.reader import start_error

KEYS = CrawlKeys("fmt")


class _Spider(Spider):
    name = "fmt"

    def parse(self, response: Any) -> None:  # pragma: no cover - never called
        pass


async def _open(redis_url: str) -> Scheduler:
    crawler = get_crawler(_Spider, {"REDIS_URL": redis_url, "SCHEDULER_LEASE_SECONDS": 30,
                                    "DUPEFILTER_CLASS": "scrapy_dist.dupefilter.BloomDupeFilter",
                                    "BLOOMFILTER_CAPACITY": 10_000})
    crawler.spider = crawler._create_spider()
    sched = Scheduler.from_crawler(crawler)
    await sched.open_async(crawler.spider, start=False)
    return sched


def _joins(redis_url: str) -> None:
    async def go() -> None:
        s = await _open(redis_url)
        assert s.loop is not None
        s.enqueue_request(Request(f"http://site.test/{time.monotonic_ns()}"))
        await s.loop.round(lease=1, renew=False)  # the frontier works: the request comes back leased
        assert s.next_request() is not None
        await s.redis.aclose()

    run(go())


async def _refused(redis_url: str) -> None:
    sched = await _open(redis_url)  # inside the loop, as scrapy's own start-up sees it
    assert sched.refused and sched.loop is None and start_error(sched.crawler) is not None


def test_the_first_worker_records_its_format_and_the_next_ones_join(
    redis_url: str, redis_client: redis.Redis
) -> None:
    _joins(redis_url)
    assert redis_client.hget(KEYS.control, "format") == str(FRONTIER_FORMAT).encode()
    _joins(redis_url)


def test_an_older_worker_is_refused_by_a_crawl_of_a_newer_format(
    redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    redis_client.hset(KEYS.control, "format", FRONTIER_FORMAT + 1)
    with caplog.at_level(logging.ERROR):
        run(_refused(redis_url))
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert f"newer scrapy-dist (frontier format {FRONTIER_FORMAT + 1}" in line
    assert "upgrade this worker" in line
    assert redis_client.hget(KEYS.control, "format") == str(FRONTIER_FORMAT + 1).encode()


def test_an_upgraded_worker_waits_for_the_older_workers_to_stop(
    redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    older = FRONTIER_FORMAT - 1
    redis_client.hset(KEYS.control, "format", older)
    redis_client.zadd(KEYS.workers, {"old-worker": time.time() - 5})  # seen 5 s ago: still running
    with caplog.at_level(logging.ERROR):
        run(_refused(redis_url))
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert f"1 worker(s) of an older scrapy-dist running (frontier format {older}" in line
    assert redis_client.hget(KEYS.control, "format") == str(older).encode()
    # once the old worker is gone (not seen for longer than a lease), the crawl is upgraded
    redis_client.zadd(KEYS.workers, {"old-worker": time.time() - 31})
    _joins(redis_url)
    assert redis_client.hget(KEYS.control, "format") == str(FRONTIER_FORMAT).encode()


@pytest.mark.parametrize("garbage", ["two", "-1", "0", "99999999999999999999", "\xff\x00"])
def test_garbage_in_the_format_field_is_overwritten_with_a_warning(
    redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture, garbage: str
) -> None:
    redis_client.hset(KEYS.control, "format", garbage.encode("latin-1"))
    with caplog.at_level(logging.WARNING):
        _joins(redis_url)
    assert redis_client.hget(KEYS.control, "format") == str(FRONTIER_FORMAT).encode()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("field format holds" in w and "not a frontier format" in w for w in warnings)


@pytest.mark.parametrize("key", ["control", "workers"])
def test_a_control_or_workers_key_of_another_type_does_not_stop_the_start(
    redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture, key: str
) -> None:
    name = getattr(KEYS, key)
    redis_client.set(name, "someone else's")
    with caplog.at_level(logging.WARNING):
        _joins(redis_url)
    assert redis_client.type(KEYS.control) == b"hash"
    assert redis_client.hget(KEYS.control, "format") == str(FRONTIER_FORMAT).encode()
    assert redis_client.get(f"{name}:garbage") == b"someone else's"  # kept aside, not deleted
