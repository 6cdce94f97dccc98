"""Seeds: the parser/validator (unit + hypothesis fuzz) and the Redis side of reading them (SeedReader and
its Lua scripts) against a real Redis."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import pytest
import redis.asyncio
import scrapy
from helpers import run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scrapy_dist.exceptions import RejectedEntry
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.seeds import (
    FIELDS,
    REASONS,
    SeedRules,
    class_has_callback,
    iter_lines,
    parse_seed,
    priority_from_score,
    reason_slug,
    seed_request,
    spider_has_callback,
    validate_url,
)
from scrapy_dist.spiders import RedisCrawlSpider, RedisSpider, SeedReader
from scrapy_dist.wire.codec import check_url, decode_request, encode_request, preview, rejection_record


class SeedSpider(scrapy.Spider):
    name = "seedspider"

    def parse(self, response: Any) -> Any:
        yield {}

    def parse_other(self, response: Any, **kw: Any) -> Any:
        yield {}

    def on_error(self, failure: Any) -> None:
        pass

    def _secret(self, response: Any) -> None:
        raise AssertionError("private methods are never callbacks")

    @staticmethod
    def static_cb(response: Any) -> None:
        pass


class SeedRedisSpider(RedisSpider):
    name = "seedredis"

    def parse(self, response: Any) -> Any:
        yield {}


SPIDER = SeedSpider()
HAS = spider_has_callback(SPIDER)


def parse(data: bytes | str, **kw: Any) -> Any:
    if isinstance(data, str):
        data = data.encode()
    return parse_seed(data, kw.pop("rules", SeedRules()), has_callback=kw.pop("has", HAS))


def reason_of(data: bytes | str, **kw: Any) -> str:
    with pytest.raises(RejectedEntry) as exc:
        parse(data, **kw)
    return exc.value.reason


# -- accepted forms ---------------------------------------------------------------------------------
def test_plain_url_surrounding_whitespace_ignored() -> None:
    seed = parse(b"  https://example.com/a?b=1\r\n")
    assert seed.url == "https://example.com/a?b=1" and not seed.is_json
    req = seed_request(seed, SPIDER)
    assert req.url == "https://example.com/a?b=1" and req.method == "GET" and req.callback is None
    assert req.dont_filter and req.priority == 0  # seeds skip the dupefilter, as in scrapy-redis


def test_json_seed_with_every_field() -> None:
    raw = {
        "url": "http://example.com/form",
        "method": "post",
        "headers": {"X-Token": "abc", "Accept": ["text/html", "*/*"]},
        "body": "a=1&b=é",
        "meta": {"depth_hint": 3, "tags": ["x", None, 1.5], "nested": {"k": True}},
        "cb_kwargs": {"page": 7},
        "priority": -5,
        "callback": "parse_other",
        "errback": "on_error",
        "dont_filter": True,
        "cookies": {"session": "s1", "n": 2},
    }
    assert set(raw) == FIELDS
    seed = parse(json.dumps(raw), rules=SeedRules(headers_allowed=("Cookie",)))  # cookies: see below
    req = seed_request(seed, SPIDER)
    assert req.method == "POST" and req.body == "a=1&b=é".encode()
    assert req.headers.getlist("Accept") == [b"text/html", b"*/*"] and req.headers["X-Token"] == b"abc"
    assert req.meta["tags"] == ["x", None, 1.5] and req.cb_kwargs == {"page": 7}
    assert req.priority == -5 and req.dont_filter
    assert req.callback == SPIDER.parse_other and req.errback == SPIDER.on_error
    assert req.cookies == {"session": "s1", "n": 2}
    # what a seed becomes fits the frontier's wire format and comes back identical
    back = decode_request(encode_request(req, SPIDER), SPIDER)
    assert (back.url, back.method, back.body, back.meta, back.priority, back.callback) == (
        req.url,
        req.method,
        req.body,
        req.meta,
        req.priority,
        req.callback,
    )


def test_seed_to_json_round_trip() -> None:
    seed = parse('{"url": "http://a.example/", "priority": 3, "meta": {"k": "ü"}, "dont_filter": true}')
    again = parse(seed.to_json())
    assert again == seed
    assert parse(parse("http://a.example/x").to_json()).url == "http://a.example/x"


def test_cookie_list_form_and_null_callback() -> None:
    raw = (
        '{"url": "http://a.example/", "callback": null,'
        ' "cookies": [{"name": "a", "value": "1", "domain": "a.example", "secure": true}]}'
    )
    seed = parse(raw, rules=SeedRules(headers_allowed=("cookie",)))
    assert seed.callback is None and seed.cookies[0]["domain"] == "a.example"


def test_cookies_need_the_cookie_header_allowed() -> None:
    # a request's cookies go to the crawl's cookie jar, which sends them with every later request to the
    # site: a seed could set the crawl's session cookie, which it may not do with a Cookie header
    with pytest.raises(RejectedEntry) as info:
        parse('{"url": "http://a.example/", "cookies": {"sessionid": "chosen-by-the-pusher"}}')
    assert info.value.reason == "header_not_allowed" and "Cookie" in info.value.detail


def test_idn_and_unicode_paths_are_fine() -> None:
    assert seed_request(parse("http://bücher.example/straße"), SPIDER).url.startswith("http://xn--")


# -- rejections -----------------------------------------------------------------------------------
def _j(**fields: Any) -> str:
    return json.dumps({"url": "http://a.example/", **fields})


REJECTS = [
    (b"\xff\xfehttp://a.example/", "not_utf8"),
    (b"http://a.example/\xc3", "not_utf8"),
    (b" \r\n ", "empty"),
    (b"", "empty"),
    ("example.com/page", "bad_url"),
    ("http:///only-path", "bad_url"),
    ("http://a.example/with space", "bad_url"),
    ("http://a.example/\x00nul", "bad_url"),
    ("http://a.example:99999/", "bad_url"),
    ("http://a.example/\u2028x", "bad_url"),
    ("http://a\u00a0b.example/", "bad_url"),
    ("http://user:secret@a.example/", "bad_url"),
    ("https://token@a.example:8443/x", "bad_url"),
    ("http://a.example\\@b.example/", "bad_url"),
    (_j(url="http://u:p@a.example/"), "bad_url"),
    ("ftp://a.example/file", "bad_scheme"),
    ("javascript:alert(1)", "bad_scheme"),
    ("file:///etc/passwd", "bad_scheme"),
    ('{"url": "http://a.example/"', "bad_json"),
    ('{"url": "http://a.example/", "priority": NaN}', "bad_json"),
    ("[" * 60_000, "bad_json"),
    (_j(meta={"a": json.loads("[" * 40 + "]" * 40)}), "bad_json"),
    ("[1, 2]", "not_object"),
    ('"http://a.example/"', "not_object"),
    ("42", "not_object"),
    ("null", "not_object"),
    ('{"meta": {}}', "missing_url"),
    # the missing url is the problem, not the fields around it (they were named first: bad_form_field)
    ('{"link": 5, "meta": {}}', "missing_url"),
    ('{"urls": ["http://a.example/"], "priority": 5}', "missing_url"),
    (_j(formdata={"a": 1}), "bad_form_field"),
    (_j(url=5), "bad_url"),
    (_j(url="gopher://a.example/"), "bad_scheme"),
    (_j(method="GET /admin HTTP/1.1"), "bad_method"),
    (_j(method=""), "bad_method"),
    (_j(method=["GET"]), "bad_method"),
    (_j(method="G\u00c9T"), "bad_method"),
    (_j(headers={"X-A\r\nX-Evil": "1"}), "header_injection"),
    (_j(headers={"X-A": "1\r\nSet-Cookie: evil=1"}), "header_injection"),
    (_j(headers={"X-A": ["ok", "bad\nvalue"]}), "header_injection"),
    (_j(headers={"X-A": "nul\u0000"}), "header_injection"),
    (_j(headers={"Bad Name": "1"}), "bad_headers"),
    (_j(headers={"X-A": 5}), "bad_headers"),
    (_j(headers=[["X-A", "1"]]), "bad_headers"),
    (_j(headers={"X-A": "bell\u0007"}), "bad_headers"),
    (_j(body=5), "bad_body"),
    (_j(body={"a": 1}), "bad_body"),
    (_j(meta=[1]), "bad_meta"),
    (_j(meta={"big": 2**70}), "bad_meta"),
    ('{"url": "http://a.example/", "meta": {"s": "\\ud800"}}', "bad_meta"),
    (_j(cb_kwargs={"not an identifier": 1}), "bad_cb_kwargs"),
    (_j(cb_kwargs=[1]), "bad_cb_kwargs"),
    (_j(priority="1"), "bad_priority"),
    (_j(priority=True), "bad_priority"),
    (_j(priority=1.5), "bad_priority"),
    (_j(priority=2**40), "bad_priority"),
    (_j(callback="_secret"), "bad_callback"),
    (_j(callback="__init__"), "bad_callback"),
    (_j(callback="no_such_method"), "bad_callback"),
    (_j(callback="start"), "bad_callback"),  # a Spider method, not a callback
    (_j(callback="log"), "bad_callback"),
    (_j(callback="static_cb"), "bad_callback"),
    (_j(callback="parse_other; import os"), "bad_callback"),
    (_j(callback=7), "bad_callback"),
    (_j(errback="x y"), "bad_errback"),
    (_j(dont_filter="yes"), "bad_dont_filter"),
    (_j(dont_filter=1), "bad_dont_filter"),
    (_j(cookies="a=b"), "bad_cookies"),
    (_j(cookies={"a": "b; admin=1"}), "bad_cookies"),
    (_j(cookies={"a": "b\r\nX-Evil: 1"}), "header_injection"),
    (_j(cookies=[{"name": "a"}]), "bad_cookies"),
    (_j(cookies=[{"name": "a", "value": "1", "httponly": 1}]), "bad_cookies"),
]


@pytest.mark.parametrize(("data", "reason"), REJECTS)
def test_rejections(data: bytes | str, reason: str) -> None:
    assert reason_of(data) == reason
    assert reason in REASONS


def test_too_large_is_checked_first_and_uses_the_limit() -> None:
    url = ("http://a.example/" + "x" * 200).encode()
    assert reason_of(url, rules=SeedRules(max_bytes=100)) == "too_large"
    assert reason_of(b"\xff" * 101, rules=SeedRules(max_bytes=100)) == "too_large"
    assert parse(url, rules=SeedRules(max_bytes=len(url))).url.endswith("x")


def test_allowed_schemes_follow_the_rules() -> None:
    assert reason_of("https://a.example/", rules=SeedRules(allowed_schemes=("http",))) == "bad_scheme"


def test_callbacks_without_a_spider_check_names_only() -> None:
    assert parse(_j(callback="whatever"), has=None).callback == "whatever"
    assert reason_of(_j(callback="_private"), has=None) == "bad_callback"
    with pytest.raises(RejectedEntry) as exc:
        seed_request(parse(_j(callback="whatever"), has=None), None)
    assert exc.value.reason == "bad_callback"


def test_class_has_callback_matches_the_spider_rules() -> None:
    has = class_has_callback(SeedSpider)
    assert has("parse") and has("parse_other") and has("on_error")
    assert not has("_secret") and not has("start") and not has("static_cb") and not has("nope")
    # Spider.parse only raises NotImplementedError: a RedisSpider without its own parse has no "parse"
    assert not class_has_callback(RedisSpider)("parse")
    assert class_has_callback(SeedRedisSpider)("parse")
    assert not class_has_callback(SeedRedisSpider)("make_request_from_data")
    # RedisCrawlSpider's public stand-ins for CrawlSpider's rule callbacks are not for seeds either
    assert not class_has_callback(RedisCrawlSpider)("rule_callback")
    assert not class_has_callback(RedisCrawlSpider)("parse_start_url")


def test_priority_from_score_clamps() -> None:
    assert priority_from_score(3.4) == 3 and priority_from_score(-2.6) == -3
    assert priority_from_score(float("inf")) == 2**31 - 1 and priority_from_score(float("nan")) == 0


def test_reason_slug_is_stats_safe() -> None:
    assert reason_slug("bad_url") == "bad_url"
    assert reason_slug("Bad Thing/../x") == "bad_thing____x"
    assert reason_slug("") == "rejected"


def test_iter_lines_skips_blanks_and_comments() -> None:
    assert list(iter_lines([b"# c\n", b"\n", b" http://a/ \r\n", b'{"url": "http://b/"}\n'])) == [
        b"http://a/",
        b'{"url": "http://b/"}',
    ]


def test_rejection_record_shape() -> None:
    rec = json.loads(rejection_record("not_utf8", b"\xff" * 2000, "w1", "bad byte", now=12.5))
    assert rec["reason"] == "not_utf8" and rec["at"] == 12.5 and rec["worker"] == "w1"
    assert rec["raw_encoding"] == "base64" and len(base64.b64decode(rec["raw"])) == 1024


def test_a_rejected_seed_is_quoted_in_one_escaped_bounded_line() -> None:
    raw = "http://a/\x1b]52;c;evil\x07\r\nFAKE LOG \u202e".encode() + b"\xff" + b"x" * 10_000
    shown = preview(raw)
    assert shown.startswith(r"'http://a/\x1b]52;c;evil\x07\x0d\x0aFAKE LOG \u202e\xffxxx")
    assert shown.endswith("'…") and len(shown) < 200 and shown.isprintable()
    assert preview("ftp://127.0.0.1/file") == "'ftp://127.0.0.1/file'"
    assert preview("bidi \u202e here", quote=False) == r"bidi \u202e here"


# -- fuzz ---------------------------------------------------------------------------------------------
def _accepts_cleanly(data: bytes) -> None:
    """The parser's contract: a Seed or RejectedEntry, nothing else; an accepted seed builds a request
    the frontier can store."""
    try:
        seed = parse_seed(data, SeedRules(), has_callback=HAS)
    except RejectedEntry as exc:
        assert exc.reason in REASONS
        return
    try:
        req = seed_request(seed, SPIDER)
    except RejectedEntry as exc:
        assert exc.reason in REASONS
        return
    encode_request(req, SPIDER)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    _accepts_cleanly(data)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=120))
def test_fuzz_arbitrary_text_and_urls(text: str) -> None:
    _accepts_cleanly(text.encode("utf-8", "surrogatepass"))
    _accepts_cleanly(("http://" + text).encode("utf-8", "surrogatepass"))
    _accepts_cleanly(("https://a.example/" + text).encode("utf-8", "surrogatepass"))


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60), st.sampled_from(["", "http://", "https://a.example/", "ftp://", "http:"]))
def test_fuzz_validate_url_is_at_least_as_strict_as_codec_check_url(text: str, prefix: str) -> None:
    url = prefix + text
    try:
        check_url(url, ("http", "https"))
    except RejectedEntry:
        with pytest.raises(RejectedEntry):
            validate_url(url)


def _reference_reason(url: str) -> str | None:
    """validate_url's verdict computed with urlsplit only (validate_url skips it for simple URLs)."""
    from urllib.parse import urlsplit

    if not url or any(ord(c) <= 32 or ord(c) == 127 for c in url) or not url.isprintable():
        return "bad_url"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018
    except ValueError:
        return "bad_url"
    if not parts.scheme:
        return "bad_url"
    if parts.scheme.lower() not in ("http", "https"):
        return "bad_scheme"
    if "@" in parts.netloc:  # user:password@ before the host (netloc ends at the first / ? #, as ours)
        return "bad_url"
    return None if parts.hostname else "bad_url"


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["http://", "HTTPS://", "ftp://", "http://user:pw@", "http://a@b@", "h:", "http://["]),
    st.from_regex(r"[A-Za-z0-9._@:\[\]-]{0,12}", fullmatch=True),
    st.sampled_from(["", "/", "/p?q#f", "?x", "#y", ":8080/", ":99999", ":", "_x/"]),
)
def test_fuzz_simple_url_fast_path_agrees_with_urlsplit(prefix: str, host: str, rest: str) -> None:
    url = prefix + host + rest
    try:
        validate_url(url)
        got = None
    except RejectedEntry as exc:
        got = exc.reason
    assert got == _reference_reason(url), url


