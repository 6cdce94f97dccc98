"""Every feature on a real local Redis Cluster (3 masters; 3 more as replicas for the failover test).

A cluster refuses a script or transaction whose keys live in different hash slots (redis-py already
refuses to send it), so each component is run for real here: the frontier's sync script, both
dupefilters, the seeds scripts, the monitoring extensions, the item pipeline, the retry and dead-letter
middlewares and the CLI. The end-to-end tests crawl a local site with real ``scrapy crawl`` workers
whose ``REDIS_URL`` names one node of the cluster.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio.cluster
import redis.cluster
from click.testing import CliRunner
from crawlproject import kill_one_of_three, links_back, log_problems, lost_and_dupes, make_project
from helpers import SEED_LINKS_SPIDER, run, wait_for_pages
from redis.crc import key_slot
from redis_cluster import LocalCluster
from scrapy import Request
from scrapy.utils.test import get_crawler

from scrapy_dist.cli import main
from scrapy_dist.dupefilter import BloomDupeFilter, SetDupeFilter
from scrapy_dist.dupefilter.bloom import fingerprint_hashes
from scrapy_dist.frontier.orders import dead_letter_record
from scrapy_dist.frontier.shard import SEQ_BYTES, Frontier, SyncBatch, lease_member
from scrapy_dist.pipelines import RedisPipeline
from scrapy_dist.redis.connection import get_async_redis, get_redis, is_cluster
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.settings import SchedulerSettings
from scrapy_dist.spiders import SeedReader

LINKS = CrawlKeys("links")
BOOKS = CrawlKeys("books")


@pytest.fixture
def cluster_url(cluster: LocalCluster) -> str:
    cluster.flushall()
    # A node that does not serve the crawl's slot: the client must find its way by itself.
    owner = cluster.master_of(LINKS.queue)
    return next(n for n in cluster.nodes if n is not owner).url


def _client(url: str) -> redis.cluster.RedisCluster:
    return redis.cluster.RedisCluster.from_url(url)


# -- components, one by one ------------------------------------------------------------------------


def test_any_node_url_gives_cluster_clients(cluster_url: str) -> None:
    sync = get_redis({"REDIS_URL": cluster_url})
    try:
        assert is_cluster(sync)
        # keys of one crawl all live on one node, seeds on theirs: nothing here may raise MOVED/CROSSSLOT
        sync.set(LINKS.control, "x")
        sync.rpush(LINKS.start_urls, "http://a.example/")
        assert sync.get(LINKS.control) == b"x"
    finally:
        sync.close()
    assert isinstance(get_async_redis({"REDIS_URL": cluster_url}), redis.asyncio.cluster.RedisCluster)


def _urls(n: int) -> list[bytes]:
    return [f"http://a.example/{i}".encode() for i in range(n)]


def test_frontier_sync_script_on_a_cluster(cluster_url: str) -> None:
    """Enqueue with dedupe, lease, ack, delay, reject and dead-letter in single sync calls."""
    sync_client = get_redis({"REDIS_URL": cluster_url})
    df = BloomDupeFilter(sync_client, LINKS, None, capacity=10_000, error_rate=0.001)
    df.open()

    async def go() -> tuple[Any, Any, Any]:
        client = get_async_redis({"REDIS_URL": cluster_url})
        f = Frontier(client, LINKS, "w1", df, SchedulerSettings(lease_seconds=30))
        urls = _urls(20)
        entries = [(*fingerprint_hashes(u.ljust(20, b".")), 0.0, b"P" + u, "", "") for u in urls]
        first = await f.sync(SyncBatch(enqueue=entries + entries[:5], lease=8))
        member = first.leased[0][0]
        second = await f.sync(SyncBatch(
            enqueue=entries[:3],
            ack=[member],
            delay=[(0.0, b"Pdelayed", time.time() + 600, "", "")],
            reject=[(first.leased[1][0], '{"reason": "test"}')],
            dead=['{"url": "http://a.example/dead"}'],
            lease=0,
        ))
        await client.aclose()
        return first, second, member

    first, second, _ = asyncio.run(go())
    assert first.new == [True] * 20 + [False] * 5
    assert [lease_member(m)[SEQ_BYTES:] for m, _ in first.leased] == [b"P" + u for u in _urls(8)]
    assert second.new == [False] * 3
    assert (second.queued, second.inflight, second.delayed) == (12, 6, 1)
    c = _client(cluster_url)
    try:
        assert c.llen(LINKS.deadletter) == 1 and c.llen(LINKS.queue_rejected) == 1
        assert c.zscore(LINKS.workers, "w1") is not None
    finally:
        c.close()
        sync_client.close()


def test_script_calls_go_straight_to_the_node_of_their_keys(cluster: LocalCluster, cluster_url: str) -> None:
    """The clients read an FCALL's slot from its keys: redis-py would ask a node first (COMMAND GETKEYS),
    two extra round trips before every sync call."""
    sync_client = get_redis({"REDIS_URL": cluster_url})
    df = BloomDupeFilter(sync_client, LINKS, None, capacity=10_000, error_rate=0.001)
    df.open()
    nodes = [redis.Redis(port=n.port) for n in cluster.nodes]
    for node in nodes:
        node.config_resetstat()

    async def go() -> list[Any]:
        client = get_async_redis({"REDIS_URL": cluster_url})
        f = Frontier(client, LINKS, "w1", df, SchedulerSettings(lease_seconds=30))
        entries = [(*fingerprint_hashes(u.ljust(20, b".")), 0.0, b"P" + u, "", "") for u in _urls(5)]
        got = [await f.sync(SyncBatch(enqueue=entries, lease=2)), await f.sync(SyncBatch(lease=2))]
        await client.aclose()
        return got

    first, second = asyncio.run(go())
    stats = [n.info("commandstats") for n in nodes]
    for node in nodes:
        node.close()
    sync_client.close()
    assert first.new == [True] * 5 and len(first.leased) == len(second.leased) == 2
    calls = {name: sum(s.get(f"cmdstat_{name}", {}).get("calls", 0) for s in stats)
             for name in ("fcall", "evalsha", "command|getkeys")}
    assert calls["fcall"] + calls["evalsha"] >= 2  # FCALL from Redis 7 on
    assert calls["command|getkeys"] == 0


@pytest.mark.parametrize("cls", [BloomDupeFilter, SetDupeFilter])
def test_dupefilters_request_seen_on_a_cluster(cluster_url: str, cls: type) -> None:
    """Scrapy's own scheduler path: the synchronous request_seen() on a cluster client."""
    crawler = get_crawler(settings_dict={"REDIS_URL": cluster_url, "BLOOMFILTER_CAPACITY": 10_000})
    crawler.spidercls.name = "links"
    df = cls.from_crawler(crawler)
    df.open()
    try:
        reqs = [Request(f"http://a.example/{i}") for i in range(30)]
        assert [df.request_seen(r) for r in reqs] == [False] * 30
        assert [df.request_seen(r) for r in reqs[:10]] == [True] * 10
        assert df.seen_tokens([df.tokens(r) for r in reqs[25:]] + [df.tokens(Request("http://b.example/"))],
                              add=False) == [True] * 5 + [False]
    finally:
        df.close("finished")
        df.redis.close()


