"""Retries delayed in the shared frontier, Retry-After, and dead letters.

Unit tests of the timing helpers and the record format take ``now``/``rng`` (no sleeps); the middleware is
exercised with a real (unopened) scheduler object; end-to-end tests run real ``scrapy crawl`` workers against
a local HTTP server whose endpoints fail on purpose.
"""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import parse_qs, urlsplit

import msgpack
import pytest
import redis
from crawlproject import make_project
from hypothesis import given
from hypothesis import strategies as st
from scrapy import Request, Spider
from scrapy.dupefilters import BaseDupeFilter
from scrapy.exceptions import IgnoreRequest
from scrapy.http import HtmlResponse
from scrapy.utils.test import get_crawler
from twisted.internet.error import TimeoutError as TxTimeoutError

from scrapy_dist.exceptions import RejectedEntry
from scrapy_dist.frontier import orders as deadletter
from scrapy_dist.frontier.orders import (
    backoff_delay,
    dead_letter_record,
    parse_record,
    parse_retry_after,
    reason_matches,
    requeue_payload,
    retry_delay,
)
from scrapy_dist.frontier.scheduler import Scheduler
from scrapy_dist.middlewares import HttpErrorMiddleware, RetryMiddleware, RetryScheduled
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.wire.codec import decode_request, encode_request

NOW = 1_700_000_000.0


# -- timing helpers ------------------------------------------------------------------------------------


