"""One oversized item must not wedge a worker: it is refused with a reason and a stat, the items after it
are written, Redis's own refusals are named as such (not as an outage), and a SIGTERMed worker facing a
Redis that refuses every write stops within SCHEDULER_SHUTDOWN_GRACE."""

from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.exceptions
from crawlproject import make_project
from helpers import wait_for

from scrapy_dist.redis.outage import Backoff, Outage

SPIDER = '''
import scrapy


class BigSpider(scrapy.Spider):
    """The seed page yields one huge item, then small ones; links are followed."""

    name = "big"

    def __init__(self, seed=None, big_mb="0", **kw):
        super().__init__(**kw)
        self.seed, self.big_mb = seed, int(big_mb)

    async def start(self):
        yield scrapy.Request(self.seed)

    def parse(self, response):
        if self.big_mb and response.url == self.seed:
            yield {"url": response.url, "blob": "x" * (self.big_mb * 1024 * 1024)}
        yield {"url": response.url}
        for href in response.css("a::attr(href)").getall():
            yield response.follow(href)
'''


@pytest.mark.slow
@pytest.mark.parametrize("exactly_once", [True, False], ids=["riding-acks", "batches"])
def test_an_oversized_item_is_refused_and_the_crawl_goes_on(
    tmp_path: Path, site_factory: Any, redis_servers: Any, exactly_once: bool
) -> None:
    (server,) = redis_servers(1, extra_args=["--maxmemory", "24mb", "--maxmemory-policy", "noeviction"])
    site = site_factory(pages=20, links=3)
    project = make_project(tmp_path, {
        "REDIS_URL": server.url, "ITEM_PIPELINES": {"scrapy_dist.pipelines.RedisPipeline": 300},
        "REDIS_ITEMS_EXACTLY_ONCE": exactly_once, "REDIS_ITEMS_FLUSH_INTERVAL": 0.1,
        "SCHEDULER_SHUTDOWN_GRACE": 5,
    }, spiders=SPIDER)
    try:
        project.crawl("big", args={"seed": site.page_url(0), "big_mb": "40"})
        assert project.wait_all(timeout=90) == [0], project.logs()[-3000:]
    finally:
        project.stop_all()
    client = redis.Redis.from_url(server.url)
    urls = sorted(json.loads(v)["url"] for v in client.lrange("big:items", 0, -1))
    assert urls == sorted(site.page_url(i) for i in range(20))  # every small item, none of the huge one
    assert project.stats(0).get("redis_items/too_large") == 1
    logs = project.logs()
    assert "more than REDIS_ITEMS_MAX_BYTES" in logs and "unreachable" not in logs


@pytest.mark.slow
def test_a_sigterm_is_honoured_while_redis_refuses_every_write(
    tmp_path: Path, site_factory: Any, redis_servers: Any
) -> None:
    (server,) = redis_servers(1, extra_args=["--maxmemory-policy", "noeviction"])
    site = site_factory(pages=400, links=4, slow=300, slow_delay=0.5)
    project = make_project(tmp_path, {
        "REDIS_URL": server.url, "ITEM_PIPELINES": {"scrapy_dist.pipelines.RedisPipeline": 300},
        "SCHEDULER_SHUTDOWN_GRACE": 2, "CONCURRENT_REQUESTS": 4,
    }, spiders=SPIDER)
    client = redis.Redis.from_url(server.url)
    try:
        worker = project.crawl("big", args={"seed": site.page_url(0)})
        deadline = time.monotonic() + 60
        while client.llen("big:items") < 5:
            assert time.monotonic() < deadline and worker.poll() is None, project.logs()[-3000:]
            time.sleep(0.05)
        client.config_set("maxmemory", str(int(client.info("memory")["used_memory"]) // 2))  # full: OOM
        wait_for(lambda: "Redis refuses writes (OOM" in project.logs(), 30, "the worker told of the OOM")
        worker.send_signal(signal.SIGTERM)
        started = time.monotonic()
        worker.wait(40)
        took = time.monotonic() - started
    finally:
        client.config_set("maxmemory", "0")
        project.stop_all()
    logs = project.logs()
    assert took < 2 + 15, (took, logs[-3000:])
    assert "Redis refuses writes (OOM" in logs, logs[-3000:]
    assert "Redis is unreachable" not in logs


def test_redis_refusals_are_named_not_reported_as_an_outage(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.refusals")
    outage = Outage(log)
    guard = outage.guard("item pipeline", Backoff(), log)
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        oom = "command not allowed when used memory > 'maxmemory'"
        guard.failed(redis.exceptions.OutOfMemoryError(oom), 0.0)
        outage.since = None
        guard.failed(redis.exceptions.ReadOnlyError("You can't write against a read only replica."), 1.0)
        guard.failed(redis.exceptions.NoPermissionError("this user has no permissions to run 'rpush'"), 2.0)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("Redis refuses writes (OOM: ")
    assert lines[1].startswith("Redis refuses writes (READONLY: ")
    assert "NOPERM: the Redis user lacks an ACL permission" in lines[2]
    assert not any("unreachable" in line for line in lines)