_json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
_json = st.recursive(
    _json_leaf,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
_field_values = {
    "url": st.one_of(_json, st.just("http://a.example/"), st.text(max_size=30).map(lambda t: "http://" + t)),
    "method": st.one_of(_json, st.sampled_from(["GET", "post", "PURGE", "GE T", "G\nET"])),
    "headers": st.one_of(
        _json, st.dictionaries(st.text(max_size=10), st.text(max_size=10) | _json, max_size=3)
    ),
    "callback": st.one_of(_json, st.sampled_from(["parse", "parse_other", "_secret", "start", "nope"])),
    "errback": st.one_of(_json, st.sampled_from(["on_error", "parse", "x"])),
    "cookies": st.one_of(_json, st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2)),
}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(
        st.sampled_from(sorted(FIELDS) + ["extra"]),
        st.none(),
        max_size=8,
    ).flatmap(lambda d: st.fixed_dictionaries({k: _field_values.get(k, _json) for k in d}))
)
def test_fuzz_json_seeds(obj: dict[str, Any]) -> None:
    _accepts_cleanly(json.dumps(obj).encode())
    _accepts_cleanly(json.dumps({"url": "http://a.example/", **obj}).encode())


# -- the Redis side: SeedReader + seeds_take.lua / seeds_adopt.lua ------------------------------------
KEYS = CrawlKeys("books")