def test_bloom_batch_of_several_calls_on_a_cluster(cluster_url: str) -> None:
    """A batch of several script calls through a cluster client (one call after the other), also after
    the nodes forgot the script."""
    client = _client(cluster_url)
    df = BloomDupeFilter(client, LINKS, None, capacity=10_000, error_rate=0.001)
    df.open()
    toks = [fingerprint_hashes(os.urandom(20)) for _ in range(400)]
    assert df.seen_tokens(toks[:300]) == [False] * 300
    for node in client.get_primaries():
        node.redis_connection.script_flush()
    assert df.seen_tokens(toks) == [True] * 300 + [False] * 100
    client.close()


def test_seeds_scripts_on_a_cluster(cluster_url: str) -> None:
    """Seeds live in the slot of the plain ``<spider>:start_urls`` name, and so does the processing
    state of the workers holding them: take, wait (BLMOVE), adopt and rejections all work."""
    c = _client(cluster_url)
    c.rpush(BOOKS.start_urls, *[f"http://a.example/{i}" for i in range(6)])

    async def go() -> tuple[Any, Any, Any, Any, Any]:
        dead = SeedReader(get_async_redis({"REDIS_URL": cluster_url}), BOOKS, "dead", lease_seconds=10)
        live = SeedReader(get_async_redis({"REDIS_URL": cluster_url}), BOOKS, "live", lease_seconds=10)
        taken = await dead.take(4, now=1000)
        later = await live.take(0, now=2000)  # the dead worker's lease ran out long ago
        adopted = await live.adopt(later.expired, now=2000)
        again = await live.take(10, now=2001)
        c.rpush(BOOKS.start_urls, "http://a.example/pushed")
        waited = await live.wait(timeout=2)
        pushed = await live.take(10, now=2002)
        await live.record_rejections(['{"reason": "bad_scheme"}'])
        await dead.close()
        await live.close()
        return taken, later, adopted, again, (waited, pushed)

    taken, later, adopted, again, (waited, pushed) = asyncio.run(go())
    assert taken.status == "ok" and len(taken.entries) == 4
    assert later.expired == ["dead"]
    assert adopted == (1, 4, 0)
    assert sorted(again.entries) == sorted(f"http://a.example/{i}".encode() for i in range(6))
    assert waited
    assert pushed.entries == [b"http://a.example/pushed"]
    assert c.llen(BOOKS.start_urls_rejected) == 1
    c.close()


