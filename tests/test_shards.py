"""The sharded frontier (``SCHEDULER_SHARDS = N``): routing by fingerprint, exact dedupe per shard, priority
order across shards, acks and lease expiry per shard, crawl-wide readers, and real crawls on a 3-master
Redis Cluster. Real Redis only; the unit tests drive the scheduler's rounds by hand (no background task,
no sleeps)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.cluster
from crawlproject import kill_one_of_three, log_problems, lost_and_dupes, make_project
from helpers import run
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis_cluster import LocalCluster
from scrapy import Request, Spider
from scrapy.utils.test import get_crawler

from scrapy_dist.frontier.orders import dead_letter_record
from scrapy_dist.frontier.scheduler import Scheduler
from scrapy_dist.frontier.shard import domain_shard, shard_of, shards_idle
from scrapy_dist.monitor import read_status
from scrapy_dist.redis.keys import CrawlKeys

LINKS = CrawlKeys("links")
UNIT = CrawlKeys("unit")


class _Spider(Spider):
    name = "unit"

    def parse(self, response: Any) -> None:  # pragma: no cover - never called
        pass


async def _open(redis_url: str, shards: int = 3, **settings: Any) -> Scheduler:
    """An opened scheduler whose rounds the test drives itself (no background task, no engine: a request
    handed out counts as finished at the next collection)."""
    crawler = get_crawler(
        _Spider,
        {
            "REDIS_URL": redis_url,
            "SCHEDULER_SHARDS": shards,
            "BLOOMFILTER_CAPACITY": 30_000,
            "DUPEFILTER_CLASS": "scrapy_dist.dupefilter.BloomDupeFilter",
            "SCHEDULER_PREFETCH": 100,
            **settings,
        },
    )
    crawler.spider = crawler._create_spider()
    sched = Scheduler.from_crawler(crawler)
    await sched.open_async(crawler.spider, start=False)
    return sched


async def _round(sched: Scheduler, lease: int = 0) -> BaseException | None:
    """One round of ``sched`` with every shard, after collecting the requests handed out."""
    assert sched.loop is not None
    sched.loop.collect_finished(0.0)
    return await sched.loop.round(lease, renew=False)


def _urls(n: int, tag: str = "p") -> list[str]:
    return [f"http://site.test/{tag}/{i}" for i in range(n)]


async def _open_with(redis_url: str, urls: list[str]) -> Scheduler:
    """An opened scheduler with ``urls`` enqueued in its buffers (not yet sent)."""
    s = await _open(redis_url)
    for url in urls:
        s.enqueue_request(Request(url))
    return s


def _fp(sched: Scheduler, url: str) -> bytes:
    return sched.df.fingerprint(Request(url))


def _queued(client: redis.Redis, keys: CrawlKeys) -> int:
    return int(client.hget(keys.queue_tails, "count") or 0)


# -- keys ------------------------------------------------------------------------------------------


def test_shard_keys_keep_shard_zero_and_spread_over_the_slot_ranges() -> None:
    assert CrawlKeys("books").shard(0, 3) == CrawlKeys("books")
    assert CrawlKeys("books", prefix="x:").shard(1, 3).queue.startswith("x:{books#")
    for name in ("links", "books", "spider", "quotes", "example", "a", "news-2024"):
        keys = CrawlKeys(name).shards(3)
        thirds = {key_slot(k.queue.encode()) * 3 // REDIS_CLUSTER_HASH_SLOTS for k in keys}
        assert len(thirds) == 3, (name, [k.tag for k in keys])  # one shard per master of an even 3-split
        assert len({k.tag for k in keys}) == 3


# -- one standalone Redis, N = 3 ---------------------------------------------------------------------


def test_requests_go_to_the_shard_of_their_fingerprint(redis_url: str, redis_client: redis.Redis) -> None:
    async def go() -> Scheduler:
        sched = await _open(redis_url)
        for url in _urls(90):
            assert sched.enqueue_request(Request(url))
        assert await _round(sched) is None
        await sched.redis.aclose()
        return sched

    sched = run(go())
    expected = [0, 0, 0]
    for url in _urls(90):
        expected[shard_of(_fp(sched, url), 3)] += 1
    got = [_queued(redis_client, k) for k in UNIT.shards(3)]
    assert got == expected and all(got), got
    assert sched.frontier_status == {"queued": 90, "inflight": 0, "delayed": 0}
    assert redis_client.hget(UNIT.control, "shards") == b"3"
    # each shard has its own filter, sized for a third of the capacity
    caps = [int(redis_client.hget(k.bloom, "capacity")) for k in UNIT.shards(3)]
    assert caps == [10_000] * 3


def test_the_same_url_from_two_workers_is_admitted_once(redis_url: str, redis_client: redis.Redis) -> None:
    async def go() -> tuple[Any, Any]:
        a, b = await _open(redis_url), await _open(redis_url)
        for s in (a, b):
            for url in _urls(60):
                s.enqueue_request(Request(url))
        await asyncio.gather(_round(a), _round(b))
        stats = a.stats.get_value("scheduler/enqueued", 0), b.stats.get_value("scheduler/enqueued", 0)
        filtered = a.stats.get_value("dupefilter/filtered", 0) + b.stats.get_value("dupefilter/filtered", 0)
        await a.redis.aclose()
        await b.redis.aclose()
        return stats, filtered

    (ea, eb), filtered = run(go())
    assert ea + eb == 60 and filtered == 60
    assert sum(_queued(redis_client, k) for k in UNIT.shards(3)) == 60


def test_a_worker_starts_the_high_priority_requests_of_any_shard_first(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def go() -> list[Request]:
        producer, worker = await _open(redis_url), await _open(redis_url)
        # low priority ones in one shard, high priority ones in another
        low = [u for u in _urls(200, "low") if shard_of(_fp(producer, u), 3) == 0][:10]
        high = [u for u in _urls(200, "high") if shard_of(_fp(producer, u), 3) == 2][:10]
        for url in low:
            producer.enqueue_request(Request(url, priority=0))
        for url in high:
            producer.enqueue_request(Request(url, priority=5))
        await _round(producer)
        await _round(worker)  # learns the queue lengths
        await _round(worker, 100)
        out = []
        while (r := worker.next_request()) is not None:
            out.append(r)
        for s in (producer, worker):
            await s.redis.aclose()
        return out

    got = run(go())
    assert len(got) == 20
    assert [r.priority for r in got] == [5] * 10 + [0] * 10
    assert all("/high/" in r.url for r in got[:10])


def test_acks_go_to_the_leasing_shard_after_the_output_has_landed(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def go() -> None:
        s = await _open_with(redis_url, _urls(30))
        await _round(s)
        await _round(s, 100)
        handed = []
        while (r := s.next_request()) is not None:
            handed.append(r)
        assert len(handed) == 30
        assert sum(redis_client.zcard(k.leases) for k in UNIT.shards(3)) == 30
        # each finished request found a child (in whatever shard its fingerprint says)
        for r in handed:
            s.enqueue_request(Request(r.url + "/child"))
        await _round(s)
        # the children are in; the acks wait for a round that follows their landing
        assert sum(_queued(redis_client, k) for k in UNIT.shards(3)) == 30
        assert sum(redis_client.zcard(k.leases) for k in UNIT.shards(3)) == 30
        await _round(s)
        assert sum(redis_client.zcard(k.leases) for k in UNIT.shards(3)) == 0
        assert not s.ledger.held and not s.ledger.acks
        await s.redis.aclose()

    run(go())


def test_a_busy_worker_sends_one_shard_per_round_and_the_others_wait_their_turn(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """With writes for every shard, a round calls one shard in turn; what it keeps for the others does not
    make a round due by itself (new writes do, after the flush interval, as with one master), only the
    idle poll when nothing new comes; the seeds' "flushed" mark moves once every shard has had its turn."""

    async def go() -> None:
        s = await _open(redis_url)
        loop = s.loop
        assert loop is not None
        loop.next_fetch = loop.next_renew = math.inf  # only the writes decide when a round is due
        mark = time.monotonic()
        for url in _urls(30):
            s.enqueue_request(Request(url))
        landed, flushed = [], []
        for _ in range(3):
            await loop.round(lease=0, renew=False, partial=True)
            landed.append(sum(_queued(redis_client, k) for k in UNIT.shards(3)))
            flushed.append(s.flushed_since(mark))
            if len(landed) == 1:
                assert s.ledger.first_pending is None and len(s.ledger.out) == 30 - landed[0]
                loop.last_sync = now = time.monotonic()
                assert not loop.due(now + 4 * s.config.flush_interval)[0]  # kept for shards 1 and 2
                assert loop.due(now + s.config.idle_poll + 0.01)[0]  # nothing new comes: they go all the same
                full = dataclasses.replace(loop.config, flush_batch=len(s.ledger.out))
                loop.config, config = full, loop.config
                assert loop.due(now)[0]  # a full batch goes at once, kept or not
                loop.config = config
                s.enqueue_request(Request("http://site.test/new"))  # a new write is due after the interval
                assert (written := s.ledger.first_pending) is not None
                assert not loop.due(written + 0.5 * s.config.flush_interval)[0]
                assert loop.due(written + 1.2 * s.config.flush_interval)[0]
        shards = [shard_of(_fp(s, u), 3) for u in _urls(30)]
        second = landed[0] + shards.count(1)  # and the new write, if its shard is 1
        assert landed[0] == shards.count(0) > 0 and landed[1] in (second, second + 1)
        assert landed[2] == 31 and not s.ledger.out
        assert flushed == [False, False, True]
        await s.redis.aclose()

    run(go())