def reader(url: str, worker: str, kind: str = "list", lease: float = 10.0) -> SeedReader:
    return SeedReader(redis.asyncio.Redis.from_url(url), KEYS, worker, kind=kind, lease_seconds=lease)


def held(client: Any) -> list[bytes]:
    return client.lrange(KEYS.start_urls_processing, 0, -1)


def test_seed_keys_share_the_seeds_key_slot_even_when_it_has_a_hash_tag() -> None:
    from redis.crc import key_slot

    tagged = CrawlKeys("books", start_urls_template="{%(name)s}:seeds")
    for k in (KEYS, CrawlKeys("books", prefix="p:"), tagged):
        slot = key_slot(k.start_urls.encode())
        assert key_slot(k.start_urls_processing.encode()) == slot
        assert key_slot(k.start_urls_workers.encode()) == slot
    assert tagged.start_urls_processing == "{books}:seeds:processing"


def test_take_records_seeds_as_held_and_acks_release_them(redis_url: str, redis_client: Any) -> None:
    redis_client.rpush(KEYS.start_urls, *[f"http://a.example/{i}" for i in range(5)])

    async def go() -> Any:
        r = reader(redis_url, "w1")
        first = await r.take(3, now=1000)
        mid = held(redis_client)
        second = await r.take(10, acks=first.entries[:2], now=1001)
        await r.close()
        return first, mid, second

    first, mid, second = run(go())
    assert first.status == "ok" and first.entries == [f"http://a.example/{i}".encode() for i in range(3)]
    assert mid == [b"w1\n" + e for e in first.entries]
    assert second.entries == [b"http://a.example/3", b"http://a.example/4"]
    assert held(redis_client) == [
        b"w1\nhttp://a.example/2",
        b"w1\nhttp://a.example/3",
        b"w1\nhttp://a.example/4",
    ]
    assert redis_client.llen(KEYS.start_urls) == 0
    assert redis_client.zscore(KEYS.start_urls_workers, "w1") == pytest.approx(1011)