class RoutedPipeline(RedisPipeline):
    """Items to several keys (the scrapy-redis ``item_key`` hook): on a cluster their slots differ."""

    def item_key(self, item: Any) -> str:
        return f"{self.key}:{item['kind']}"


@pytest.mark.parametrize("stream", [False, True])
def test_item_pipeline_writes_to_keys_of_several_slots(cluster_url: str, stream: bool) -> None:
    async def go() -> None:
        pipeline = RoutedPipeline(get_async_redis({"REDIS_URL": cluster_url}), "books:items", stream=stream,
                                  flush_interval=0.01)
        await pipeline.open_spider()
        items = [{"kind": kind, "n": n} for n in range(5) for kind in "abcdefgh"]
        await asyncio.gather(*(pipeline.process_item(item) for item in items))
        await pipeline.close_spider()

    run(go())
    c = _client(cluster_url)
    try:
        keys = [f"books:items:{kind}" for kind in "abcdefgh"]
        assert len({key_slot(k.encode()) for k in keys}) > 1
        length = c.xlen if stream else c.llen
        assert [length(k) for k in keys] == [5] * 8
    finally:
        c.close()


def _cli(url: str, *args: str) -> Any:
    result = CliRunner().invoke(main, ["--redis-url", url, *args], catch_exceptions=False)
    return result


def test_cli_on_a_cluster(cluster_url: str) -> None:
    pushed = _cli(cluster_url, "push", "books", "http://a.example/1", "http://a.example/2", "ftp://nope/")
    assert pushed.exit_code == 1, pushed.output  # one seed rejected: the valid ones are pushed anyway
    c = _client(cluster_url)
    try:
        assert c.llen(BOOKS.start_urls) == 2
        assert _cli(cluster_url, "pause", "books").exit_code == 0
        assert c.hget(BOOKS.control, "paused") == b"1"
        status = _cli(cluster_url, "status", "books", "--json")
        assert status.exit_code == 0, status.output
        data = json.loads(status.output)
        assert data["state"] == "paused" and data["seeds"]["waiting"] == 2
        assert _cli(cluster_url, "resume", "books").exit_code == 0
        record = dead_letter_record(Request("http://a.example/dead"), reason="500", worker="w1", status=500)
        c.rpush(BOOKS.deadletter, record)
        listed = _cli(cluster_url, "dead", "books", "--json")
        assert listed.exit_code == 0, listed.output
        assert [json.loads(line)["url"] for line in listed.output.splitlines()] == ["http://a.example/dead"]
        requeued = _cli(cluster_url, "dead", "books", "--requeue")
        assert requeued.exit_code == 0, requeued.output
        assert c.zcard(BOOKS.queue) == 1 and c.llen(BOOKS.deadletter) == 0
        c.rpush(BOOKS.items, json.dumps({"title": "x"}))
        items = _cli(cluster_url, "items", "books", "--json-lines")
        assert items.exit_code == 0 and json.loads(items.output.strip()) == {"title": "x"}
    finally:
        c.close()


