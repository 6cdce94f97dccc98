"""End-to-end revisits: real ``scrapy crawl`` workers, a real Redis, small local sites.

* a worker SIGKILLed while it holds pages (leases in flight, revisits filed) loses no revisit, and no page
  is ever filed twice: once the crawl settles, the frontier holds exactly one entry per page;
* conditional revisits send the page's ETag back, a 304 does not call the callback, and a chain stops
  when the callback says so (``revisit_after = None``) or raises.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis
from crawlproject import SPIDERS, make_project
from helpers import queue_singles, wait_for

from scrapy_dist.frontier.shard import SEQ_BYTES, lease_member
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.wire.codec import load_payload

pytestmark = pytest.mark.slow

LINKS = CrawlKeys("links")


def _urls_in_frontier(client: redis.Redis, keys: CrawlKeys) -> list[str]:
    members = [s for m in client.zrange(keys.queue, 0, -1) for s in queue_singles(m)]
    members += client.zrange(keys.leases, 0, -1) + client.zrange(keys.delayed, 0, -1)
    return sorted(load_payload(lease_member(m)[SEQ_BYTES:])["u"] for m in members)


def test_revisits_survive_a_sigkilled_worker_and_are_never_doubled(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    pages = 12
    site = site_factory(pages=pages, links=3, delay=0.2)
    project = make_project(tmp_path, {
        "REDIS_URL": redis_url, "CONCURRENT_REQUESTS": 4, "SCHEDULER_LEASE_SECONDS": 2,
        "REVISIT_AFTER": {"*": 1.5}, "REVISIT_MIN_INTERVAL": 0.1, "SCHEDULER_IDLE_POLL": 0.1,
    })
    first = project.crawl(args={"seed": site.page_url(0)}, settings={"SCHEDULER_IDLE_BEFORE_CLOSE": "none"})
    # every page fetched once, and some fetched again: revisits are running; kill while pages are in flight
    wait_for(lambda: len(site.fetch_counts()) == pages and max(site.fetch_counts().values()) >= 2, 60,
             "every page fetched, and revisits running")
    project.kill(first)
    killed_at = time.monotonic()
    second = project.crawl(settings={"CLOSESPIDER_TIMEOUT": 6, "SCHEDULER_IDLE_BEFORE_CLOSE": "none"})
    assert second.wait(60) == 0, project.logs()[-3000:]
    # the second worker fetched every page again: nothing the killed worker held was lost
    after = {p for t, p, s in site.log if t > killed_at + 0.5 and s == 200}
    assert after == {f"/page/{i}" for i in range(pages)}, sorted(after)
    # the second worker closed gracefully (its leases given back): each page is in the frontier once
    client = redis.Redis.from_url(redis_url)
    assert client.zcard(LINKS.leases) == 0
    urls = _urls_in_frontier(client, LINKS)
    assert urls == sorted(site.page_url(i) for i in range(pages)), urls
    assert int(client.hget(LINKS.delayed_meta, "revisits") or 0) == client.zcard(LINKS.delayed)


# -- conditional revisits and chain stops -----------------------------------------------------------

class _EtagSite:
    """/a, /b, /c; /c has an ETag (never changing) and answers 304 to a matching If-None-Match."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int, str]] = []
        site = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                etag = f'"v1-{self.path}"'
                sent = self.headers.get("If-None-Match") or ""
                status = 304 if sent == etag else 200
                site.log.append((self.path, status, sent))
                body = b"" if status == 304 else f"<html><body>{self.path}</body></html>".encode()
                self.send_response(status)
                if self.path == "/c":
                    self.send_header("ETag", etag)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def count(self, path: str, status: int | None = None) -> int:
        return sum(1 for p, s, _ in self.log if p == path and (status is None or s == status))


REVISIT_SPIDER = SPIDERS + '''

class RevisitSpider(scrapy.Spider):
    """/a stops its chain after two fetches (revisit_after = None), /b raises on its second fetch, /c goes
    on (conditionally). One item per callback call."""

    name = "revisit"

    def __init__(self, base=None, **kw):
        super().__init__(**kw)
        self.base = base
        self.not_modified = 0

    async def start(self):
        for path in ("/a", "/b", "/c"):
            yield scrapy.Request(self.base + path, meta={"revisit_after": 0.5})

    def parse(self, response):
        path = response.url[len(self.base):]
        self.crawler.stats.inc_value(f"test/parsed{path}")
        fetched = self.crawler.stats.get_value(f"test/parsed{path}")
        if path == "/a" and fetched >= 2:
            response.meta["revisit_after"] = None
        if path == "/b" and fetched >= 2:
            raise ValueError("the chain of /b stops here")
        yield {"url": response.url}

    def on_not_modified(self, response):
        self.crawler.stats.inc_value("test/on_not_modified")
'''


def test_conditional_revisits_and_chain_stops(tmp_path: Path, redis_url: str) -> None:
    site = _EtagSite()
    project = make_project(tmp_path, {
        "REDIS_URL": redis_url, "REVISIT_CONDITIONAL": True, "REVISIT_MIN_INTERVAL": 0.1,
        "SCHEDULER_IDLE_POLL": 0.1,
        "CLOSESPIDER_TIMEOUT": 5, "SCHEDULER_IDLE_BEFORE_CLOSE": "none",
        "DOWNLOADER_MIDDLEWARES": {"scrapy_dist.middlewares.ConditionalRevisitMiddleware": 580},
    }, spiders=REVISIT_SPIDER)
    proc = project.crawl("revisit", args={"base": site.url})
    assert proc.wait(60) == 0, project.logs()[-3000:]
    stats = project.stats(0)
    site.httpd.shutdown()
    assert site.count("/a") == 2 and site.count("/b") == 2, site.log
    # /c: the first fetch is a 200, every revisit sends its ETag back and gets a 304
    assert site.count("/c", 200) == 1 and site.count("/c", 304) >= 3, site.log
    assert all(sent == '"v1-/c"' for p, s, sent in site.log if p == "/c" and s == 304)
    assert stats["test/parsed/c"] == 1  # a 304 does not call the callback
    assert stats["revisit/not_modified"] == stats["test/on_not_modified"] == site.count("/c", 304)
    assert stats["revisit/stopped"] == 2
    assert stats.get("log_count/ERROR", 0) == 1  # the callback's own exception, nothing else