def test_dead_workers_seeds_go_back_once_their_lease_runs_out(redis_url: str, redis_client: Any) -> None:
    redis_client.rpush(KEYS.start_urls, b"s1", b"s2", b"s3", b"s4", b"s5")

    async def go() -> Any:
        dead, alive = reader(redis_url, "dead", lease=10), reader(redis_url, "alive", lease=10)
        taken = await dead.take(3, now=1000)  # then the worker is killed: no ack, no leave
        mine = await alive.take(1, now=1001)  # s4, held by a live worker: must stay where it is
        early = await alive.take(0, now=1009)
        late = await alive.take(0, now=1011)
        adopted = await alive.adopt(late.expired, now=1011)
        again = await alive.adopt(late.expired, now=1011)  # a second adopter finds nothing
        got = await alive.take(10, now=1012)
        for r in (dead, alive):
            await r.close()
        return taken, mine, early, late, adopted, again, got

    taken, mine, early, late, adopted, again, got = run(go())
    assert taken.entries == [b"s1", b"s2", b"s3"] and mine.entries == [b"s4"]
    assert early.expired == [] and late.expired == ["dead"]
    assert adopted == (1, 3, 0) and again == (0, 0, 0)
    # back at the head, in their order, ahead of the seed nobody had taken
    assert got.entries == [b"s1", b"s2", b"s3", b"s5"]
    assert redis_client.zscore(KEYS.start_urls_workers, "dead") is None
    assert held(redis_client) == [b"alive\n" + e for e in (b"s4", b"s1", b"s2", b"s3", b"s5")]