def test_an_ack_with_output_only_in_its_own_shard_is_sent_with_it(redis_url: str) -> None:
    async def go() -> None:
        s = await _open(redis_url)
        s.enqueue_request(Request("http://site.test/one"))
        await _round(s)
        await _round(s, 10)
        r = s.next_request()
        assert r is not None
        shard = s.ledger.handed[r][0]
        child = next(u for u in _urls(100, "c") if shard_of(_fp(s, u), 3) == shard)
        s.enqueue_request(Request(child))
        await _round(s)
        assert not s.ledger.held  # one atomic call carried the child and the ack
        await s.redis.aclose()

    run(go())


def test_expired_leases_of_a_dead_worker_in_shard_2_are_requeued(
    redis_url: str, redis_client: redis.Redis
) -> None:
    shard2 = UNIT.shard(2, 3)

    async def go() -> Any:
        dead, alive = await _open_with(redis_url, _urls(60)), await _open(redis_url)
        await _round(dead)
        await _round(dead, 100)
        held2 = redis_client.zcard(shard2.leases)
        assert held2 > 0 and redis_client.zcard(shard2.queue) == 0
        # the dead worker's leases in shard 2 run out (deadline moved into the past instead of waiting)
        redis_client.zadd(shard2.leases, dict.fromkeys(redis_client.zrange(shard2.leases, 0, -1), 1.0))
        await _round(alive)
        requeued = alive.stats.get_value("scheduler/requeued/lease_expired")
        for s in (dead, alive):
            await s.redis.aclose()
        return held2, requeued

    held2, requeued = run(go())
    assert requeued == held2
    assert redis_client.zcard(shard2.leases) == 0 and _queued(redis_client, shard2) == held2


