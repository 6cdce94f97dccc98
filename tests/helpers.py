"""Small helpers shared by the test files: run a coroutine, wait for a condition, the ``SeedLinks`` spider.

Servers and ports live in ``redis_servers.py`` (the benchmarks load it too), the generated Scrapy project
in ``crawlproject.py``.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from scrapy_dist.frontier.shard import LEASE_MARK, SEQ_BYTES

T = TypeVar("T")

#: Source of a ``RedisSpider`` for ``crawlproject.make_project(spiders=...)``: follows every link from the
#: seeds pushed to ``links:start_urls``; one item per page.
SEED_LINKS_SPIDER = '''
import scrapy
from scrapy_dist.spiders import RedisSpider


class SeedLinks(RedisSpider):
    """Follows every link from the seeds pushed to links:start_urls; one item per page."""

    name = "links"

    def parse(self, response):
        yield {"url": response.url}
        for href in response.css("a::attr(href)").getall():
            yield response.follow(href)
'''


def lease_key(member: bytes, worker: str, score: str = "0") -> bytes:
    """A lease key as the sync script files it (lua/sync_sweep.lua): ``member``, the mark, the tag
    ``"<score> <worker>"`` and the tag's 2-byte length -- built by hand, to write hostile or older leases."""
    tag = f"{score} {worker}".encode()
    return member + LEASE_MARK + tag + len(tag).to_bytes(2, "big")


def run(coro: Awaitable[T], timeout: float = 30) -> T:
    """Run ``coro`` in a fresh event loop; a test whose coroutine hangs fails after ``timeout`` seconds."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def wait_for(
    condition: Callable[[], object],
    timeout: float,
    what: str,
    interval: float = 0.05,
    ignore: tuple[type[BaseException], ...] = (),
) -> None:
    """Poll ``condition`` every ``interval`` seconds until it is true; fail naming ``what`` after
    ``timeout`` seconds. Exceptions of the ``ignore`` types count as "not yet" (a server starting up)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except ignore:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def wait_for_pages(site: Any, n: int, timeout: float = 60) -> None:
    """Until ``site`` (a :class:`scrapy_dist.demo.site.SiteServer`) has answered ``n`` distinct pages."""
    try:
        wait_for(lambda: len(site.fetch_counts()) >= n, timeout, f"{n} pages")
    except AssertionError:
        raise AssertionError(f"only {len(site.fetch_counts())} of {n} pages after {timeout:g} s") from None


def read_demo_until_crawling(
    proc: subprocess.Popen[str], on_worker: Callable[[int], None], timeout: float = 90
) -> tuple[list[str], bool]:
    """Read a running ``scrapy-dist demo``'s output until its live view counts a crawled page (or
    ``timeout``); ``on_worker(pid)`` is called for each worker it says it started. Returns the lines read
    and whether a page was crawled."""
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        lines.append(line)
        started = re.search(r"started worker \d+ \(pid (\d+)\)", line)
        if started:
            on_worker(int(started.group(1)))
        crawled = re.search(r"\] ([\d,]+)/", line)
        if crawled and int(crawled.group(1).replace(",", "")) > 0:
            return lines, True
        if time.monotonic() > deadline:
            break
    return lines, False


#: the deployment examples (docker-compose, Prometheus, Grafana)
DEPLOY = Path(__file__).resolve().parent.parent / "docs" / "deploy"


def dashboard_metrics() -> set[str]:
    """Every ``scrapy_dist_*`` metric the Grafana dashboard's queries name (``_total`` dropped)."""
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "scrapy-dist.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs.append(dash["templating"]["list"][0]["query"])
    return {m.removesuffix("_total") for e in exprs for m in re.findall(r"scrapy_dist_\w+", e)}


async def open_bloom_scheduler(
    redis_url: str, name: str, spider_attrs: dict[str, Any] | None = None, **settings: Any
) -> Any:
    """A scrapy-dist ``Scheduler`` with a small bloom filter, opened for a plain spider called ``name``
    (with ``spider_attrs`` as class attributes, without reading seeds): for tests that enqueue and sync
    by hand."""
    from scrapy import Spider
    from scrapy.utils.test import get_crawler

    from scrapy_dist.frontier.scheduler import Scheduler

    crawler = get_crawler(type("HelperSpider", (Spider,), {"name": name, **(spider_attrs or {})}), {
        "REDIS_URL": redis_url, "BLOOMFILTER_CAPACITY": 10_000,
        "DUPEFILTER_CLASS": "scrapy_dist.dupefilter.BloomDupeFilter", **settings,
    })
    crawler.spider = crawler._create_spider()
    sched = Scheduler.from_crawler(crawler)
    await sched.open_async(crawler.spider, start=False)
    return sched


def queue_singles(member: bytes) -> list[bytes]:
    """The entries (``6-byte seq + payload``, as leased) inside one member of the queue ZSET: a member
    whose 7th byte is ``\\0`` is a chunk of records ``<2-byte length><6-byte seq><payload>``, anything
    else one entry (``chunk_singles`` in ``lua/sync_common.lua``, but lenient)."""
    if len(member) < 7 or member[6] != 0:
        return [member]
    out, p = [], 7
    while p < len(member):
        if p + 2 > len(member):
            out.append(member[p:])
            break
        n = int.from_bytes(member[p : p + 2], "big")
        if p + 2 + SEQ_BYTES + n > len(member):
            out.append(member[p:])
            break
        out.append(member[p + 2 : p + 2 + SEQ_BYTES + n])
        p += 2 + SEQ_BYTES + n
    return out