def test_a_worker_id_that_is_not_utf8_is_adopted_not_fatal(redis_url: str, redis_client: Any) -> None:
    # anyone who can write the workers ZSET can add a member of any bytes: every take reported it as
    # expired and failed to decode it, so no seed was read any more
    redis_client.zadd(KEYS.start_urls_workers, {b"\xff\xfe": 0})
    redis_client.rpush(KEYS.start_urls_processing, b"\xff\xfe\nhttp://a.example/held")
    redis_client.rpush(KEYS.start_urls, b"http://a.example/1")

    async def go() -> Any:
        r = reader(redis_url, "alive")
        first = await r.take(10, now=1000)
        adopted = await r.adopt(first.expired, now=1000)
        second = await r.take(10, now=1001)
        await r.close()
        return first, adopted, second

    first, adopted, second = run(go())
    assert first.entries == [b"http://a.example/1"] and first.expired == [b"\xff\xfe"]
    assert adopted == (1, 1, 0)
    assert second.entries == [b"http://a.example/held"] and second.expired == []


def test_a_stalled_worker_learns_its_seeds_were_adopted(redis_url: str, redis_client: Any) -> None:
    redis_client.rpush(KEYS.start_urls, b"s1", b"s2")

    async def go() -> Any:
        slow, other = reader(redis_url, "slow", lease=5), reader(redis_url, "other", lease=5)
        await slow.take(2, now=1000)
        seen = await other.take(0, now=1010)
        await other.adopt(seen.expired, now=1010)
        back = await slow.take(0, acks=[b"s1"], now=1011)
        for r in (slow, other):
            await r.close()
        return back

    back = run(go())
    assert back.status == "lost"
    # nothing was lost: both seeds are in the seeds key again (the ack of s1 found nothing to remove)
    assert redis_client.lrange(KEYS.start_urls, 0, -1) == [b"s1", b"s2"]
    assert held(redis_client) == []


