"""Hostile entries in Redis: no entry stops a worker, valid entries cannot hijack the crawl, no
credential is written to Redis, denied networks are not reached. Real Redis, real ``scrapy crawl`` workers.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
import scrapy
from crawlproject import make_project

from scrapy_dist.egress import denied, parse_networks
from scrapy_dist.exceptions import RejectedEntry
from scrapy_dist.frontier.orders import parse_record, requeue_payload
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.seeds import SeedRules, parse_seed
from scrapy_dist.settings import DistSettings
from scrapy_dist.wire.codec import DEFAULT_POLICY, EntryPolicy, decode_request, encode_request, load_payload

SECRET = "s3cret-of-the-crawl"

SPIDERS = '''
import scrapy
from scrapy_dist.spiders import RedisSpider


class NoFollowSpider(scrapy.Spider):
    """Crawls what a test puts in the frontier (plus ``urls``)."""

    name = "nofollow"
    allowed_domains = ["127.0.0.1"]

    async def start(self):
        for url in (self.urls.split(",") if getattr(self, "urls", None) else []):
            yield scrapy.Request(url)

    def parse(self, response):
        yield {"url": response.url}

    def parse_other(self, response):
        yield {"url": response.url, "via": "parse_other"}


class OpenSpider(NoFollowSpider):
    name = "open"
    allowed_domains = []


class SeededSpider(RedisSpider):
    name = "seeded"
    allowed_domains = ["127.0.0.1"]

    def parse(self, response):
        yield {"url": response.url}


class CredsSpider(scrapy.Spider):
    """HttpAuthMiddleware (HTTPAUTH_* settings) adds Authorization to every request, AddSession a Cookie:
    neither may reach Redis; the Authorization the spider sets itself may."""

    name = "creds"

    async def start(self):
        base = self.base
        yield scrapy.Request(f"{base}/page/{self.flaky}")  # 503 always, retried through {creds}:delayed
        yield scrapy.Request(f"{base}/page/{self.other}", headers={"Authorization": "Bearer SPIDER-TOKEN"})
        yield scrapy.Request(f"{base}/page/999", headers={"Authorization": "Bearer SPIDER-TOKEN"})  # 404

    def parse(self, response):
        yield {"url": response.url}


class AddSession:
    """A downloader middleware adding the shared session cookie (as a cookie middleware would)."""

    def process_request(self, request):
        request.headers["Cookie"] = "session=MIDDLEWARE-COOKIE"
'''

NOFOLLOW = CrawlKeys("nofollow")


class _Spider(scrapy.Spider):
    name = "unit"
    allowed_domains = ["example.com"]

    def parse(self, response: Any) -> None:
        pass

    def parse_item(self, response: Any) -> None:
        pass


def _raw(d: dict[str, Any]) -> bytes:
    return b"\x01" + msgpack.packb(d, use_bin_type=True)


def _reason(data: bytes, policy: EntryPolicy = DEFAULT_POLICY, spider: Any = None) -> str:
    with pytest.raises(RejectedEntry) as info:
        decode_request(data, spider or _Spider(), policy)
    return info.value.reason


# -- decoding: every field type-checked, only RejectedEntry escapes --------------------------------------


@pytest.mark.parametrize(
    "fields, reason",
    [
        ({"cb": ["parse"]}, "bad_callback"),  # a list: unhashable, TypeError in the lookup before
        ({"cb": {"a": 1}}, "bad_callback"),
        ({"eb": [1]}, "bad_errback"),
        ({"cb": "start"}, "bad_callback"),  # Scrapy's hooks are methods of every spider, not callbacks
        ({"cb": "log"}, "bad_callback"),
        ({"cb": "closed"}, "bad_callback"),
        ({"cb": "make_request_from_data"}, "bad_callback"),
        ({"eb": "start"}, "bad_errback"),
        ({"p": 2**40}, "bad_priority"),  # seeds' 32-bit limit
        ({"h": [[b"X-%d" % i, [b"v"]] for i in range(101)]}, "bad_headers"),  # seeds' 100 headers
        ({"e": "rot13"}, "bad_encoding"),  # a codec, but not a text encoding
        ({"e": ["utf-8"]}, "bad_encoding"),
        ({"c": {"a": ["x"]}}, "bad_cookies"),
        ({"c": [{"name": "a", "value": "b\r\nX: y"}]}, "header_injection"),
        ({"f": [1]}, "bad_flags"),
        ({"k": {"a-b": 1}}, "bad_cb_kwargs"),
        ({"M": {1: 2}}, "bad_meta"),
    ],
)
def test_every_field_is_type_checked(fields: dict[str, Any], reason: str) -> None:
    assert _reason(_raw({"u": "https://example.com/", **fields})) == reason


def test_spider_methods_defined_by_the_spider_are_accepted_as_callbacks() -> None:
    spider = _Spider()
    request = decode_request(_raw({"u": "https://example.com/", "cb": "parse_item", "eb": "parse"}), spider)
    assert request.callback == spider.parse_item and request.errback == spider.parse


# -- authenticated entries: HMAC tag keyed by the crawl's secret -----------------------------------------


def test_signed_entries_are_trusted_and_unsigned_ones_obey_the_seed_rules() -> None:
    policy = EntryPolicy(secret=SECRET.encode())
    spider = _Spider()
    own = scrapy.Request(
        "https://other.org/x",
        meta={"proxy": "http://proxy.internal:3128", "cookiejar": 2},
        dont_filter=True,
        headers={"Authorization": "Basic abc"},
    )
    signed = encode_request(own, spider, policy)
    assert signed[0] == 3 and len(signed) == len(encode_request(own, spider)) + 16 + 8
    back = decode_request(signed, spider, policy)
    assert back.meta["proxy"] == "http://proxy.internal:3128" and back.url == "https://other.org/x"
    # the same map without a tag (or with a forged one) is somebody else's
    body = signed[25:]
    assert _reason(b"\x01" + body, policy) == "header_not_allowed"  # Authorization, before the meta
    assert _reason(b"\x03" + b"\0" * 24 + body, policy) == "bad_tag"
    assert _reason(encode_request(own, spider, EntryPolicy(secret=b"another")), policy) == "bad_tag"
    # signed for another crawl, or as a dead letter: not this crawl's queue entry
    assert _reason(encode_request(own, spider, policy.bound(crawl="{other}")), policy) == "bad_tag"
    assert _reason(encode_request(own, spider, policy.bound(kind="dead")), policy) == "bad_tag"
    # a tag of the body alone (version 2, older workers) proves nothing about the crawl: untrusted
    assert _reason(b"\x02" + b"\0" * 16 + body, policy) == "header_not_allowed"
    # unsigned: meta allow-list, framing/credential headers, allowed_domains whatever dont_filter says
    assert (
        _reason(_raw({"u": "https://example.com/", "M": {"_auth_proxy": "x"}}), policy) == "meta_not_allowed"
    )
    assert (
        _reason(_raw({"u": "https://example.com/", "M": {"dont_redirect": True}}), policy)
        == "meta_not_allowed"
    )
    for name in (b"Host", b"Content-Length", b"Transfer-Encoding", b"Proxy-Authorization", b"Authorization"):
        assert (
            _reason(_raw({"u": "https://example.com/", "h": [[name, [b"1"]]]}), policy)
            == "header_not_allowed"
        )
    assert _reason(_raw({"u": "https://evil.org/", "d": True}), policy) == "offsite"
    assert _reason(_raw({"u": "https://user:pw@example.com/"}), policy) == "bad_url"  # credentials
    # an '@' after the authority is a path or query like any other
    at = decode_request(_raw({"u": "https://a.example.com/u/@me?to=x@y"}), spider, policy)
    assert at.url.endswith("/u/@me?to=x@y")
    # cookies go to the crawl's cookie jar (sent with every later request): a credential, as Cookie is
    cookies = _raw({"u": "https://example.com/", "c": {"sessionid": "x"}})
    assert _reason(cookies, policy) == "header_not_allowed"
    # what the allow-lists permit still goes through
    ok = decode_request(_raw({"u": "https://a.example.com/", "M": {"category": "x"}}), spider, policy)
    assert ok.meta == {"category": "x"}
    relaxed = EntryPolicy(
        secret=SECRET.encode(), meta_allowed=("*", "cookiejar"), headers_allowed=("Authorization",)
    )
    r = decode_request(
        _raw({"u": "https://example.com/", "M": {"cookiejar": 1}, "h": [[b"Authorization", [b"x"]]]}),
        spider,
        relaxed,
    )
    assert r.meta["cookiejar"] == 1 and r.headers[b"Authorization"] == b"x"
    # without a secret every queue entry is the crawl's own (the documented trade-off)
    assert decode_request(b"\x01" + body, spider).meta["proxy"] == "http://proxy.internal:3128"


def test_requeued_dead_letters_are_signed_again_only_if_their_tag_verifies() -> None:
    policy = EntryPolicy(secret=SECRET.encode())
    spider = _Spider()
    request = scrapy.Request("https://example.com/", meta={"proxy": "http://p:1", "retry_times": 3})
    signed = encode_request(request, spider, policy.bound(kind="dead"))
    payload, _ = requeue_payload(signed, policy=policy)
    assert decode_request(payload, spider, policy).meta == {"proxy": "http://p:1"}
    for forged in (
        b"\x03" + b"\0" * 24 + signed[25:],  # a forged tag
        encode_request(request, spider, policy.bound(crawl="{other}", kind="dead")),  # another crawl's
        encode_request(request, spider, policy),  # a queue entry, not a dead letter
        b"\x02" + b"\0" * 16 + signed[25:],  # version 2: its tag cannot say whose it is
    ):
        with pytest.raises(RejectedEntry, match="bad_tag"):
            requeue_payload(forged, policy=policy)
    # an unsigned record stays unsigned: workers hold it to the seed rules
    payload, _ = requeue_payload(b"\x01" + signed[25:], policy=policy)
    assert payload[0] == 1 and _reason(payload, policy) == "meta_not_allowed"


# -- seeds ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "seed, reason",
    [
        ({"meta": {"proxy": "http://attacker:8080"}}, "meta_not_allowed"),
        ({"meta": {"_auth_proxy": "x"}}, "meta_not_allowed"),
        ({"meta": {"download_slot": "x"}}, "meta_not_allowed"),
        ({"meta": {"ftp_user": "x"}}, "meta_not_allowed"),
        ({"meta": {"cookiejar": 1}}, "meta_not_allowed"),
        ({"meta": {"handle_httpstatus_all": True}}, "meta_not_allowed"),
        ({"meta": {"dont_redirect": True}}, "meta_not_allowed"),
        ({"meta": {"bindaddress": ["127.0.0.1", 0]}}, "meta_not_allowed"),
        ({"meta": {"retry_times": -1000000000}}, "meta_not_allowed"),
        ({"meta": {"redirect_times": -1000000000, "redirect_ttl": 10**9}}, "meta_not_allowed"),
        ({"meta": {"redirect_ttl": 10**9}}, "meta_not_allowed"),
        ({"meta": {"priority_adjust": 2**31 - 1}}, "meta_not_allowed"),
        ({"meta": {"give_up_log_level": "junk"}}, "meta_not_allowed"),
        ({"headers": {"Host": "metadata.google.internal"}}, "header_not_allowed"),
        ({"headers": {"Content-Length": "0", "Transfer-Encoding": "chunked"}}, "header_not_allowed"),
        ({"headers": {"Connection": "close"}}, "header_not_allowed"),
        ({"headers": {"Proxy-Authorization": "Basic x"}}, "header_not_allowed"),
        ({"headers": {"Authorization": "Basic x"}}, "header_not_allowed"),
    ],
)
def test_seeds_cannot_route_or_reframe_requests(seed: dict[str, Any], reason: str) -> None:
    with pytest.raises(RejectedEntry) as info:
        parse_seed(json.dumps({"url": "https://example.com/", **seed}).encode())
    assert info.value.reason == reason
    if reason == "meta_not_allowed":
        assert repr(next(iter(seed["meta"]))) in info.value.detail  # names the key


def test_seed_allow_lists_are_settings() -> None:
    rules = SeedRules(meta_allowed=("category", "cookiejar"), headers_allowed=("Authorization",))
    seed = parse_seed(
        b'{"url": "https://e.com/", "meta": {"cookiejar": 1}, "headers": {"Authorization": "x"}}', rules
    )
    assert seed.meta == {"cookiejar": 1}
    with pytest.raises(RejectedEntry, match="meta_not_allowed"):
        parse_seed(b'{"url": "https://e.com/", "meta": {"other": 1}}', rules)


# -- deny networks ------------------------------------------------------------------------------------------


def test_deny_networks_match_resolved_addresses() -> None:
    from scrapy_dist.settings import defaults

    nets = parse_networks(defaults.SCHEDULER_DENY_NETWORKS)
    for address in (
        "127.0.0.1",
        "10.1.2.3",
        "169.254.169.254",
        "192.168.0.1",
        "::1",
        "::ffff:127.0.0.1",
        "fd00:ec2::254",
        "100.64.0.1",
        "0.0.0.0",
    ):
        assert denied(address, nets) is not None, address
    for address in ("93.184.216.34", "2606:2800:220:1::1"):
        assert denied(address, nets) is None, address
    with pytest.raises(ValueError, match="SCHEDULER_DENY_NETWORKS"):
        parse_networks(["10.0.0.0/33"])


# -- end to end ----------------------------------------------------------------------------------------------


def _put(client: redis.Redis, keys: CrawlKeys, payloads: list[bytes]) -> None:
    client.zadd(keys.queue, {(i + 1).to_bytes(6, "big") + p: 0 for i, p in enumerate(payloads)})


def _rejections(client: redis.Redis, key: str) -> list[str]:
    return sorted(json.loads(r)["reason"] for r in client.lrange(key, 0, -1))


@pytest.mark.slow
def test_malformed_callbacks_do_not_freeze_the_worker(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    """Before: a ``cb`` that is a msgpack list raised TypeError in the sync task; the worker stopped leasing
    but never exited (this test then timed out)."""
    site = site_factory(pages=10)
    client = redis.Redis.from_url(redis_url)
    good = [_raw({"u": site.page_url(i), "cb": "parse_other"}) for i in (1, 2)]
    bad = [
        _raw({"u": site.page_url(3), "cb": ["parse"]}),
        _raw({"u": site.page_url(4), "eb": {"x": 1}}),
        _raw({"u": site.page_url(5), "cb": "start"}),
        _raw({"u": site.page_url(6), "p": 2**40}),
    ]
    _put(client, NOFOLLOW, good + bad)
    project = make_project(tmp_path, {"REDIS_URL": redis_url}, spiders=SPIDERS)
    project.crawl("nofollow")
    assert project.wait_all(60) == [0], project.logs()[-3000:]
    assert set(site.fetch_counts()) == {"/page/1", "/page/2"}
    assert _rejections(client, NOFOLLOW.queue_rejected) == [
        "bad_callback",
        "bad_callback",
        "bad_errback",
        "bad_priority",
    ]
    assert client.zcard(NOFOLLOW.queue) == 0 and client.zcard(NOFOLLOW.leases) == 0


@pytest.mark.slow
def test_unsigned_queue_entries_cannot_hijack_a_crawl_with_a_secret(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    site = site_factory(pages=10)
    client = redis.Redis.from_url(redis_url)
    policy = EntryPolicy(secret=SECRET.encode())
    offsite = site.page_url(7).replace("127.0.0.1", "localhost")
    _put(
        client,
        NOFOLLOW,
        [
            # the crawl's own entry (signed by a worker of this crawl with the secret): its meta is obeyed
            encode_request(scrapy.Request(site.page_url(1), meta={"download_slot": "mine"}), None,
                           policy.bound(crawl=NOFOLLOW.tag)),
            _raw({"u": site.page_url(2), "M": {"category": "fine"}}),  # unsigned but harmless
            _raw({"u": site.page_url(3), "M": {"proxy": "http://127.0.0.1:9/"}}),
            _raw({"u": site.page_url(4), "h": [[b"Host", [b"metadata.google.internal"]]]}),
            _raw(
                {
                    "u": site.page_url(5),
                    "h": [[b"Content-Length", [b"0"]], [b"Transfer-Encoding", [b"chunked"]]],
                }
            ),
            b"\x03" + b"\0" * 24 + msgpack.packb({"u": site.page_url(6)}),  # forged tag
            _raw({"u": offsite, "d": True}),  # dont_filter must not get past allowed_domains
        ],
    )
    project = make_project(
        tmp_path, {"REDIS_URL": redis_url, "SCHEDULER_ENTRY_SECRET": SECRET}, spiders=SPIDERS
    )
    project.crawl("nofollow", args={"urls": site.page_url(8)})
    assert project.wait_all(60) == [0], project.logs()[-3000:]
    assert set(site.fetch_counts()) == {"/page/1", "/page/2", "/page/8"}
    assert _rejections(client, NOFOLLOW.queue_rejected) == [
        "bad_tag",
        "header_not_allowed",
        "header_not_allowed",
        "meta_not_allowed",
        "offsite",
    ]


@pytest.mark.slow
def test_seeds_cannot_set_proxy_or_leave_allowed_domains(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    site = site_factory(pages=10)
    client = redis.Redis.from_url(redis_url)
    keys = CrawlKeys("seeded")
    client.rpush(
        keys.start_urls,
        *[
            json.dumps({"url": site.page_url(1), "meta": {"proxy": "http://127.0.0.1:9/"}}),
            json.dumps({"url": site.page_url(2).replace("127.0.0.1", "localhost"), "dont_filter": True}),
            json.dumps({"url": site.page_url(3), "headers": {"Host": "metadata.google.internal"}}),
            # retried for ever (each retry's counter starts a billion below RETRY_TIMES)
            json.dumps({"url": site.page_url(5), "meta": {"retry_times": -1000000000}}),
            # the crawl's cookie jar would send this cookie with every later request to the site
            json.dumps({"url": site.page_url(6), "cookies": {"sessionid": "chosen-by-the-pusher"}}),
            site.page_url(4),
        ],
    )
    project = make_project(tmp_path, {"REDIS_URL": redis_url}, spiders=SPIDERS)
    project.crawl("seeded")
    assert project.wait_all(60) == [0], project.logs()[-3000:]
    assert set(site.fetch_counts()) == {"/page/4"}
    records = [json.loads(r) for r in client.lrange(keys.start_urls_rejected, 0, -1)]
    assert sorted(r["reason"] for r in records) == [
        "header_not_allowed", "header_not_allowed", "meta_not_allowed", "meta_not_allowed", "offsite"
    ]
    assert any("'proxy'" in r["detail"] for r in records)
    assert any("'retry_times'" in r["detail"] for r in records)


@pytest.mark.slow
def test_credentials_added_by_middlewares_never_reach_redis(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    site = site_factory(pages=3, flaky=1, flaky_failures=1000)  # one page answers 503 forever
    [flaky] = site.graph.flaky
    client = redis.Redis.from_url(redis_url)
    keys = CrawlKeys("creds")
    project = make_project(
        tmp_path,
        {
            "REDIS_URL": redis_url,
            "ADDONS": {"scrapy_dist.Addon": 0},
            "HTTPERROR_DEAD_LETTER": True,
            "RETRY_TIMES": 2,
            "RETRY_BACKOFF_BASE": 0.05,
            "RETRY_BACKOFF_MAX": 0.1,
            "HTTPAUTH_USER": "user",
            "HTTPAUTH_PASS": "MIDDLEWARE-PASSWORD",
            "HTTPAUTH_DOMAIN": "127.0.0.1",
            "DOWNLOADER_MIDDLEWARES": {"proj.spiders.test_spiders.AddSession": 700},
        },
        spiders=SPIDERS,
    )
    project.crawl("creds", args={"base": site.url, "flaky": str(flaky), "other": str(3 - flaky)})
    assert project.wait_all(90) == [0], project.logs()[-3000:]
    stats = project.stats(0)
    assert stats.get("retry/delayed", 0) >= 2  # the retries went through {creds}:delayed
    letters = [parse_record(r) for r in client.lrange(keys.deadletter, 0, -1)]
    assert len(letters) == 2, letters  # the 503 page, retries exhausted (HttpAuth's header), and the 404
    secret_auth = base64.b64encode(b"user:MIDDLEWARE-PASSWORD")
    for letter in letters:
        assert letter.payload is not None
        headers = {k.lower(): v for k, v in load_payload(letter.payload).get("h", [])}
        assert b"cookie" not in headers
        if letter.url.endswith("/page/999"):
            assert headers[b"authorization"] == [b"Bearer SPIDER-TOKEN"]  # the spider's own is kept
        else:
            assert b"authorization" not in headers
    everything = b"".join(client.lrange(keys.deadletter, 0, -1))
    assert b"MIDDLEWARE-COOKIE" not in everything and secret_auth not in everything


@pytest.mark.slow
def test_denied_networks_are_not_requested(tmp_path: Path, redis_url: str, site_factory: Any) -> None:
    site = site_factory(pages=10)
    client = redis.Redis.from_url(redis_url)
    project = make_project(
        tmp_path,
        {
            "REDIS_URL": redis_url,
            "ADDONS": {"scrapy_dist.Addon": 0},
            "SCHEDULER_DENY_NETWORKS": ["127.0.0.0/8"],
        },
        spiders=SPIDERS,
    )
    by_name = site.page_url(2).replace("127.0.0.1", "localhost")  # the resolved address counts
    project.crawl("open", args={"urls": f"{site.page_url(1)},{by_name}"})
    assert project.wait_all(60) == [0], project.logs()[-3000:]
    assert site.fetch_counts(status=None) == {}
    assert project.stats(0)["deny_networks/refused"] == 2
    # by name: the resolver refused the connection (a dead letter); by address: refused when read
    reasons = [parse_record(r).reason for r in client.lrange(CrawlKeys("open").deadletter, 0, -1)]
    assert reasons == ["denied_network"]
    assert project.stats(0)["scheduler/rejected/denied_network"] == 1


def test_the_secret_comes_from_settings_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from scrapy.settings import Settings

    monkeypatch.delenv("SCRAPY_DIST_SECRET", raising=False)
    # (the embedded Redis always has one)
    shared = DistSettings.from_settings(Settings({"REDIS_URL": "redis://localhost:1/0"}))
    assert EntryPolicy.from_dist(shared).secret is None
    with_secret = DistSettings.from_settings(
        Settings({"REDIS_URL": "redis://localhost:1/0", "SCHEDULER_ENTRY_SECRET": 12345})
    )
    assert EntryPolicy.from_dist(with_secret).secret == b"12345"
    monkeypatch.setenv("SCRAPY_DIST_SECRET", SECRET)  # read when the settings are
    policy = EntryPolicy.from_dist(DistSettings.from_settings(Settings({"REDIS_URL": "redis://localhost:1/0"})))
    assert policy.secret == SECRET.encode()
    assert policy.verify(encode_request(scrapy.Request("https://example.com/"), None, policy))


def test_same_site_redirects_do_not_carry_middleware_credentials_into_the_queue() -> None:
    """RedirectMiddleware copies Cookie and Authorization into a same-site redirect, a new request that
    goes to {spider}:queue; the values the middlewares added are left out of its payload."""
    from scrapy.downloadermiddlewares.httpauth import HttpAuthMiddleware
    from scrapy.downloadermiddlewares.redirect import RedirectMiddleware
    from scrapy.http import Response
    from scrapy.utils.test import get_crawler

    from scrapy_dist.wire.entrypolicy import AddedCredentialsMiddleware, ScheduledHeadersMiddleware

    crawler = get_crawler(
        _Spider,
        {"HTTPAUTH_USER": "u", "HTTPAUTH_PASS": "REDIRECT-PASSWORD", "HTTPAUTH_DOMAIN": "example.com"},
    )
    spider = _Spider()
    auth = HttpAuthMiddleware.from_crawler(crawler)
    redirect = RedirectMiddleware.from_crawler(crawler)
    first, last = ScheduledHeadersMiddleware(), AddedCredentialsMiddleware()
    own = scrapy.Request("https://example.com/own", headers={"Authorization": "Bearer OWN-TOKEN"})
    plain = scrapy.Request("https://example.com/a")
    for request in (own, plain):
        first.process_request(request)
        auth.process_request(request)
        request.headers["Cookie"] = "jar=REDIRECT-COOKIE"  # as CookiesMiddleware would
        last.process_request(request)
    for request, kept in ((plain, []), (own, [b"Bearer OWN-TOKEN"])):
        response = Response(request.url, status=302, headers={"Location": "/b"}, request=request)
        moved = redirect.process_response(request, response)
        assert isinstance(moved, scrapy.Request) and b"Authorization" in moved.headers  # Scrapy keeps them
        headers = {k.lower(): v for k, v in load_payload(encode_request(moved, spider)).get("h", [])}
        assert b"cookie" not in headers
        assert headers.get(b"authorization", []) == kept