def test_dead_letters_status_idle_and_flush_see_every_shard(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def go() -> None:
        s = await _open_with(redis_url, _urls(30))
        record = dead_letter_record(Request("http://site.test/dead"), reason="500", worker="w", status=500)
        s.dead_letter(record)
        await _round(s)
        assert s.loop is not None and s.loop.state is not None
        assert not s.loop.state.empty_confirmed
        assert not await shards_idle(s.redis, s.layout.shard_keys)
        status = read_status(redis.Redis.from_url(redis_url), UNIT)
        assert status["shards"] == 3 and status["frontier"]["queued"] == 30
        assert status["filter"]["items"] == 30 and status["filter"]["shards"] == 3
        assert status["deadletter"] == 1
        await _round(s, 100)
        while (r := s.next_request()) is not None:
            assert r
        await _round(s)
        await _round(s)
        assert s.frontier_status == {"queued": 0, "inflight": 0, "delayed": 0}
        assert s.loop.state.empty_confirmed and not s.has_pending_requests()
        assert await shards_idle(s.redis, s.layout.shard_keys)
        await s.redis.aclose()

    run(go())
    assert redis_client.llen(UNIT.deadletter) == 1
    assert [k.decode() for k in redis_client.keys("*#*")]  # the other shards have keys
    run(_flushed(redis_url))
    # only the fresh filters' parameter hashes, recorded again by the flushing worker
    assert sorted(k.decode() for k in redis_client.keys("*") if b"#" in k) == sorted(
        k.bloom for k in UNIT.shards(3)[1:]
    )
    assert all(not redis_client.hget(k.bloom, "n") for k in UNIT.shards(3))


async def _flushed(redis_url: str) -> None:
    s = await _open(redis_url, SCHEDULER_FLUSH_ON_START=True)
    await s.redis.aclose()


def test_a_worker_with_another_shard_count_is_refused(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def go() -> None:
        s = await _open(redis_url, shards=3)
        await s.redis.aclose()
        assert (await _open(redis_url, shards=2)).refused

    with caplog.at_level(logging.ERROR):
        run(go())
    assert "runs with SCHEDULER_SHARDS=3; this worker has 2" in caplog.text


def test_a_garbled_shard_count_is_refused_with_one_line(
    redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    redis_client.hset(UNIT.control, "shards", "three")

    async def go() -> None:
        assert (await _open(redis_url, shards=3)).refused

    with caplog.at_level(logging.ERROR):
        run(go())
    assert "invalid shards field 'three'" in caplog.text


def test_cluster_politeness_with_shards_routes_by_domain(redis_url: str, redis_client: Any) -> None:
    """SCHEDULER_SHARDS > 1 with crawl-wide politeness: every request of a domain goes to one shard (its
    queue, its limits and its URLs' fingerprints), so each domain's delay stays one atomic decision and
    dedupe stays exact; a 429 pushes the domain back on that shard."""
    hosts = [f"h{i}.example" for i in range(12)]

    async def go() -> tuple[Scheduler, int]:
        s = await _open(redis_url, SCHEDULER_POLITENESS="cluster", SCHEDULER_DENY_NETWORKS=[])
        for h in hosts:
            for i in range(5):
                s.enqueue_request(Request(f"http://{h}/p/{i}"))
        s.penalties.penalize("h0.example", 30.0)
        await _round(s)
        other = await _open(redis_url, SCHEDULER_POLITENESS="cluster", SCHEDULER_DENY_NETWORKS=[])
        for h in hosts:  # a second worker finds the same links: all duplicates, whatever the shard
            other.enqueue_request(Request(f"http://{h}/p/0"))
        await _round(other)
        filtered = other.stats.get_value("dupefilter/filtered", 0)
        for x in (s, other):
            await x.redis.aclose()
        return s, filtered

    s, filtered = run(go())
    assert filtered == len(hosts)
    shards = UNIT.shards(3)
    used = set()
    for h in hosts:
        home = domain_shard(h, 3)
        used.add(home)
        for i, k in enumerate(shards):  # scheduled on its home shard only
            assert (redis_client.zscore(k.domains, h) is not None) == (i == home), (h, i)
        assert redis_client.zlexcount(shards[home].queue, f"[{h}\0", f"({h}\1") == 5
    assert used == {0, 1, 2}  # twelve hosts spread over the three shards
    # the joining worker's default limits, for `status` to show the domains without limits of their own
    assert redis_client.hget(UNIT.control, "limits") == s.encoder.domain_limits.default.encode().encode()
    home = shards[domain_shard("h0.example", 3)]
    assert float(redis_client.hget(home.domain_info, "p:h0.example").split()[1]) > time.time() + 20


# -- a real 3-master cluster, real `scrapy crawl` workers ----------------------------------------------


@pytest.fixture
def cluster_url(cluster: LocalCluster) -> str:
    cluster.flushall()
    # the three shards of "links" are served by the three masters
    assert len({cluster.master_of(k.queue).port for k in LINKS.shards(3)}) == 3
    return cluster.nodes[0].url


@pytest.mark.slow
def test_three_sharded_workers_crawl_everything_on_a_cluster(
    tmp_path: Path, cluster_url: str, site_factory: Any
) -> None:
    site = site_factory(pages=400, delay=0.002)
    project = make_project(
        tmp_path,
        {
            "REDIS_URL": cluster_url,
            "SCHEDULER_SHARDS": 3,
            "SCHEDULER_IDLE_BEFORE_CLOSE": 2,
            "ADDONS": {"scrapy_dist.Addon": 0},
            "CLUSTERSTATS_INTERVAL": 1,
        },
    )
    for i in range(3):
        project.crawl(args={"seed": site.page_url(0)} if i == 0 else None)
    assert project.wait_all(120) == [0, 0, 0], project.logs()[-4000:]
    assert log_problems(project.logs()) == []
    assert lost_and_dupes(site) == (0, 0)
    c = redis.cluster.RedisCluster.from_url(cluster_url)
    per_shard = [int(c.hget(k.bloom, "n") or 0) for k in LINKS.shards(3)]
    assert sum(per_shard) == 400 and all(n > 50 for n in per_shard), per_shard
    for k in LINKS.shards(3):
        assert c.zcard(k.queue) == c.zcard(k.leases) == c.zcard(k.delayed) == 0
    status = read_status(c, LINKS)
    assert status["shards"] == 3 and status["stats"]["response_received_count"] == 400
    assert all(project.stats(i)["finish_reason"] == "finished" for i in range(3))
    c.close()


@pytest.mark.slow
def test_sigkilled_sharded_worker_loses_nothing_on_a_cluster(
    tmp_path: Path, cluster_url: str, site_factory: Any
) -> None:
    site = site_factory(pages=600, delay=0.01)
    c = redis.cluster.RedisCluster.from_url(cluster_url)
    lease_sets = [k.leases for k in LINKS.shards(3)]
    kill_one_of_three(tmp_path, cluster_url, site, c, lease_sets, min_pages=150,
                      settings={"SCHEDULER_SHARDS": 3})
    for k in LINKS.shards(3):
        assert c.zcard(k.queue) == c.zcard(k.leases) == 0
    c.close()


def test_forget_and_requeue_follow_domain_routing(redis_url: str, redis_client: Any, tmp_path: Path) -> None:
    """With crawl-wide politeness and shards, `forget` removes a URL's fingerprint from its host's shard and
    `dead --requeue` puts a dead letter back on its host's shard."""
    from click.testing import CliRunner
    from scrapy.utils.request import RequestFingerprinter

    from scrapy_dist.cli import main

    shards = UNIT.shards(3)
    redis_client.hset(UNIT.control, mapping={"politeness": "cluster", "shards": "3"})
    url = "http://f2.example/p/1"
    home = shards[domain_shard("f2.example", 3)]
    assert home != shards[0]  # shard 0 would also be where a tool without routing puts things
    fp = RequestFingerprinter().fingerprint(Request(url))
    for k in shards:
        redis_client.sadd(k.fingerprints, fp)
    result = CliRunner().invoke(main, ["--redis-url", redis_url, "forget", "unit", url])
    assert result.exit_code == 0, result.output
    assert [redis_client.sismember(k.fingerprints, fp) for k in shards] == [k != home for k in shards]
    record = dead_letter_record(Request(url), reason="500", worker="w1", status=500)
    redis_client.rpush(UNIT.deadletter, record)
    result = CliRunner().invoke(main, ["--redis-url", redis_url, "dead", "unit", "--requeue"])
    assert result.exit_code == 0, result.output
    assert [redis_client.zcard(k.queue) for k in shards] == [int(k == home) for k in shards]