def test_sweep_gives_back_what_the_worker_does_not_know_about(redis_url: str, redis_client: Any) -> None:
    redis_client.rpush(KEYS.start_urls, b"a", b"b", b"c")

    async def go() -> Any:
        r, other = reader(redis_url, "w1"), reader(redis_url, "w2")
        await other.take(1, now=1000)  # another worker's entry: a sweep leaves it alone
        await r.take(2, now=1000)  # say this reply was lost to a timeout: w1 does not know it holds b, c
        swept = await r.take(1, acks=[b"b"], mode="sweep", now=1001)
        for x in (r, other):
            await x.close()
        return swept

    swept = run(go())
    assert swept.returned == 1 and swept.entries == [b"c"]  # c went back, then was taken again
    assert held(redis_client) == [b"w2\na", b"w1\nc"]
    assert redis_client.llen(KEYS.start_urls) == 0


def test_leave_gives_back_the_unacknowledged_and_unregisters(redis_url: str, redis_client: Any) -> None:
    redis_client.rpush(KEYS.start_urls, b"a", b"b", b"c")

    async def go() -> Any:
        r = reader(redis_url, "w1")
        await r.take(3, now=1000)
        left = await r.take(5, acks=[b"a"], mode="leave", now=1001)
        await r.close()
        return left

    left = run(go())
    assert left.returned == 2 and left.entries == []
    assert redis_client.zscore(KEYS.start_urls_workers, "w1") is None
    assert redis_client.lrange(KEYS.start_urls, 0, -1) == [b"b", b"c"] and held(redis_client) == []