def test_backoff_doubles_from_base_and_jitter_only_adds() -> None:
    assert [backoff_delay(n, 1.0, 300, rng=lambda: 0.0) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    top = [backoff_delay(n, 1.0, 300, rng=lambda: 0.999) for n in (1, 2, 3)]
    assert all(nominal <= d < 1.5 * nominal for d, nominal in zip(top, (1.0, 2.0, 4.0), strict=True))


def test_backoff_is_capped_and_survives_huge_retry_counts() -> None:
    assert backoff_delay(10, 1.0, 300, rng=lambda: 0.9) == 300
    assert backoff_delay(5000, 1.0, 60, rng=lambda: 0.0) == 60
    assert backoff_delay(1, 0.0, 300) == 0.0


@pytest.mark.parametrize(
    ("value", "expected"),
    [("120", 120.0), (b" 2 ", 2.0), ("0", 0.0), ("1.5", 1.5), ("", None), ("soon", None), (None, None),
     ("-3", None), ("1e9999", None)],
)
def test_retry_after_seconds(value: Any, expected: float | None) -> None:
    assert parse_retry_after(value, now=NOW) == expected


def test_retry_after_http_date_is_relative_to_now() -> None:
    assert parse_retry_after(formatdate(NOW + 90, usegmt=True), now=NOW) == pytest.approx(90)
    assert parse_retry_after(formatdate(NOW + 90, usegmt=True).encode(), now=NOW + 30) == pytest.approx(60)
    assert parse_retry_after(formatdate(NOW - 500, usegmt=True), now=NOW) == 0.0
    assert parse_retry_after("Wed, 99 Foo 2015 07:28:00 GMT", now=NOW) is None


def test_retry_delay_uses_retry_after_on_429_and_503_only_capped() -> None:
    no_jitter = {"rng": lambda: 0.0, "now": NOW}
    assert retry_delay(1, 0.2, 300, status=429, retry_after=b"7", **no_jitter) == 7
    assert retry_delay(1, 0.2, 300, status=503, retry_after=b"7", **no_jitter) == 7
    assert retry_delay(1, 0.2, 5, status=503, retry_after=b"7", **no_jitter) == 5  # capped
    assert retry_delay(2, 0.2, 300, status=500, retry_after=b"7", **no_jitter) == pytest.approx(0.4)
    assert retry_delay(2, 0.2, 300, status=429, retry_after=b"junk", **no_jitter) == pytest.approx(0.4)
    assert retry_delay(1, 0.2, 300, status=None, **no_jitter) == pytest.approx(0.2)


# -- record format -------------------------------------------------------------------------------------


def test_record_round_trip_and_requeue_resets_retries() -> None:
    request = Request(
        "https://example.com/a", meta={"retry_times": 2, "keep": [1, "x"]}, priority=3, dont_filter=True
    )
    raw = dead_letter_record(request, reason="500", worker="w1", status=500, now=NOW)
    record = json.loads(raw)
    assert record["url"] == "https://example.com/a"
    assert (record["reason"], record["attempts"], record["worker"], record["at"], record["status"]) == (
        "500", 3, "w1", NOW, 500,
    )
    assert base64.b64decode(record["request"]) == encode_request(request)
    letter = parse_record(raw.encode())
    assert letter.payload == encode_request(request)
    assert (letter.reason, letter.attempts, letter.status, letter.raw) == ("500", 3, 500, raw.encode())
    payload, priority = requeue_payload(letter.payload)
    again = decode_request(payload, Spider("s"))
    assert "retry_times" not in again.meta and again.meta["keep"] == [1, "x"]
    assert again.priority == priority == 3 and again.dont_filter


def test_unencodable_request_is_recorded_without_payload() -> None:
    raw = dead_letter_record(Request("https://e.com/", meta={"obj": object()}), reason="r", worker="w")
    letter = parse_record(raw.encode())
    assert letter.payload is None and letter.url == "https://e.com/" and letter.attempts == 1


@pytest.mark.parametrize(
    "raw",
    [b"not json", b"[1,2]", b'{"request": "@@@"}', b'{"attempts": "3"}', b'{"status": true}',
     b'{"url": 5}', b"\xff\xfe"],
)
def test_malformed_records_are_rejected(raw: bytes) -> None:
    with pytest.raises(RejectedEntry) as info:
        parse_record(raw)
    assert info.value.reason == "bad_deadletter"


@given(st.binary(max_size=300))
def test_parse_record_only_raises_rejected_entry(raw: bytes) -> None:
    with contextlib.suppress(RejectedEntry):
        parse_record(raw)


@pytest.mark.parametrize(
    "payload",
    [b"", b"\x02" + msgpack.packb({"u": "http://e.com"}), b"\x01\xc1", b"\x01" + msgpack.packb([1]),
     b"\x01" + msgpack.packb({"u": "file:///etc/passwd"})],
)
def test_requeue_rejects_bad_payloads(payload: bytes) -> None:
    with pytest.raises(RejectedEntry):
        requeue_payload(payload)


def test_reason_matching() -> None:
    assert reason_matches("twisted.internet.error.TimeoutError", "TimeoutError")
    assert reason_matches("twisted.internet.error.TimeoutError", "twisted.internet.error.timeouterror")
    assert reason_matches("500", "500")
    assert not reason_matches("500", "50")
    assert not reason_matches("builtins.ValueError", "Error")


# -- the middleware, with a real scheduler object (not opened: nothing is sent to Redis) -----------------


class _Spider(Spider):
    name = "unit"

    def parse(self, response: Any) -> None:  # pragma: no cover - never called
        pass

    def failed(self, failure: Any) -> None:  # pragma: no cover - never called
        pass


def _middleware(
    with_scheduler: bool = True, **settings: Any
) -> tuple[RetryMiddleware, Scheduler | None, Any]:
    crawler = get_crawler(_Spider, {"RETRY_BACKOFF_BASE": 0.5, **settings})
    crawler.spider = crawler._create_spider()
    scheduler = None
    if with_scheduler:
        # never opened: what it is asked to write stays in its ledger, where the test reads it
        scheduler = Scheduler(BaseDupeFilter(), CrawlKeys("retry"), {}, stats=crawler.stats)
        scheduler.spider = crawler.spider
    mw = RetryMiddleware.from_crawler(crawler)
    mw.dead_letters.scheduler_of = lambda: scheduler
    mw.clock = lambda: NOW
    mw.rng = lambda: 0.0
    return mw, scheduler, crawler


def _response(request: Request, status: int, headers: dict[str, str] | None = None) -> HtmlResponse:
    return HtmlResponse(request.url, status=status, headers=headers, body=b"x", request=request)


def test_retryable_status_is_delayed_in_the_frontier_and_ends_the_attempt_quietly() -> None:
    mw, scheduler, crawler = _middleware()
    assert scheduler is not None
    request = Request("https://e.com/x", callback=crawler.spider.parse, errback=crawler.spider.failed)
    with pytest.raises(RetryScheduled) as info:
        mw.process_response(request, _response(request, 503))
    assert isinstance(info.value, IgnoreRequest)  # Scrapy neither logs nor counts it as an error
    assert request.errback is None  # the errback is for the final failure only (the copy keeps it)
    [delay] = scheduler.ledger.delays
    score, payload, not_before = delay.score, delay.payload, delay.not_before
    assert not_before == NOW + 0.5
    retry = decode_request(payload, crawler.spider)
    assert retry.meta["retry_times"] == 1 and retry.dont_filter and retry.errback == crawler.spider.failed
    assert score == 1  # RETRY_PRIORITY_ADJUST = -1 -> score -priority
    stats = crawler.stats.get_stats()
    assert stats["retry/delayed"] == 1 and stats["retry/count"] == 1
    assert stats["retry/reason_count/503 Service Unavailable"] == 1


def test_retry_after_sets_the_delay_and_backoff_grows() -> None:
    mw, scheduler, _ = _middleware(RETRY_BACKOFF_MAX=60)
    assert scheduler is not None
    first = Request("https://e.com/a")
    with pytest.raises(RetryScheduled):
        mw.process_response(first, _response(first, 429, {"Retry-After": "30"}))
    second = Request("https://e.com/b", meta={"retry_times": 1})
    with pytest.raises(RetryScheduled):
        mw.process_exception(second, TxTimeoutError())
    capped = Request("https://e.com/c")
    with pytest.raises(RetryScheduled):
        mw.process_response(capped, _response(capped, 503, {"Retry-After": "3600"}))
    assert [d.not_before - NOW for d in scheduler.ledger.delays] == [30, 1.0, 60]


def test_exhausted_retries_are_dead_lettered_once() -> None:
    mw, scheduler, crawler = _middleware(HTTPERROR_DEAD_LETTER=True)
    assert scheduler is not None
    request = Request("https://e.com/x", meta={"retry_times": 2})
    response = _response(request, 500)
    assert mw.process_response(request, response) is response  # given back, like Scrapy
    httperror = HttpErrorMiddleware.from_crawler(crawler)
    from scrapy.spidermiddlewares.httperror import HttpError

    assert httperror.process_spider_exception(response, HttpError(response)) == ()
    [record] = scheduler.ledger.dead
    letter = parse_record(record.encode())
    assert (letter.reason, letter.attempts, letter.status) == ("500", 3, 500)
    assert letter.worker == scheduler.worker_id
    stats = crawler.stats.get_stats()
    assert stats["deadletter/count"] == 1 and stats["deadletter/reason_count/500"] == 1
    assert stats["httperror/response_ignored_status_count/500"] == 1
    assert stats["retry/max_reached"] == 1


def test_final_failures_that_are_not_retried() -> None:
    mw, scheduler, crawler = _middleware(DEADLETTER_IGNORED=True)
    assert scheduler is not None
    not_retried = Request("https://e.com/1", meta={"dont_retry": True})
    assert mw.process_exception(not_retried, TxTimeoutError()) is None
    ignored = Request("https://e.com/2")
    assert mw.process_exception(ignored, IgnoreRequest("robots.txt")) is None
    failing_callback = Request("https://e.com/3")
    mw.spider_error(
        SimpleNamespace(value=ValueError("bug")), _response(failing_callback, 200), crawler.spider
    )
    letters = [parse_record(d.encode()) for d in scheduler.ledger.dead]
    reasons = [(r.url, r.reason, r.status) for r in letters]
    assert reasons == [
        ("https://e.com/1", "twisted.internet.error.TimeoutError", None),
        ("https://e.com/2", "scrapy.exceptions.IgnoreRequest", None),
        ("https://e.com/3", "builtins.ValueError", 200),
    ]


def test_ignored_requests_are_not_dead_lettered_by_default() -> None:
    mw, scheduler, _ = _middleware()
    assert scheduler is not None
    assert mw.process_exception(Request("https://e.com/"), IgnoreRequest()) is None
    assert scheduler.ledger.dead == []


def test_without_the_scrapy_dist_scheduler_it_retries_at_once_like_scrapy() -> None:
    mw, _, crawler = _middleware(with_scheduler=False)
    request = Request("https://e.com/x")
    retry = mw.process_response(request, _response(request, 503))
    assert isinstance(retry, Request) and retry.meta["retry_times"] == 1
    assert mw.process_exception(request, TxTimeoutError()).meta["retry_times"] == 1
    exhausted = Request("https://e.com/y", meta={"retry_times": 2})
    response = _response(exhausted, 503)
    assert mw.process_response(exhausted, response) is response
    assert "deadletter/count" not in crawler.stats.get_stats()


def test_disabled_by_retry_enabled() -> None:
    from scrapy.exceptions import NotConfigured

    with pytest.raises(NotConfigured):
        RetryMiddleware.from_crawler(get_crawler(_Spider, {"RETRY_ENABLED": False}))


# -- end to end ------------------------------------------------------------------------------------------


class _Server(ThreadingHTTPServer):
    # the default listen backlog (5) drops connections of a 16-request burst, which then time out
    request_queue_size = 128
    daemon_threads = True


class FailingSite:
    """A local HTTP server whose endpoints fail on purpose; every hit is logged as (monotonic time, status).

    * ``/flaky/<id>?fail=N&status=S`` answers S the first N times, then 200;
    * ``/always500/<id>`` always 500;  ``/notfound/<id>`` always 404;
    * ``/slow/<id>`` answers after ``slow`` seconds (longer than the crawl's DOWNLOAD_TIMEOUT);
    * ``/retry-after/<id>?seconds=N`` answers 429 with ``Retry-After: N`` the first time, then 200;
    * anything else 200.
    """

    def __init__(self, slow: float = 2.5) -> None:
        self.slow = slow
        self.hits: dict[str, list[tuple[float, int]]] = defaultdict(list)
        self._lock = threading.Lock()
        site = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                parts = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(parts.query).items()}
                now = time.monotonic()
                with site._lock:
                    seen = len(site.hits[parts.path])
                status, headers = site._answer(parts.path, query, seen)
                with site._lock:
                    site.hits[parts.path].append((now, status))
                if parts.path.startswith("/slow/"):
                    time.sleep(site.slow)
                body = b"<html><body>ok</body></html>" if status == 200 else b"no"
                try:
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Type", "text/html")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass  # the crawler timed out and went away

        self._httpd = _Server(("127.0.0.1", 0), Handler)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @staticmethod
    def _answer(path: str, query: dict[str, str], seen: int) -> tuple[int, dict[str, str]]:
        if path.startswith("/flaky/"):
            return (int(query.get("status", 503)) if seen < int(query.get("fail", 1)) else 200), {}
        if path.startswith("/always500/"):
            return 500, {}
        if path.startswith("/notfound/"):
            return 404, {}
        if path.startswith("/retry-after/") and seen == 0:
            return 429, {"Retry-After": query.get("seconds", "1")}
        return 200, {}

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def statuses(self, path: str) -> list[int]:
        with self._lock:
            return [s for _, s in self.hits[urlsplit(path).path]]

    def gaps(self, path: str) -> list[float]:
        with self._lock:
            times = [t for t, _ in self.hits[urlsplit(path).path]]
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    def __enter__(self) -> FailingSite:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


