"""The scheduler's background loop against a real Redis: a hostile queue entry is parked and the worker
goes on; an unexpected error in a round is logged once and the loop goes on; a loop that dies closes the
worker with a reason instead of leaving it hanging without a frontier."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from typing import Any

import msgpack
import pytest
import redis
from helpers import run
from scrapy import Request, Spider
from scrapy.utils.test import get_crawler

from scrapy_dist.frontier.engine import Engine
from scrapy_dist.frontier.layout import ShardRouter
from scrapy_dist.frontier.ledger import Ledger
from scrapy_dist.frontier.scheduler import Scheduler
from scrapy_dist.frontier.shard import SyncBatch, SyncResult
from scrapy_dist.frontier.syncloop import FAILED_REASON, SyncLoop
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.redis.outage import Backoff
from scrapy_dist.settings import SchedulerSettings

KEYS = CrawlKeys("loop")


class _Spider(Spider):
    name = "loop"

    def parse(self, response: Any) -> None:  # pragma: no cover - never called
        pass


async def _until(predicate: Any, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def _member(seq: int, fields: dict[str, Any]) -> bytes:
    """A single queue member as anyone with write access could ZADD it."""
    return seq.to_bytes(6, "big") + b"\x01" + msgpack.packb(fields)


@pytest.mark.parametrize("bad", [{"cb": [1, 2]}, {"eb": {"x": 1}}, {"M": {"k": {1: 2}}, "cb": 7}])
def test_a_hostile_entry_is_parked_and_the_worker_goes_on_leasing(
    bad: dict[str, Any], redis_url: str, redis_client: redis.Redis
) -> None:
    redis_client.zadd(KEYS.queue, {_member(1, {"u": "http://site.test/bad", **bad}): 0})
    redis_client.zadd(KEYS.queue, {_member(2, {"u": "http://site.test/good"}): 0})

    async def go() -> list[str]:
        crawler = get_crawler(_Spider, {"REDIS_URL": redis_url, "SCHEDULER_IDLE_POLL": 0.05})
        crawler.spider = crawler._create_spider()
        sched = Scheduler.from_crawler(crawler)
        await sched.open_async(crawler.spider)
        got: list[str] = []

        def served() -> bool:
            r = sched.next_request()
            if r is not None:
                got.append(r.url)
            return bool(got) and redis_client.llen(KEYS.queue_rejected) == 1

        await _until(served)
        # the loop is alive: a request enqueued now is sent and leased back
        sched.enqueue_request(Request("http://site.test/later"))
        await _until(lambda: (r := sched.next_request()) is not None and bool(got.append(r.url)) is False)
        await sched.close_async("finished")
        return got

    assert run(go()) == ["http://site.test/good", "http://site.test/later"]
    [record] = redis_client.lrange(KEYS.queue_rejected, 0, -1)
    parsed = json.loads(record)
    assert parsed["reason"].startswith("bad_") and parsed["raw_encoding"] == "base64"
    assert b"site.test/bad" in base64.b64decode(parsed["raw"])
    assert redis_client.zcard(KEYS.leases) == 0  # the rejected entry's lease was dropped too


class _Escaped(BaseException):
    """Not an Exception: what no handler in the loop catches."""


class _FailingFrontier:
    """Stands in for a frontier whose calls fail (not for Redis: these errors never come from it)."""

    def __init__(self, error: BaseException, times: int) -> None:
        self.error, self.times, self.calls = error, times, 0

    async def sync(self, batch: SyncBatch) -> SyncResult:
        self.calls += 1
        if self.calls <= self.times:
            raise self.error
        return SyncResult([False] * len(batch.enqueue), [], 0, 0, 0, 0, 0, 0, False)

    async def own_leases(self, limit: int) -> list[bytes]:
        return []  # its failed calls granted nothing


def _loop(frontier: _FailingFrontier, engine: Engine) -> SyncLoop:
    return SyncLoop(
        Ledger(), ShardRouter(1), [frontier], engine,  # type: ignore[list-item]
        decode=lambda shard, member: Request("http://x"), on_applied=lambda a, r: None,
        config=SchedulerSettings(prefetch=64, flush_interval=0.01, flush_batch=500, idle_poll=0.01,
                                 lease_seconds=60.0),
        backoff=Backoff(first=0.01, cap=0.01),
    )


def test_an_unexpected_error_is_logged_once_and_the_loop_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine()
    frontier = _FailingFrontier(ValueError("a bug"), times=3)
    loop = _loop(frontier, engine)

    async def go() -> None:
        loop.start()
        await _until(lambda: loop.state is not None)
        await loop.stop()

    with caplog.at_level(logging.ERROR, logger="scrapy_dist.frontier.syncloop"):
        run(go())
    assert frontier.calls >= 4 and engine.closed is None
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None


def test_a_loop_that_dies_closes_the_worker_with_a_reason(caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine()
    loop = _loop(_FailingFrontier(_Escaped("escaped"), times=1), engine)

    async def go() -> None:
        loop.start()
        await _until(lambda: engine.closed is not None)

    with caplog.at_level(logging.CRITICAL, logger="scrapy_dist.frontier.syncloop"):
        run(go())
    assert engine.closed == FAILED_REASON
    assert "frontier loop stopped unexpectedly" in caplog.text


def test_a_callback_request_of_higher_priority_is_served_before_leased_ones(redis_url: str) -> None:
    """Scrapy's priority contract with one worker: what a callback schedules at a higher priority is
    started before the lower-priority requests this worker has already leased."""

    async def go() -> list[int]:
        crawler = get_crawler(_Spider, {"REDIS_URL": redis_url, "SCHEDULER_PREFETCH": 10})
        crawler.spider = crawler._create_spider()
        sched = Scheduler.from_crawler(crawler)
        await sched.open_async(crawler.spider, start=False)
        assert sched.loop is not None
        for i in range(10):
            sched.enqueue_request(Request(f"http://site.test/low/{i}"))
        await sched.loop.round(lease=10, renew=False)
        first = sched.next_request()
        assert first is not None and first.priority == 0
        for p in (1, 2, 3, 4, 5, 6):  # what its callback found
            sched.enqueue_request(Request(f"http://site.test/p{p}", priority=p))
        assert sched.next_request() is None  # the engine waits for the round, not for a worse request
        due, lease = sched.loop.due(time.monotonic())
        assert due and lease >= 6
        await sched.loop.round(lease, renew=False)
        order = [r.priority for r in iter(sched.next_request, None)]
        await sched.close_async("shutdown")
        return order

    assert run(go()) == [6, 5, 4, 3, 2, 1] + [0] * 9


async def _opened(redis_url: str, **settings: Any) -> Scheduler:
    crawler = get_crawler(
        _Spider, {"REDIS_URL": redis_url, "DUPEFILTER_CLASS": "scrapy_dist.dupefilter.BloomDupeFilter",
                  "BLOOMFILTER_CAPACITY": 10_000, **settings},
    )
    crawler.spider = crawler._create_spider()
    sched = Scheduler.from_crawler(crawler)
    await sched.open_async(crawler.spider, start=False)
    return sched


def test_joining_a_crawl_says_what_it_resumes_or_that_it_has_finished(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def go() -> None:
        first = await _opened(redis_url)
        assert first.loop is not None
        for i in range(3):
            first.enqueue_request(Request(f"http://site.test/{i}"))
        await first.loop.round(lease=0, renew=False)
        await first.redis.aclose()
        caplog.clear()
        second = await _opened(redis_url)
        assert "Resuming crawl (3 requests scheduled)" in caplog.text
        assert second.loop is not None
        await second.loop.round(lease=10, renew=False)
        while second.next_request() is not None:
            pass
        second.loop.collect_finished(0.0)
        await second.loop.round(lease=0, renew=False)
        await second.redis.aclose()
        caplog.clear()
        third = await _opened(redis_url)
        await third.redis.aclose()

    with caplog.at_level(logging.INFO):
        run(go())
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "has run before and finished: 3 fingerprints are remembered" in warning.getMessage()
    assert "SCHEDULER_FLUSH_ON_START" in warning.getMessage()


def test_a_backlog_reaches_redis_in_short_calls_and_all_of_it_lands(redis_url: str) -> None:
    """An outage's backlog (500 discovered requests) goes in calls of at most CALL_RECORDS, CALLS_PER_ROUND
    of them per round (sent together), every one of them lands, and the seeds' "flushed" mark moves only
    once the last part is in Redis."""
    from scrapy_dist.frontier.shard import CALL_RECORDS, CALLS_PER_ROUND

    async def go() -> tuple[list[int], int, list[bool]]:
        sched = await _opened(redis_url)
        assert sched.loop is not None
        sizes: list[int] = []
        frontier = sched.frontiers[0]
        real = frontier.sync

        async def counting(batch: SyncBatch, now: float | None = None) -> SyncResult:
            sizes.append(len(batch.enqueue))
            return await real(batch, now)

        frontier.sync = counting  # type: ignore[method-assign]
        mark = time.monotonic()
        for i in range(500):
            sched.enqueue_request(Request(f"http://site.test/backlog/{i}"))
        flushed = []
        while True:
            await sched.loop.round(lease=0, renew=False)
            flushed.append(sched.flushed_since(mark))
            if not sched.ledger.left_behind:
                break
        count = await sched.redis.hget(sched.keys.queue_tails, "count")
        await sched.redis.aclose()
        return sizes, int(count), flushed

    sizes, queued, flushed = run(go())
    assert max(sizes) == CALL_RECORDS and sum(sizes) == 500
    assert len(sizes) == -(-500 // CALL_RECORDS) and CALLS_PER_ROUND * CALL_RECORDS < 500
    assert queued == 500
    assert flushed == [False, True]  # two rounds: 8 calls, then the remaining 3


def test_a_redis_that_lost_the_crawls_data_is_said_once(
    redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis restarted empty (no persistence) mid-crawl: the workers carried on without a word, the
    frontier and the bloom filter gone. The shard's sequence number going down tells it: one WARNING."""

    async def go() -> None:
        crawler = get_crawler(_Spider, {"REDIS_URL": redis_url, "SCHEDULER_IDLE_POLL": 0.05,
                                        "DUPEFILTER_CLASS": "scrapy_dist.dupefilter.BloomDupeFilter",
                                        "BLOOMFILTER_CAPACITY": 10_000})
        crawler.spider = crawler._create_spider()
        sched = Scheduler.from_crawler(crawler)
        await sched.open_async(crawler.spider)
        got: list[str] = []

        def served(n: int) -> bool:
            r = sched.next_request()
            if r is not None:
                got.append(r.url)
            return len(got) >= n

        for i in range(3):
            sched.enqueue_request(Request(f"http://site.test/{i}"))
        await _until(lambda: served(3))
        redis_client.flushdb()  # what a restart without persistence leaves
        sched.enqueue_request(Request("http://site.test/after"))
        await _until(lambda: served(4))
        sched.enqueue_request(Request("http://site.test/later"))
        await _until(lambda: served(5))
        # the filter that knew site.test/0 is gone: the worker's memory of having sent it went with it, so
        # a link to it found now is crawled again (it was skipped in this process, and lost crawl-wide)
        assert sched.enqueue_request(Request("http://site.test/0"))
        await _until(lambda: served(6))
        await sched.close_async("finished")

    with caplog.at_level(logging.WARNING, logger="scrapy_dist.frontier.syncloop"):
        run(go())
    said = [r.getMessage() for r in caplog.records if "went back in time" in r.getMessage()]
    assert len(said) == 1, said
    assert "sequence number fell from 3 to 1" in said[0]