# -- end to end ------------------------------------------------------------------------------------



@pytest.mark.slow
def test_crawl_with_every_feature_on_a_cluster(tmp_path: Path, cluster_url: str, site_factory: Any) -> None:
    """Seeds pushed with the CLI, three workers with the add-on (frontier, bloom filter, retry and
    dead-letter middlewares, monitoring extensions) and the item pipeline: everything lands where it
    would on a single Redis."""
    site = site_factory(pages=400, flaky=8, missing=4, delay=0.002, flaky_failures=1)
    project = make_project(
        tmp_path,
        {
            "REDIS_URL": cluster_url,
            "ADDONS": {"scrapy_dist.Addon": 0},
            "ITEM_PIPELINES": {"scrapy_dist.pipelines.RedisPipeline": 300},
            "HTTPERROR_DEAD_LETTER": True,
            "RETRY_BACKOFF_BASE": 0.2,
            "CLUSTERSTATS_INTERVAL": 1,
            "SCHEDULER_IDLE_BEFORE_CLOSE": 2,
        },
        spiders=SEED_LINKS_SPIDER,
    )
    c = _client(cluster_url)
    c.rpush(LINKS.start_urls, b"javascript:alert(1)")  # hostile seed: rejected with a reason
    pushed = CliRunner().invoke(main, ["--redis-url", cluster_url, "push", "links", site.page_url(0)])
    assert pushed.exit_code == 0, pushed.output
    for _ in range(3):
        project.crawl()
    assert project.wait_all(120) == [0, 0, 0], project.logs()[-4000:]
    assert log_problems(project.logs()) == []
    counts = site.fetch_counts(status=None)
    assert len(counts) == site.graph.pages
    flaky = {f"/page/{i}" for i in site.graph.flaky}
    # flaky pages: 503, then retried; the seed's page: again when a link finds it (seeds skip the filter)
    again = {"/page/0": 2} if links_back(site.graph) else {}
    assert {path: n for path, n in counts.items() if n != 1} == {**dict.fromkeys(flaky, 2), **again}
    assert c.llen(LINKS.items) == site.graph.ok_pages + len(again)
    dead = [json.loads(r) for r in c.lrange(LINKS.deadletter, 0, -1)]
    assert sorted(d["url"] for d in dead) == sorted(site.page_url(i) for i in site.graph.missing)
    rejected = [json.loads(r) for r in c.lrange(LINKS.start_urls_rejected, 0, -1)]
    assert [r["reason"] for r in rejected] == ["bad_scheme"]
    assert c.zcard(LINKS.queue) == c.zcard(LINKS.leases) == c.zcard(LINKS.delayed) == 0
    assert c.llen(LINKS.start_urls) == 0
    status = CliRunner().invoke(main, ["--redis-url", cluster_url, "status", "links", "--json"])
    data = json.loads(status.output)
    # merged from the three workers (a 503 that is retried never reaches the engine as a response)
    assert data["stats"]["response_received_count"] == site.graph.pages + len(again)
    assert data["deadletter"] == len(site.graph.missing)
    assert data["workers_summary"]["total"] == 3
    c.close()


