"""Records in the shared cookie jar obey the crawl's rules for cookies: with a secret, a record the workers
did not write (the cookie script is public) is not sent, unless untrusted entries may set cookies."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import redis
import redis.asyncio
from helpers import run
from scrapy import Request
from scrapy.http import Response
from scrapy.utils.test import get_crawler

from scrapy_dist.middlewares import SharedCookiesMiddleware
from scrapy_dist.middlewares.cookies import RecordSeal, cookie_field, write_calls
from scrapy_dist.redis import scripts
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.settings import CookieSettings

KEYS = CrawlKeys("shop")
SITE = "http://shop.example"
SECRET = b"the-crawl-secret"
PLANTED = {"name": "session", "value": "attacker-session-id", "domain": "shop.example", "path": "/"}


def plant(client: redis.Redis, record: dict[str, Any], keys: CrawlKeys = KEYS) -> None:
    """Write ``record`` as anyone may: with the public ``cookies_write`` script, a new version and all."""
    field = cookie_field((record["domain"], record["path"], record["name"]))
    script = scripts.register(client, "cookies_write")
    calls, _ = write_calls(keys, [("default", field, json.dumps(record))], str(time.time()))
    for k, a in calls:
        script(keys=k, args=a)


def worker(url: str, seal: RecordSeal) -> SharedCookiesMiddleware:
    return SharedCookiesMiddleware(
        redis.asyncio.Redis.from_url(url), KEYS, CookieSettings(flush_interval=0.01),
        stats=get_crawler().stats, seal=seal,
    )


async def sent_by(mw: SharedCookiesMiddleware, path: str = "/", set_cookie: list[str] | None = None) -> str:
    request = Request(f"{SITE}{path}")
    await mw.process_request(request)
    headers = {"Set-Cookie": set_cookie} if set_cookie else {}
    await mw.process_response(request, Response(request.url, headers=headers, request=request))
    return b"; ".join(request.headers.getlist("Cookie")).decode()


def _crawl_worker(url: str) -> SharedCookiesMiddleware:
    """A worker's middleware as a crawl with a secret builds it."""
    crawler = get_crawler(settings_dict={"REDIS_URL": url, "SCHEDULER_ENTRY_SECRET": SECRET.decode(),
                                         "REDIS_KEY_PREFIX": "", "REDIS_COOKIES_FLUSH_INTERVAL": 0.01})
    mw = SharedCookiesMiddleware.from_crawler(crawler)
    mw.keys = KEYS
    return mw


def test_a_planted_record_is_not_sent_when_the_crawl_has_a_secret(
    redis_url: str, redis_client: redis.Redis
) -> None:
    plant(redis_client, PLANTED)

    async def scenario() -> tuple[str, str, Any]:
        a, b = _crawl_worker(redis_url), _crawl_worker(redis_url)
        first = await sent_by(a)
        await sent_by(a, "/login", ["session=worker-session; Path=/"])  # a worker's own record: sealed
        second = await sent_by(b)
        rejected = a.stats.get_value("cookies/shared/rejected")
        await a.spider_closed()
        await b.spider_closed()
        return first, second, rejected

    first, second, rejected = run(scenario())
    assert first == "" and rejected == 1  # session fixation refused
    assert second == "session=worker-session"


@pytest.mark.parametrize("tamper", ["value", "jar", "tag"])
def test_a_sealed_record_changed_or_moved_does_not_verify(
    redis_url: str, redis_client: redis.Redis, tamper: str
) -> None:
    seal = RecordSeal(SECRET, False)
    field = cookie_field(("shop.example", "/", "session"))
    record = json.loads(seal.seal(KEYS.cookie_jar("default"), field, PLANTED))
    if tamper == "value":
        record["value"] = "attacker"
    elif tamper == "tag":
        record["tag"] = "0" * 32
    other = CrawlKeys("other") if tamper == "jar" else KEYS  # a record of another crawl, copied over
    if tamper == "jar":
        record = json.loads(seal.seal(other.cookie_jar("default"), field, PLANTED))
    plant(redis_client, record)

    async def scenario() -> str:
        mw = worker(redis_url, seal)
        out = await sent_by(mw)
        await mw.spider_closed()
        return out

    assert run(scenario()) == ""


def test_without_a_secret_or_with_cookies_allowed_records_are_believed(
    redis_url: str, redis_client: redis.Redis
) -> None:
    plant(redis_client, PLANTED)

    async def scenario(seal: RecordSeal) -> str:
        mw = worker(redis_url, seal)
        out = await sent_by(mw)
        await mw.spider_closed()
        return out

    assert run(scenario(RecordSeal())) == "session=attacker-session-id"  # as every queue entry, then
    assert run(scenario(RecordSeal(SECRET, True))) == "session=attacker-session-id"  # SEEDS_HEADERS_ALLOWED


def test_from_crawler_takes_the_crawl_s_secret_and_cookie_rule(redis_url: str) -> None:
    mw = _crawl_worker(redis_url)
    assert mw.seal == RecordSeal(SECRET, False)
    run(mw.server.aclose())
