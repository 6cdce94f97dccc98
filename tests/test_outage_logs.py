"""Quiet, truthful logs: a Redis outage is one WARNING and one "reachable again" INFO per worker
-- not one per component -- and a worker start logs no redis-py maintenance-notification lines. Real
``scrapy crawl`` workers; the outage is a real redis-server stopped and started again on the same port."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from crawlproject import make_project, two_workers_on_a_seed
from helpers import SEED_LINKS_SPIDER
from redis_cluster import is_own, start_own

from scrapy_dist.redis.keys import CrawlKeys

pytestmark = pytest.mark.slow

LINKS = CrawlKeys("links")
PERSISTENT = ["--appendonly", "yes", "--appendfsync", "always"]
SETTINGS: dict[str, Any] = {
    "ADDONS": {"scrapy_dist.Addon": 0},
    "ITEM_PIPELINES": {"scrapy_dist.pipelines.RedisPipeline": 300},
    "DOWNLOADER_MIDDLEWARES": {
        "scrapy.downloadermiddlewares.cookies.CookiesMiddleware": None,
        "scrapy_dist.middlewares.cookies.SharedCookiesMiddleware": 700,
    },
    "CONCURRENT_REQUESTS": 8,
    "CLUSTERSTATS_INTERVAL": 0.5,
    "SCHEDULER_IDLE_BEFORE_CLOSE": 2,
}
_LINE = re.compile(r"\[([\w.]+)\] (WARNING|INFO): (.*)")


def _outage_lines(log: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(logger, message) of the lines saying Redis went away, and of those saying it is back."""
    down, back = [], []
    for m in map(_LINE.search, log.splitlines()):
        if m is None:
            continue
        name, _level, text = m.groups()
        if "reachable again" in text or "works again" in text:
            back.append((name, text))
        elif re.search(r"unreachable|unavailable|Cannot (write|read)", text):
            down.append((name, text))
    return down, back


def test_an_outage_is_one_warning_and_one_info_per_worker(tmp_path: Path, site_factory: Any) -> None:
    server = start_own(PERSISTENT)
    try:
        site = site_factory(pages=400, delay=0.01)
        project = two_workers_on_a_seed(
            tmp_path, {"REDIS_URL": server.url, **SETTINGS}, SEED_LINKS_SPIDER, redis.Redis(port=server.port),
            site, 150,
        )
        assert server.proc is not None
        server.proc.terminate()
        server.proc.wait(10)
        # every worker has noticed (its one warning), then the outage lasts long enough for each
        # component -- seeds, frontier, pipeline, cookies, the three monitors -- to fail repeatedly
        deadline = time.monotonic() + 30
        while not all("Redis is unreachable" in project.log_text(log) for _, log in project.procs):
            assert time.monotonic() < deadline, project.logs()[-3000:]
            time.sleep(0.05)
        time.sleep(3)
        server.start()
        assert is_own(server), "another program took the port during the outage"
        assert project.wait_all(120) == [0, 0], project.logs()[-4000:]
    finally:
        server.stop()
    assert len(site.fetch_counts(status=None)) == site.graph.pages
    for _, log_path in project.procs:
        log = project.log_text(log_path)
        down, back = _outage_lines(log)
        # one WARNING and one INFO per worker, whichever component noticed first
        assert [name for name, _ in down] == ["scrapy_dist.redis.outage"], down
        assert [name for name, _ in back] == ["scrapy_dist.redis.outage"], back
        assert f"] INFO: {back[0][1]}" in log  # said at INFO, not WARNING
        # several components saw the outage, yet the worker said so once
        noticed = back[0][1].split("failed calls of the ", 1)[1]
        assert noticed.count(",") >= 3, back
        assert "Traceback" not in log, log[-3000:]


def test_a_worker_start_logs_no_maintenance_notification_lines(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    site = site_factory(pages=20)
    settings = {"REDIS_URL": redis_url, **SETTINGS, "LOG_LEVEL": "DEBUG"}
    project = make_project(tmp_path, settings, spiders=SEED_LINKS_SPIDER)
    client = redis.Redis.from_url(redis_url)
    client.rpush(LINKS.start_urls, site.page_url(0))
    client.close()
    project.crawl(settings={"SCHEDULER_IDLE_BEFORE_CLOSE": 1})
    assert project.wait_all(120) == [0], project.logs()[-3000:]
    log = project.logs()
    assert "[redis" in log or "DEBUG" in log  # DEBUG logging was on
    assert len(site.fetch_counts()) == 20
    assert "maintenance notifications" not in log, [
        line for line in log.splitlines() if "maintenance notifications" in line
    ][:3]