def test_zset_seeds_keep_their_score_through_a_dead_worker(redis_url: str, redis_client: Any) -> None:
    redis_client.zadd(KEYS.start_urls, {b"low": 1, b"high": 50, b"mid": 7.5})

    async def go() -> Any:
        dead, alive = reader(redis_url, "dead", "zset", lease=1), reader(redis_url, "alive", "zset", lease=1)
        taken = await dead.take(2, now=1000)
        seen = await alive.take(0, now=1005)
        await alive.adopt(seen.expired, now=1005)
        for r in (dead, alive):
            await r.close()
        return taken

    taken = run(go())
    assert taken.entries == [b"50 high", b"7.5 mid"]
    assert redis_client.zrange(KEYS.start_urls, 0, -1, withscores=True) == [
        (b"low", 1.0),
        (b"mid", 7.5),
        (b"high", 50.0),
    ]


@pytest.mark.parametrize("score", [b"nan", b"-nan", b"1e999", b" 5", b"0x10", b"inf"])
def test_a_garbage_score_in_processing_loses_no_other_seed(
    redis_url: str, redis_client: Any, score: bytes
) -> None:
    # Lua's tonumber reads scores ZADD refuses ('nan', '1e999', ' 5'): the give-back failed after it had
    # rewritten the processing list, so the dead worker's real seeds were lost and it stayed expired
    redis_client.zadd(KEYS.start_urls_workers, {b"dead": 0})
    redis_client.rpush(
        KEYS.start_urls_processing, b"dead\n5 http://a.example/real", b"dead\n" + score + b" http://a.example/x"
    )

    async def go() -> Any:
        alive = reader(redis_url, "alive", "zset")
        seen = await alive.take(0, now=1000)
        adopted = await alive.adopt(seen.expired, now=1000)
        await alive.close()
        return adopted

    assert run(go())[0] == 1
    back = dict(redis_client.zrange(KEYS.start_urls, 0, -1, withscores=True))
    assert back[b"http://a.example/real"] == 5.0
    assert set(back) <= {b"http://a.example/real", b"http://a.example/x"}
    assert redis_client.zscore(KEYS.start_urls_workers, "dead") is None


def test_set_seeds(redis_url: str, redis_client: Any) -> None:
    redis_client.sadd(KEYS.start_urls, b"x", b"y", b"z")

    async def go() -> Any:
        r = reader(redis_url, "w1", "set")
        got = await r.take(2, now=1000)
        rest = await r.take(5, now=1001)
        await r.close()
        return got, rest

    got, rest = run(go())
    assert sorted(got.entries + rest.entries) == [b"x", b"y", b"z"] and len(got.entries) == 2


def test_wrong_type_is_reported_not_raised(redis_url: str, redis_client: Any) -> None:
    redis_client.sadd(KEYS.start_urls, b"x")

    async def go() -> Any:
        r = reader(redis_url, "w1", "list")
        got = await r.take(5, now=1000)
        await r.close()
        return got

    got = run(go())
    assert got.status == "wrongtype" and got.key_type == "set" and got.entries == []
    assert redis_client.smembers(KEYS.start_urls) == {b"x"}


def test_wait_wakes_on_a_push_and_leaves_the_seed_in_the_key(redis_url: str, redis_client: Any) -> None:
    async def go() -> Any:
        r = reader(redis_url, "w1")
        pusher = redis.asyncio.Redis.from_url(redis_url)
        nothing = await r.wait(0.1)

        async def push() -> None:
            await asyncio.sleep(0.2)
            await pusher.lpush(KEYS.start_urls, b"pushed")

        task = asyncio.create_task(push())
        woke = await r.wait(5)
        await task
        await pusher.aclose()
        await r.close()
        return nothing, woke

    nothing, woke = run(go())
    assert nothing is False and woke is True
    assert redis_client.lrange(KEYS.start_urls, 0, -1) == [b"pushed"] and held(redis_client) == []


def test_a_worker_id_with_a_newline_is_refused() -> None:
    with pytest.raises(ValueError):
        SeedReader(None, KEYS, "a\nb")


def test_rejection_records_are_capped(redis_url: str, redis_client: Any) -> None:
    async def go() -> None:
        r = SeedReader(redis.asyncio.Redis.from_url(redis_url), KEYS, "w1", rejected_maxlen=3)
        await r.record_rejections([json.dumps({"n": i}) for i in range(5)])
        await r.close()

    run(go())
    assert [json.loads(x)["n"] for x in redis_client.lrange(KEYS.start_urls_rejected, 0, -1)] == [2, 3, 4]
