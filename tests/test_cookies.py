"""SharedCookiesMiddleware: cookies one worker receives are sent by every worker; records read from Redis
are validated; end-to-end, a login on one ``scrapy crawl`` worker lets the other into private pages."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from http.cookiejar import Cookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
from crawlproject import make_project
from helpers import run
from hypothesis import given, settings
from hypothesis import strategies as st
from scrapy import Request, Spider
from scrapy.exceptions import NotConfigured
from scrapy.http import Response
from scrapy.utils.test import get_crawler

from scrapy_dist.middlewares import SharedCookiesMiddleware
from scrapy_dist.middlewares.cookies import cookie_from_record, cookie_record, jar_name
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.settings import CookieSettings

KEYS = CrawlKeys("shop")
SITE = "http://shop.example"


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def worker(url: str, clock: Clock | None = None, **kw: Any) -> SharedCookiesMiddleware:
    settings = CookieSettings(**{"flush_interval": 0.01, **kw})
    return SharedCookiesMiddleware(
        redis.asyncio.Redis.from_url(url), KEYS, settings, stats=get_crawler().stats,
        monotonic=clock or time.monotonic,
    )


async def fetch(
    mw: SharedCookiesMiddleware, url: str, set_cookie: list[str] | None = None, **meta: Any
) -> Request:
    """One request through the middleware; the response sets ``set_cookie``. Returns the sent request."""
    request = Request(url, meta=meta)
    assert await mw.process_request(request) is None
    headers = {"Set-Cookie": set_cookie} if set_cookie else {}
    response = Response(url, headers=headers, request=request)
    assert await mw.process_response(request, response) is response
    return request


def sent(request: Request) -> str:
    return b"; ".join(request.headers.getlist("Cookie")).decode()


# -- sharing -----------------------------------------------------------------------------------
def test_a_cookie_received_by_one_worker_is_sent_by_another(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario() -> None:
        a, b = worker(redis_url), worker(redis_url)
        # process_response returns only once the cookie is in Redis
        await fetch(a, f"{SITE}/login", ["session=abc; Path=/"])
        assert redis_client.hlen(KEYS.cookie_jar("default")) == 1
        assert redis_client.hexists(KEYS.cookies, "default")
        request = await fetch(b, f"{SITE}/private")
        assert sent(request) == "session=abc"
        # cookies from a different site are not sent
        assert sent(await fetch(b, "http://other.example/")) == ""
        await a.spider_closed()
        await b.spider_closed()

    run(scenario())


def test_reads_are_cached_for_cache_seconds(redis_url: str) -> None:
    clock = Clock()

    async def scenario() -> None:
        a, b = worker(redis_url), worker(redis_url, clock, cache_seconds=1.0)
        assert sent(await fetch(b, f"{SITE}/")) == ""  # b has read the (empty) jar
        await fetch(a, f"{SITE}/login", ["session=abc; Path=/"])
        clock.t += 0.5
        assert sent(await fetch(b, f"{SITE}/")) == ""  # still b's cached copy: no round trip
        assert b.stats.get_value("cookies/shared/loads") == 1
        clock.t += 0.6
        assert sent(await fetch(b, f"{SITE}/")) == "session=abc"
        assert b.stats.get_value("cookies/shared/loads") == 2
        await a.spider_closed()
        await b.spider_closed()

    run(scenario())


def test_concurrent_requests_share_one_read(redis_url: str) -> None:
    async def scenario() -> None:
        a, b = worker(redis_url), worker(redis_url)
        await fetch(a, f"{SITE}/login", ["session=abc; Path=/"])
        requests = await asyncio.gather(*(fetch(b, f"{SITE}/p/{i}") for i in range(20)))
        assert {sent(r) for r in requests} == {"session=abc"}
        assert b.stats.get_value("cookies/shared/loads") == 1
        await a.spider_closed()
        await b.spider_closed()

    run(scenario())


def test_changes_are_merged_per_cookie_and_deletions_propagate(redis_url: str) -> None:
    clock = Clock()

    async def scenario() -> None:
        a, b = worker(redis_url, clock), worker(redis_url, clock)
        c = worker(redis_url, clock)
        # a and b each set a different cookie from their own (stale, empty) copies: both survive
        await fetch(a, f"{SITE}/", ["one=1; Path=/"])
        await fetch(b, f"{SITE}/", ["two=2; Path=/"])
        assert sorted(sent(await fetch(c, f"{SITE}/")).split("; ")) == ["one=1", "two=2"]
        # a logs out: the server expires cookie "one"; c stops sending it once its cache expires
        await fetch(a, f"{SITE}/logout", ["one=; Path=/; Expires=Thu, 01 Jan 1970 00:00:00 GMT"])
        clock.t += 5
        assert sent(await fetch(c, f"{SITE}/")) == "two=2"
        for mw in (a, b, c):
            await mw.spider_closed()

    run(scenario())


def test_cookies_given_on_a_request_are_shared(redis_url: str) -> None:
    async def scenario() -> None:
        a, b = worker(redis_url), worker(redis_url)
        request = Request(f"{SITE}/", cookies={"lang": "en"})
        await a.process_request(request)
        assert sent(request) == "lang=en"
        await a.spider_closed()  # written in the background; close writes what is left
        assert sent(await fetch(b, f"{SITE}/other")) == "lang=en"
        await b.spider_closed()

    run(scenario())


def test_jars_are_separate_per_cookiejar_meta(redis_url: str) -> None:
    async def scenario() -> None:
        a, b = worker(redis_url), worker(redis_url)
        await fetch(a, f"{SITE}/login", ["user=alice; Path=/"], cookiejar=1)
        await fetch(a, f"{SITE}/login", ["user=bob; Path=/"], cookiejar="b")
        assert sent(await fetch(b, f"{SITE}/", cookiejar=1)) == "user=alice"
        assert sent(await fetch(b, f"{SITE}/", cookiejar="b")) == "user=bob"
        assert sent(await fetch(b, f"{SITE}/")) == ""
        assert a.jars[1] is not a.jars["b"]
        await a.spider_closed()
        await b.spider_closed()

    run(scenario())


def test_dont_merge_cookies_bypasses_the_jar(redis_url: str, redis_client: redis.Redis) -> None:
    async def scenario() -> None:
        a = worker(redis_url)
        await fetch(a, f"{SITE}/", ["x=1; Path=/"], dont_merge_cookies=True)
        await a.spider_closed()

    run(scenario())
    assert not redis_client.exists(KEYS.cookie_jar("default"))


def test_responses_without_set_cookie_do_not_wait_or_write(redis_url: str, redis_client: redis.Redis) -> None:
    async def scenario() -> None:
        a = worker(redis_url, flush_interval=3600)
        await asyncio.wait_for(fetch(a, f"{SITE}/"), 5)  # would hang if it waited for a flush
        assert a.stats.get_value("cookies/shared/written") is None
        await a.spider_closed()

    run(scenario())


# -- untrusted records -------------------------------------------------------------------------
def test_record_round_trip_keeps_every_attribute() -> None:
    cookie = Cookie(
        1,
        "n",
        "v",
        "8080",
        True,
        ".shop.example",
        True,
        True,
        "/a",
        True,
        True,
        2_000_000_000,
        False,
        "comment",
        "http://c",
        {"HttpOnly": None, "SameSite": "Lax"},
        False,
    )
    back = cookie_from_record(json.dumps(cookie_record(cookie)))
    assert cookie_record(back) == cookie_record(cookie)


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"\xff", "not JSON"),
        ("[1]", "not a JSON object"),
        ('{"name": 1, "domain": "d", "path": "/"}', "'name' must be a string"),
        ('{"name": "", "domain": "d", "path": "/"}', "empty cookie name"),
        ('{"name": "n", "domain": "d", "path": "/", "secure": "yes"}', "'secure' must be a boolean"),
        ('{"name": "n", "domain": "d", "path": "/", "expires": 1.5}', "'expires' must be an integer"),
        ('{"name": "n", "domain": "d", "path": "/", "rest": {"a": 1}}', "'rest' must map"),
    ],
)
def test_invalid_records_are_refused_with_a_reason(data: Any, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        cookie_from_record(data)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=10,
)
_fields = ["value", "secure", "expires", "rest", "version", "port", "discard"]
_records = st.fixed_dictionaries(
    {
        "name": st.text(min_size=1, max_size=10),
        "domain": st.sampled_from(["shop.example", ".example", ""]),
        "path": st.sampled_from(["/", "/a", ""]),
    },
    optional={f: _json_values | st.integers(-5, 5) | st.text(max_size=10) for f in _fields},
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=200), _json_values.map(json.dumps), _records.map(json.dumps)))
def test_any_stored_bytes_give_a_usable_cookie_or_value_error(data: Any) -> None:
    """Whatever sits in Redis, reading it either refuses it with a reason or gives a cookie that a request
    can be sent with."""
    from scrapy.http.cookies import CookieJar

    try:
        cookie = cookie_from_record(data)
    except ValueError:
        return
    jar = CookieJar()
    jar.set_cookie(cookie)
    jar.add_cookie_header(Request(f"{SITE}/a/b"))


def test_invalid_and_expired_records_in_redis_are_skipped(
    redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    good = {"name": "ok", "value": "1", "domain": "shop.example", "path": "/"}
    expired = {**good, "name": "old", "expires": 1}
    records = {
        '["shop.example","/","ok"]': json.dumps(good),
        '["shop.example","/","old"]': json.dumps(expired),
        "junk": "{not json",
    }
    redis_client.hset(KEYS.cookie_jar("default"), mapping=records)
    # as a writer does: each change logged with a version (records without one are never read)
    redis_client.zadd(KEYS.cookie_changes("default"), {f: i + 1 for i, f in enumerate(records)})

    async def scenario() -> None:
        b = worker(redis_url)
        with caplog.at_level(logging.WARNING):
            assert sent(await fetch(b, f"{SITE}/")) == "ok=1"
        assert b.stats.get_value("cookies/shared/rejected") == 1
        await b.spider_closed()

    run(scenario())
    assert "Skipped an invalid record" in caplog.text
    # the expired cookie was removed from Redis as housekeeping; the junk stays for inspection
    assert sorted(redis_client.hkeys(KEYS.cookie_jar("default"))) == [b'["shop.example","/","ok"]', b"junk"]


# -- Redis outages -----------------------------------------------------------------------------
def test_requests_go_on_with_the_local_copy_while_redis_is_down(redis_servers: Any) -> None:
    (server,) = redis_servers(1)
    clock = Clock()

    async def scenario() -> None:
        a = worker(server.url, clock)
        await fetch(a, f"{SITE}/login", ["session=abc; Path=/"])
        server.kill()
        clock.t += 5  # the copy is stale: a read is attempted, fails, and the local copy is used
        assert sent(await asyncio.wait_for(fetch(a, f"{SITE}/"), 5)) == "session=abc"
        assert a.stats.get_value("cookies/shared/redis_errors") == 1
        await a.server.aclose()

    run(scenario())


# -- settings ----------------------------------------------------------------------------------
def test_from_crawler(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    class ShopSpider(Spider):
        name = "shop"

    swap = {
        "scrapy.downloadermiddlewares.cookies.CookiesMiddleware": None,
        "scrapy_dist.middlewares.SharedCookiesMiddleware": 700,
    }
    crawler = get_crawler(
        ShopSpider,
        {"REDIS_URL": redis_url, "REDIS_COOKIES_CACHE_SECONDS": 3, "DOWNLOADER_MIDDLEWARES": swap},
    )
    with caplog.at_level(logging.WARNING):
        mw = SharedCookiesMiddleware.from_crawler(crawler)
    assert (mw.keys.spider, mw.settings.cache_seconds) == ("shop", 3.0)
    assert "enabled together with" not in caplog.text
    asyncio.run(mw.server.aclose())

    # Scrapy's middleware left enabled: both would write the Cookie header
    crawler = get_crawler(ShopSpider, {"REDIS_URL": redis_url})
    with caplog.at_level(logging.WARNING):
        asyncio.run(SharedCookiesMiddleware.from_crawler(crawler).server.aclose())
    assert "enabled together with" in caplog.text

    with pytest.raises(NotConfigured):
        SharedCookiesMiddleware.from_crawler(get_crawler(ShopSpider, {"COOKIES_ENABLED": False}))


def test_jar_names() -> None:
    assert [jar_name(None), jar_name("s1"), jar_name(7)] == ["default", "s1", "7"]


# -- end to end --------------------------------------------------------------------------------
class LoginSite:
    """``/login`` sets a session cookie and links to ``/private/<i>``, which answer 403 without it."""

    def __init__(self, private_pages: int, delay: float) -> None:
        self.private_pages = private_pages
        self.delay = delay
        self.log: list[tuple[str, str, bool]] = []  # (path, user agent, sent the session cookie)
        site = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                logged_in = "session=s3cret" in (self.headers.get("Cookie") or "")
                site.log.append((self.path, self.headers.get("User-Agent", ""), logged_in))
                headers = {"Content-Type": "text/html"}
                if self.path == "/login":
                    status = 200
                    headers["Set-Cookie"] = "session=s3cret; Path=/; HttpOnly"
                    body = "".join(f'<a href="/private/{i}">p</a>' for i in range(site.private_pages))
                elif self.path.startswith("/private/"):
                    time.sleep(site.delay)
                    status, body = (200, "welcome") if logged_in else (403, "log in first")
                else:
                    status, body = 404, "no"
                data = body.encode()
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


LOGIN_SPIDER = """
import scrapy