SPIDERS = '''
import json, os
import scrapy


class RetrySpider(scrapy.Spider):
    """Requests the URLs given with -a urls=...; errback on all but /noeb/ ones; callback raises on /boom/."""

    name = "retry"

    def __init__(self, urls="", **kw):
        super().__init__(**kw)
        self.urls = [u for u in urls.split(",") if u]

    async def start(self):
        for url in self.urls:
            yield scrapy.Request(url, errback=None if "/noeb/" in url else self.failed)

    def parse(self, response):
        if "/boom/" in response.url:
            raise ValueError("boom")
        yield {"url": response.url, "status": response.status}

    def failed(self, failure):
        yield {"url": failure.request.url, "errback": type(failure.value).__name__}


class JsonLinesPipeline:
    """Appends every item to items-<pid>.jsonl."""

    def open_spider(self, spider=None):
        self.fh = open(f"items-{os.getpid()}.jsonl", "a")

    def process_item(self, item, spider=None):
        self.fh.write(json.dumps(dict(item)) + "\\n")
        self.fh.flush()
        return item

    def close_spider(self, spider=None):
        self.fh.close()
'''

E2E_SETTINGS = {
    "DOWNLOADER_MIDDLEWARES": {
        "scrapy.downloadermiddlewares.retry.RetryMiddleware": None,
        "scrapy_dist.middlewares.RetryMiddleware": 550,
    },
    "SPIDER_MIDDLEWARES": {
        "scrapy.spidermiddlewares.httperror.HttpErrorMiddleware": None,
        "scrapy_dist.middlewares.HttpErrorMiddleware": 50,
    },
    "ITEM_PIPELINES": {"proj.spiders.test_spiders.JsonLinesPipeline": 300},
    "RETRY_TIMES": 2,
    "RETRY_BACKOFF_BASE": 0.2,
    "DOWNLOAD_TIMEOUT": 1,
    "HTTPERROR_DEAD_LETTER": True,
    "RETRY_GIVE_UP_LOG_LEVEL": "INFO",
}

