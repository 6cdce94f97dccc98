"""Junk in the shared cookie jar: reads are incremental and bounded, a bad record is rejected
once, not at every refresh, and garbage versions do not stop the writers. Real Redis, time injected."""

from __future__ import annotations

import json
from typing import Any

import redis
import redis.asyncio
from helpers import run
from scrapy import Request
from scrapy.http import Response
from scrapy.utils.test import get_crawler

from scrapy_dist.middlewares import SharedCookiesMiddleware
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.settings import CookieSettings

KEYS = CrawlKeys("shop")
SITE = "http://shop.example"
JAR = KEYS.cookie_jar("default")
CHANGES = KEYS.cookie_changes("default")
JUNK = '{"name": 5, "domain": "x", "path": "/"}'


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def worker(url: str, clock: Clock, **kw: Any) -> SharedCookiesMiddleware:
    return SharedCookiesMiddleware(
        redis.asyncio.Redis.from_url(url), KEYS, CookieSettings(flush_interval=0.001),
        stats=get_crawler().stats, monotonic=clock, **kw,
    )


async def fetch(mw: SharedCookiesMiddleware, path: str, set_cookie: list[str] | None = None) -> str:
    request = Request(f"{SITE}{path}")
    await mw.process_request(request)
    headers = {"Set-Cookie": set_cookie} if set_cookie else {}
    await mw.process_response(request, Response(request.url, headers=headers, request=request))
    return b"; ".join(request.headers.getlist("Cookie")).decode()


def plant(client: redis.Redis, n: int, versioned: bool, first_version: int = 1) -> None:
    pipe = client.pipeline(transaction=False)
    for i in range(n):
        pipe.hset(JAR, f"junk{i}", JUNK)
        if versioned:
            pipe.zadd(CHANGES, {f"junk{i}": first_version + i})
    pipe.execute()


def test_junk_written_straight_into_the_jar_is_never_read(redis_url: str, redis_client: redis.Redis) -> None:
    plant(redis_client, 20_000, versioned=False)
    clock = Clock()

    async def scenario() -> None:
        a, b = worker(redis_url, clock), worker(redis_url, clock)
        await fetch(a, "/login", ["session=abc; Path=/"])
        for _ in range(5):  # five refreshes
            clock.t += 1.5
            assert await fetch(b, "/") == "session=abc"
        assert b.stats.get_value("cookies/shared/loads") == 5
        assert b.stats.get_value("cookies/shared/rejected") is None
        await a.spider_closed()
        await b.spider_closed()

    run(scenario())


def test_junk_logged_as_changes_is_read_a_page_at_a_time_and_rejected_once(
    redis_url: str, redis_client: redis.Redis
) -> None:
    plant(redis_client, 2_500, versioned=True)
    clock = Clock()

    async def scenario() -> None:
        a = worker(redis_url, clock, read_limit=1000)
        b = worker(redis_url, clock, read_limit=1000)
        # the first reads catch up, 1,000 changes each, then the copy is fresh for cache_seconds
        for expected in (1000, 2000, 2500, 2500):
            await fetch(b, "/")
            assert b.stats.get_value("cookies/shared/rejected") == expected
        assert b.stats.get_value("cookies/shared/loads") == 3
        # a real cookie arrives: the next refresh reads it alone, the junk is not parsed again
        await fetch(a, "/login", ["session=abc; Path=/"])
        clock.t += 1.5
        assert await fetch(b, "/") == "session=abc"
        assert b.stats.get_value("cookies/shared/rejected") == 2500
        await a.spider_closed()
        await b.spider_closed()

    run(scenario())


def test_garbage_versions_do_not_stop_the_writers(redis_url: str, redis_client: redis.Redis) -> None:
    redis_client.zadd(CHANGES, {"huge": 1e300, "inf": float("inf"), "negative": -5})
    clock = Clock()

    async def scenario() -> None:
        a, b = worker(redis_url, clock), worker(redis_url, clock)
        await fetch(a, "/login", ["session=abc; Path=/"])
        assert await fetch(b, "/") == "session=abc"
        await fetch(a, "/login", ["session=def; Path=/"])
        clock.t += 1.5
        assert await fetch(b, "/") == "session=def"
        await a.spider_closed()
        await b.spider_closed()

    run(scenario())
    versions = redis_client.zrange(CHANGES, 0, -1, withscores=True)
    assert [member for member, _ in versions] == [b'["shop.example","/","session"]']
    assert json.loads(redis_client.hget(JAR, '["shop.example","/","session"]'))["value"] == "def"


def test_a_reader_ahead_of_the_jar_starts_afresh_when_the_keys_were_recreated(
    redis_url: str, redis_client: redis.Redis
) -> None:
    clock = Clock()

    async def scenario() -> None:
        a, b = worker(redis_url, clock), worker(redis_url, clock)
        for i in range(3):
            await fetch(a, f"/{i}", [f"c{i}=1; Path=/"])
        assert sorted((await fetch(b, "/")).split("; ")) == ["c0=1", "c1=1", "c2=1"]
        redis_client.delete(JAR, CHANGES)  # an operator clears the jar; a new login writes it again
        await fetch(a, "/login", ["fresh=1; Path=/"])
        clock.t += 1.5
        assert await fetch(b, "/") == "fresh=1"
        await a.spider_closed()
        await b.spider_closed()

    run(scenario())


def test_the_cookie_scripts_run_on_a_cluster(cluster: Any) -> None:
    """Every key of a jar carries the crawl's hash tag: the read and write scripts run on Redis Cluster."""
    from scrapy_dist.redis.connection import get_async_redis

    cluster.flushall()
    clock = Clock()

    async def scenario() -> None:
        def on_cluster() -> SharedCookiesMiddleware:
            return SharedCookiesMiddleware(
                get_async_redis({"REDIS_URL": cluster.url}), KEYS, CookieSettings(flush_interval=0.001),
                stats=get_crawler().stats, monotonic=clock,
            )

        a, b = on_cluster(), on_cluster()
        await fetch(a, "/login", ["session=abc; Path=/"])
        assert await fetch(b, "/") == "session=abc"
        await fetch(a, "/logout", ["session=; Path=/; Expires=Thu, 01 Jan 1970 00:00:00 GMT"])
        clock.t += 1.5
        assert await fetch(b, "/") == ""
        await a.spider_closed()
        await b.spider_closed()

    run(scenario())