class LoginSpider(scrapy.Spider):
    name = "login"
    handle_httpstatus_list = [403]

    def __init__(self, base=None, **kw):
        super().__init__(**kw)
        self.base = base

    async def start(self):
        yield scrapy.Request(self.base + "/login", callback=self.after_login)

    def after_login(self, response):
        for href in response.css("a::attr(href)").getall():
            yield response.follow(href, callback=self.parse_private)

    def parse_private(self, response):
        yield {"url": response.url, "status": response.status}
"""


@pytest.mark.slow
def test_a_login_on_one_worker_lets_the_other_in(tmp_path: Path, redis_url: str) -> None:
    site = LoginSite(private_pages=80, delay=0.1)
    project = make_project(
        tmp_path,
        {
            "REDIS_URL": redis_url,
            "DOWNLOADER_MIDDLEWARES": {
                "scrapy.downloadermiddlewares.cookies.CookiesMiddleware": None,
                "scrapy_dist.middlewares.SharedCookiesMiddleware": 700,
            },
            "CONCURRENT_REQUESTS": 2,
        },
        spiders=LOGIN_SPIDER,
    )
    try:
        for name in ("worker-a", "worker-b"):
            project.crawl("login", args={"base": site.url}, settings={"USER_AGENT": name})
        assert project.wait_all(timeout=120) == [0, 0], project.logs()[-3000:]
    finally:
        project.stop_all()
        site.stop()
    logins = [ua for path, ua, _ in site.log if path == "/login"]
    assert len(logins) == 1, site.log  # one worker logged in ...
    private = [(ua, ok) for path, ua, ok in site.log if path.startswith("/private/")]
    assert len(private) == 80
    assert all(ok for _, ok in private), [p for p in private if not p[1]]
    # ... and the other one, which never saw the Set-Cookie, sent the cookie too
    other = {"worker-a", "worker-b"} - set(logins)
    assert sum(1 for ua, _ in private if ua in other) > 0, project.logs()[-3000:]
