"""A worker's memory of the links it sent (scrapy_dist/dupefilter/__init__.py) must not hide what the
crawl-wide filter forgets: ``DUPEFILTER_TTL``, ``DEADLETTER_FORGET`` and ``scrapy-dist forget`` make URLs
new again, also for the worker that had found them before."""

from __future__ import annotations

import time
from typing import Any, cast

import pytest
from helpers import open_bloom_scheduler, run
from scrapy import Request

from scrapy_dist.dupefilter import RECENT_MAX_AGE, RecentFingerprints
from scrapy_dist.frontier.scheduler import Scheduler


def test_a_sent_fingerprint_is_trusted_for_at_most_max_age() -> None:
    recent = RecentFingerprints(max_age=10)
    assert not recent.seen("a", now=100.0)  # first time: sent
    assert recent.seen("a", now=104.0)
    assert recent.seen("a", now=109.0)  # rotated once at 105: still in the previous generation
    assert not recent.seen("a", now=115.0)  # at most 10 s: sent again
    assert recent.seen("a", now=116.0)


def test_no_memory_at_all_with_max_age_zero_and_discard() -> None:
    none = RecentFingerprints(max_age=0)
    assert not none.seen("a", 1.0) and not none.seen("a", 1.0) and len(none) == 0
    recent = RecentFingerprints(max_age=60)
    recent.add("b", 1.0)
    recent.discard("b")
    assert not recent.seen("b", 2.0)


async def _opened(redis_url: str, **settings: Any) -> Scheduler:
    return cast("Scheduler", await open_bloom_scheduler(redis_url, "recent", **settings))


def _queued(sched: Scheduler) -> int:
    return int(sched.stats.get_value("scheduler/enqueued/redis", 0))


def test_the_worker_that_dead_lettered_a_url_fetches_it_again_when_it_finds_it(redis_url: str) -> None:
    async def go() -> tuple[int, int]:
        sched = await _opened(redis_url, DEADLETTER_FORGET=True)
        assert sched.loop is not None
        sched.enqueue_request(Request("http://site.test/dead"))
        await sched.loop.round(lease=0, renew=False)
        sched.dead_letter('{"u": "http://site.test/dead"}', Request("http://site.test/dead"))
        await sched.loop.round(lease=0, renew=False)
        before = _queued(sched)
        sched.enqueue_request(Request("http://site.test/dead"))  # the same worker finds a link to it
        await sched.loop.round(lease=0, renew=False)
        await sched.redis.aclose()
        return before, _queued(sched)

    before, after = run(go())
    assert after == before + 1


@pytest.mark.parametrize("dupefilter", ["BloomDupeFilter", "SetDupeFilter"])
def test_with_a_ttl_the_same_worker_fetches_a_url_again_once_the_filter_forgot_it(
    redis_url: str, dupefilter: str
) -> None:
    ttl = 1.0  # bloom: new again 1 to 1.33 s after it was seen; set: exactly 1 s after

    async def go() -> tuple[int, int, float]:
        sched = await _opened(redis_url, DUPEFILTER_TTL=ttl,
                              DUPEFILTER_CLASS=f"scrapy_dist.dupefilter.{dupefilter}")
        assert sched.loop is not None
        sched.enqueue_request(Request("http://site.test/page"))
        await sched.loop.round(lease=0, renew=False)
        sched.enqueue_request(Request("http://site.test/page"))  # a link found at once: a duplicate
        await sched.loop.round(lease=0, renew=False)
        first = _queued(sched)
        time.sleep(ttl * 4 / 3 + 0.2)
        sched.enqueue_request(Request("http://site.test/page"))  # found again by the same worker
        await sched.loop.round(lease=0, renew=False)
        await sched.redis.aclose()
        return first, _queued(sched), getattr(sched.encoder.recent, "max_age", -1)

    first, second, max_age = run(go())
    assert first == 1
    assert second == 2
    assert 0 <= max_age <= ttl / 3 / 4