class _AnswerLost:
    """A frontier whose next call runs in Redis but whose answer never arrives (Redis stopped, or the
    connection broke, after the script ran): the real frontier, and the error the client would raise."""

    def __init__(self, frontier: Any) -> None:
        self.frontier = frontier

    async def sync(self, batch: SyncBatch) -> SyncResult:
        await self.frontier.sync(batch)
        raise redis.exceptions.ConnectionError("Connection closed by server.")


@pytest.mark.parametrize("politeness", ["process", "cluster"])
def test_leases_granted_by_a_call_whose_answer_was_lost_are_given_back_at_once(
    politeness: str, redis_url: str, redis_client: redis.Redis
) -> None:
    """The next round gives back the leases the lost answer named, so their requests are leased again now,
    not when their leases run out; the leases the worker knows of stay its own."""

    async def go() -> tuple[set[bytes], set[bytes], list[str], set[bytes]]:
        sched = await _opened(redis_url, SCHEDULER_PREFETCH=4, SCHEDULER_POLITENESS=politeness)
        loop = sched.loop
        assert loop is not None
        for i in range(8):
            sched.enqueue_request(Request(f"http://site{i}.test/"))
        assert await loop.round(lease=2, renew=False) is None
        known = {member for _, member in sched.ledger.held}
        real = loop.frontiers[0]
        loop.frontiers[0] = _AnswerLost(real)  # type: ignore[assignment]
        assert await loop.round(lease=3, renew=False) is not None
        assert redis_client.zcard(KEYS.leases) == 5  # granted in Redis, unknown to the worker
        loop.frontiers[0] = real
        assert await loop.round(lease=3, renew=False) is None
        urls = [r.url for r in iter(sched.next_request, None)]
        in_redis = set(redis_client.zrange(KEYS.leases, 0, -1))
        held = {member for _, member in sched.ledger.held}
        await sched.close_async("shutdown")
        return known, held, urls, in_redis

    known, held, urls, in_redis = run(go())
    assert known <= held
    assert in_redis == held and len(held) == 5  # every lease in Redis is one the worker holds
    assert len(urls) == 5 and len(set(urls)) == 5
