"""Redis going away mid-crawl: workers warn once, keep what they hold, wait, and carry on without loss.

Each test runs real ``scrapy crawl`` workers with every Redis-backed component switched on -- seeds
(``RedisSpider``), the frontier and bloom filter, the retry and dead-letter middlewares, the monitoring
extensions, the shared cookie jar and the item pipeline -- stops Redis while they crawl, starts it again
on the same port with the same data files (AOF, fsync on every write), and checks that every page was
crawled, every item written, and that each component said so once instead of a traceback per request.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.cluster
from crawlproject import Project, two_workers_on_a_seed
from helpers import SEED_LINKS_SPIDER
from redis_cluster import is_own, start_own
from redis_servers import RedisProcess

from scrapy_dist.redis.keys import CrawlKeys

pytestmark = pytest.mark.slow

LINKS = CrawlKeys("links")
_WARNING = re.compile(r"\[([\w.]+)\] WARNING: (.*)")
PERSISTENT = ["--appendonly", "yes", "--appendfsync", "always"]


SETTINGS: dict[str, Any] = {
    "ADDONS": {"scrapy_dist.Addon": 0},
    "ITEM_PIPELINES": {"scrapy_dist.pipelines.RedisPipeline": 300},
    "DOWNLOADER_MIDDLEWARES": {
        "scrapy.downloadermiddlewares.cookies.CookiesMiddleware": None,
        "scrapy_dist.middlewares.cookies.SharedCookiesMiddleware": 700,
    },
    "CONCURRENT_REQUESTS": 8,
    "CLUSTERSTATS_INTERVAL": 1,
    "SCHEDULER_IDLE_BEFORE_CLOSE": 2,
}


def _stop(servers: list[RedisProcess]) -> None:
    """SIGTERM: Redis closes every connection, writes its AOF out and exits."""
    for s in servers:
        assert s.proc is not None
        s.proc.terminate()
    for s in servers:
        assert s.proc is not None
        s.proc.wait(10)


def _check_crawl(project: Project, site: Any, client: Any, stopped_at: int) -> None:
    assert project.wait_all(120) == [0, 0], project.logs()[-4000:]
    items = client.lrange(LINKS.items, 0, -1)
    assert stopped_at < site.graph.pages - 200, "the outage came too late to prove anything"
    fetched = site.fetch_counts(status=None)
    assert site.graph.pages - len(fetched) == 0, "pages lost"
    urls = {json.loads(raw)["url"] for raw in items}
    assert urls == {site.page_url(i) for i in range(site.graph.pages)}, "items lost"
    for _, log_path in project.procs:
        log = project.log_text(log_path)
        lines = log.splitlines()
        # the worker's one outage pair (scrapy_dist.redis.outage)
        named = r"\[scrapy_dist\.(redis\.outage|frontier\.scheduler)\]"
        policy = [line for line in lines if re.search(named, line)]
        assert 1 <= sum("Redis is unreachable" in line for line in policy) <= 2, policy
        assert 1 <= sum("Redis is reachable again" in line for line in policy) <= 2, policy
        assert "Traceback" not in log, log[-3000:]
        assert [line for line in lines if re.search(r"\b(ERROR|CRITICAL)\b", line)] == []
        # one warning per component (scheduler, seeds, pipeline, cookies, extensions), not one per request
        down = Counter(
            m.group(1) for m in map(_WARNING.search, lines) if m and "reachable again" not in m.group(2)
        )
        assert down and max(down.values()) == 1, down


def test_redis_restarted_mid_crawl_loses_nothing(tmp_path: Path, site_factory: Any) -> None:
    server = start_own(PERSISTENT)
    try:
        site = site_factory(pages=600, delay=0.01)
        project = two_workers_on_a_seed(
            tmp_path, {"REDIS_URL": server.url, **SETTINGS}, SEED_LINKS_SPIDER, redis.Redis(port=server.port),
            site, 250,
        )
        _stop([server])
        stopped_at = len(site.fetch_counts())
        time.sleep(3)
        server.start()
        assert is_own(server), "another program took the port during the outage"
        client = redis.Redis(port=server.port)
        try:
            _check_crawl(project, site, client, stopped_at)
        finally:
            client.close()
    finally:
        server.stop()


def test_whole_cluster_restarted_mid_crawl_loses_nothing(
    tmp_path: Path, site_factory: Any, redis_cluster: Any
) -> None:
    """Every node of a 3-master cluster stops at once (a data-centre power cut, a rolling restart gone
    wrong) and comes back with its AOF and nodes.conf."""
    cluster = redis_cluster(masters=3, extra_args=PERSISTENT)
    site = site_factory(pages=500, delay=0.01)
    project = two_workers_on_a_seed(
        tmp_path, {"REDIS_URL": cluster.url, **SETTINGS}, SEED_LINKS_SPIDER,
        redis.cluster.RedisCluster.from_url(cluster.url), site, 150,
    )
    _stop(cluster.nodes)
    stopped_at = len(site.fetch_counts())
    time.sleep(3)
    for node in cluster.nodes:
        node.start()
        assert is_own(node), "another program took the port during the outage"
    cluster.wait_ok()
    client = redis.cluster.RedisCluster.from_url(cluster.url)
    try:
        _check_crawl(project, site, client, stopped_at)
    finally:
        client.close()