@pytest.mark.slow
def test_items_ride_the_acks_on_a_cluster_with_the_crawls_hash_tag(
    tmp_path: Path, cluster_url: str, site_factory: Any
) -> None:
    """An items key carrying the crawl's hash tag shares the frontier's slot: items are written by the
    acknowledging sync call (no batches of their own), once per page; the default key says why not."""
    site = site_factory(pages=60)
    base = {"REDIS_URL": cluster_url, "ITEM_PIPELINES": {"scrapy_dist.pipelines.RedisPipeline": 300},
            "SCHEDULER_IDLE_BEFORE_CLOSE": 1}
    project = make_project(tmp_path, {**base, "REDIS_ITEMS_KEY": "{%(spider)s}:items"},
                           spiders=SEED_LINKS_SPIDER)
    c = _client(cluster_url)
    c.rpush(LINKS.start_urls, site.page_url(0))
    project.crawl()
    assert project.wait_all(60) == [0], project.logs()[-3000:]
    assert "at least once" not in project.logs()
    stats = project.stats(0)
    assert stats.get("redis_items/batches") is None  # every item rode its page's ack
    items = [json.loads(x)["url"] for x in c.lrange("{links}:items", 0, -1)]
    assert len(items) == site.graph.ok_pages + links_back(site.graph)  # the seed's page twice if linked
    assert len(set(items)) == site.graph.ok_pages
    other = make_project(tmp_path / "default-key", base, spiders=SEED_LINKS_SPIDER)
    c.rpush(LINKS.start_urls, site.page_url(1))
    other.crawl()
    assert other.wait_all(60) == [0], other.logs()[-3000:]
    assert 'REDIS_ITEMS_KEY = "{%(spider)s}:items"' in other.logs()
    assert other.stats(0).get("redis_items/batches")  # there, items went in batches of their own
    c.close()


@pytest.mark.slow
def test_sigkilled_worker_loses_nothing_on_a_cluster(
    tmp_path: Path, cluster_url: str, site_factory: Any
) -> None:
    site = site_factory(pages=600, delay=0.01)
    c = _client(cluster_url)
    kill_one_of_three(tmp_path, cluster_url, site, c, [LINKS.leases], min_pages=200)
    assert c.zcard(LINKS.queue) == 0 and c.zcard(LINKS.leases) == 0
    c.close()


@pytest.mark.slow
def test_non_persistent_crawl_removes_its_keys_on_a_cluster(
    tmp_path: Path, cluster_url: str, site_factory: Any
) -> None:
    site = site_factory(pages=50)
    project = make_project(tmp_path, {"REDIS_URL": cluster_url, "SCHEDULER_PERSIST": False})
    project.crawl(args={"seed": site.page_url(0)})
    assert project.wait_all(60) == [0], project.logs()[-3000:]
    assert len(site.fetch_counts()) == 50
    c = _client(cluster_url)
    assert [k for k in c.keys(target_nodes=redis.cluster.RedisCluster.ALL_NODES) if b"{links}" in k] == []
    c.close()


@pytest.mark.slow
def test_killed_master_fails_over_and_the_crawl_finishes(
    tmp_path: Path, redis_cluster: Any, site_factory: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGKILL the master holding the crawl's slot mid-crawl: its replica takes over after
    cluster-node-timeout and the workers carry on. Writes the dead master had not yet sent to its
    replica are lost (Redis replication is asynchronous), so pages may be lost, but only a handful;
    the number is printed."""
    cluster = redis_cluster(masters=3, replicas=1, node_timeout_ms=1000)
    site = site_factory(pages=400, delay=0.01)
    project = make_project(
        tmp_path,
        {"REDIS_URL": cluster.url, "CONCURRENT_REQUESTS": 8, "SCHEDULER_LEASE_SECONDS": 5,
         "SCHEDULER_IDLE_BEFORE_CLOSE": 2},
    )
    project.crawl(args={"seed": site.page_url(0)})
    wait_for_pages(site, 1)
    project.crawl()
    project.wait_until_open()
    wait_for_pages(site, 200)
    old = cluster.master_of(LINKS.queue)
    cluster.kill(old)
    new = cluster.wait_failover(LINKS.queue, old)
    assert new is not old
    assert project.wait_all(120) == [0, 0], project.logs()[-4000:]
    lost, dupes = lost_and_dupes(site)
    with capsys.disabled():
        print(f"\n[failover] pages lost: {lost} of {site.graph.pages}, fetched twice: {dupes}")
    assert lost <= 50, lost  # a few batches at most: what async replication had not shipped
    log = project.logs()
    assert "Redis is unreachable" in log and "reachable again" in log
    assert not [line for line in log_problems(log) if "Traceback" in line]