RETRY = CrawlKeys("retry")


@pytest.fixture
def failing_site() -> Iterator[FailingSite]:
    with FailingSite() as site:
        yield site


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def items(root: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(root.glob("items-*.jsonl")):
        pid = path.stem.split("-", 1)[1]
        out += [{**json.loads(line), "pid": pid} for line in path.read_text().splitlines()]
    return out


def dead_letters(client: redis.Redis) -> list[deadletter.DeadLetter]:
    return [parse_record(raw) for raw in client.lrange(RETRY.deadletter, 0, -1)]


def stat_sum(project: Any, key: str) -> int:
    return sum(project.stats(i).get(key, 0) for i in range(len(project.procs)))


@pytest.mark.slow
def test_two_workers_retry_with_backoff_retry_after_and_dead_letters(
    tmp_path: Path, redis_url: str, failing_site: FailingSite
) -> None:
    site = failing_site
    flaky = [f"/flaky/f{i}?fail=2&status=503" for i in range(6)]
    refused = f"http://127.0.0.1:{closed_port()}/refused"
    urls = [site.url(p) for p in flaky] + [
        site.url("/always500/a"), site.url("/slow/s"), refused, site.url("/retry-after/r?seconds=2"),
        site.url("/boom/noeb/b"), site.url("/notfound/noeb/n"), site.url("/ok/o"),
    ]
    project = make_project(tmp_path, {"REDIS_URL": redis_url, **E2E_SETTINGS}, spiders=SPIDERS)
    project.crawl("retry", {"urls": ",".join(urls)})
    project.crawl("retry")
    assert project.wait_all(90) == [0, 0], project.logs()[-4000:]

    got = items(tmp_path)
    # every flaky URL failed twice, then was crawled exactly once, retries at least the backoff apart
    for path in flaky:
        assert site.statuses(path) == [503, 503, 200], path
        first, second = site.gaps(path)
        assert first >= 0.2 and second >= 0.4, (path, first, second)
        assert sum(1 for i in got if i["url"] == site.url(path) and i.get("status") == 200) == 1
    print("backoff gaps (s):", {p: [round(g, 3) for g in site.gaps(p)] for p in flaky})
    print("2xx taken by worker pid:", {i["url"]: i["pid"] for i in got if i.get("status") == 200})
    # Retry-After: 2 was respected (not the 0.2 s backoff)
    assert site.statuses("/retry-after/r") == [429, 200]
    print("Retry-After gap (s):", site.gaps("/retry-after/r"))
    assert site.gaps("/retry-after/r")[0] >= 2.0

    # what finally failed is in the dead-letter list, once each
    client = redis.Redis.from_url(redis_url)
    letters = {urlsplit(d.url).path: d for d in dead_letters(client)}
    assert len(letters) == len(dead_letters(client)) == 5, letters
    assert (letters["/always500/a"].reason, letters["/always500/a"].attempts) == ("500", 3)
    assert letters["/always500/a"].status == 500 and site.statuses("/always500/a") == [500] * 3
    assert "Timeout" in letters["/slow/s"].reason and letters["/slow/s"].attempts == 3
    assert "ConnectionRefused" in letters["/refused"].reason and letters["/refused"].attempts == 3
    assert (letters["/boom/noeb/b"].reason, letters["/boom/noeb/b"].attempts) == ("builtins.ValueError", 1)
    assert (letters["/notfound/noeb/n"].reason, letters["/notfound/noeb/n"].status) == ("404", 404)
    assert all(d.worker and d.at > 0 and d.payload for d in letters.values())
    # errbacks saw final failures only, never an intermediate retry
    errbacks = sorted((urlsplit(i["url"]).path, i["errback"]) for i in got if "errback" in i)
    assert [p for p, _ in errbacks] == ["/always500/a", "/refused", "/slow/s"], errbacks
    assert client.zcard(RETRY.delayed) == 0 and client.zcard(RETRY.queue) == 0

    assert stat_sum(project, "retry/delayed") == 6 * 2 + 3 * 2 + 1
    assert stat_sum(project, "deadletter/count") == 5
    assert stat_sum(project, "deadletter/reason_count/500") == 1
    assert stat_sum(project, "httperror/response_ignored_status_count/404") == 1
    assert stat_sum(project, "retry/max_reached") == 3
    assert "RetryScheduled" not in project.logs()


@pytest.mark.slow
def test_delayed_retries_survive_the_death_of_the_only_worker(
    tmp_path: Path, redis_url: str, failing_site: FailingSite
) -> None:
    site = failing_site
    flaky = [f"/flaky/k{i}?fail=2&status=503" for i in range(5)]
    project = make_project(
        tmp_path,
        {"REDIS_URL": redis_url, **E2E_SETTINGS, "RETRY_BACKOFF_BASE": 1.5, "SCHEDULER_LEASE_SECONDS": 3},
        spiders=SPIDERS,
    )
    victim = project.crawl("retry", {"urls": ",".join(site.url(p) for p in flaky)})
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 30
    # every first retry is delayed and every failed attempt acknowledged: the worker holds nothing else
    while not (client.zcard(RETRY.delayed) == len(flaky) and client.zcard(RETRY.leases) == 0):
        assert time.monotonic() < deadline, project.logs()[-3000:]
        assert victim.poll() is None, project.logs()[-3000:]
        time.sleep(0.02)
    project.kill(victim)
    assert client.zcard(RETRY.delayed) == len(flaky)
    project.crawl("retry")
    codes = project.wait_all(60)
    assert codes[1] == 0, project.logs()[-3000:]
    for path in flaky:
        assert site.statuses(path) == [503, 503, 200], path
    assert sorted(i["url"] for i in items(tmp_path)) == sorted(site.url(p) for p in flaky)
    assert client.llen(RETRY.deadletter) == 0 and client.zcard(RETRY.delayed) == 0
    assert project.stats(1)["retry/delayed"] == len(flaky)  # the second retries, by the new worker