def test_without_a_ttl_a_worker_skips_links_it_sent_within_a_minute(redis_url: str) -> None:
    async def go() -> tuple[bool, float]:
        sched = await _opened(redis_url)
        sched.enqueue_request(Request("http://site.test/a"))
        skipped = not sched.enqueue_request(Request("http://site.test/a"))  # no trip to Redis
        await sched.redis.aclose()
        return skipped, sched.encoder.recent.max_age

    assert run(go()) == (True, RECENT_MAX_AGE)


def test_scrapy_dist_forget_reaches_a_running_workers_memory_at_its_next_sync(redis_url: str) -> None:
    from click.testing import CliRunner

    from scrapy_dist.cli import main

    async def go() -> tuple[int, int, int]:
        sched = await _opened(redis_url)
        assert sched.loop is not None
        sched.enqueue_request(Request("http://site.test/forget-me"))
        await sched.loop.round(lease=0, renew=False)
        sched.enqueue_request(Request("http://site.test/forget-me"))  # remembered: skipped
        await sched.loop.round(lease=0, renew=False)
        first = _queued(sched)
        result = CliRunner().invoke(
            main, ["--redis-url", redis_url, "forget", "recent", "--force", "http://site.test/forget-me"],
            env={"SCRAPY_SETTINGS_MODULE": None},
        )
        assert result.exit_code == 0, result.output
        await sched.loop.round(lease=0, renew=False)  # the next sync: it answers the new forget token
        sched.enqueue_request(Request("http://site.test/forget-me"))  # found again by the same worker
        await sched.loop.round(lease=0, renew=False)
        second = _queued(sched)
        sched.enqueue_request(Request("http://site.test/forget-me"))  # and remembered again afterwards
        await sched.loop.round(lease=0, renew=False)
        await sched.redis.aclose()
        return first, second, _queued(sched)

    assert run(go()) == (1, 2, 2)


async def _leased_by_another_worker(
    redis_url: str, url: str, dont_filter: bool = False, **settings: Any
) -> tuple[Scheduler, Request]:
    """Worker A finds ``url`` and sends it; worker B (returned) leases it and hands it to its engine."""
    a = await _opened(redis_url, **settings)
    assert a.loop is not None
    a.enqueue_request(Request(url, dont_filter=dont_filter))
    await a.loop.round(lease=0, renew=False)
    await a.redis.aclose()
    b = await _opened(redis_url, **settings)
    assert b.loop is not None
    await b.loop.round(lease=4, renew=False)
    request = b.next_request()
    assert request is not None and request.url == url
    return b, request


def test_a_worker_drops_links_to_a_page_it_was_handed_without_asking_redis(redis_url: str) -> None:
    async def go() -> tuple[bool, bool]:
        b, _ = await _leased_by_another_worker(redis_url, "http://site.test/leased")
        skipped = not b.enqueue_request(Request("http://site.test/leased"))  # a page linking back to it
        other = b.enqueue_request(Request("http://site.test/not-leased"))
        await b.redis.aclose()
        return skipped, other

    assert run(go()) == (True, True)


def test_a_page_handed_out_then_dead_lettered_and_forgotten_is_found_again(redis_url: str) -> None:
    async def go() -> tuple[int, int]:
        url = "http://site.test/dies"
        b, request = await _leased_by_another_worker(redis_url, url, DEADLETTER_FORGET=True)
        assert b.loop is not None
        b.dead_letter('{"u": "http://site.test/dies"}', request)
        await b.loop.round(lease=0, renew=False)
        before = _queued(b)
        b.enqueue_request(Request("http://site.test/dies"))  # new again crawl-wide, and for this worker
        await b.loop.round(lease=0, renew=False)
        await b.redis.aclose()
        return before, _queued(b)

    before, after = run(go())
    assert after == before + 1


def test_a_dont_filter_request_handed_out_is_not_remembered(redis_url: str) -> None:
    async def go() -> bool:
        b, request = await _leased_by_another_worker(redis_url, "http://site.test/again", dont_filter=True)
        assert request.dont_filter  # never in the filter: a link to it is checked crawl-wide
        sent = b.enqueue_request(Request("http://site.test/again"))
        await b.redis.aclose()
        return sent

    assert run(go()) is True
