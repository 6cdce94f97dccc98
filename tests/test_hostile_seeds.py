"""Hostile contents of the seeds' bookkeeping keys (``{<seeds key>}:processing``, ``{<seeds key>}:workers``):
whatever someone else writes there must neither stop the seeds nor be read again at every call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
from crawlproject import links_back, log_problems, lost_and_dupes, make_project
from helpers import SEED_LINKS_SPIDER, run

from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.seeds.feed import HELD_CAP, SeedReader

KEYS = CrawlKeys("books")
LINKS = CrawlKeys("links")


def reader(url: str, worker: str) -> SeedReader:
    return SeedReader(redis.asyncio.Redis.from_url(url), KEYS, worker, lease_seconds=10.0)


@pytest.mark.parametrize("write", ["processing", "workers"])
def test_a_bookkeeping_key_of_another_type_is_moved_aside_and_seeds_flow(
    redis_url: str, redis_client: Any, write: str
) -> None:
    # refused with WRONGTYPE, the take failed for every worker until someone deleted the key by hand
    key = KEYS.start_urls_processing if write == "processing" else KEYS.start_urls_workers
    redis_client.set(key, "not ours")
    redis_client.rpush(KEYS.start_urls, b"http://a.example/1", b"http://a.example/2")

    async def go() -> Any:
        r = reader(redis_url, "w1")
        first = await r.take(5, now=1000)
        second = await r.take(5, acks=first.entries, now=1001)
        await r.close()
        return first, second

    first, second = run(go())
    assert first.status == "ok" and first.entries == [b"http://a.example/1", b"http://a.example/2"]
    assert first.repaired == [key] and second.repaired == []
    assert redis_client.get(key + ":garbage") == b"not ours"
    assert redis_client.lrange(KEYS.start_urls_processing, 0, -1) == []
    assert redis_client.zscore(KEYS.start_urls_workers, "w1") == pytest.approx(1011)


def test_garbage_in_the_processing_list_is_read_once_not_at_every_adoption(
    redis_url: str, redis_client: Any
) -> None:
    # entries of no worker and expired workers must not make every adoption read the whole list again
    junk = [f"junk{i}".encode() for i in range(20_000)]
    junk += [f"ghost{i}\nhttp://a.example/g".encode() for i in range(20)]
    redis_client.rpush(KEYS.start_urls_processing, *junk)
    redis_client.zadd(KEYS.start_urls_workers, {f"expired{i}": 0 for i in range(5)})
    redis_client.zadd(KEYS.start_urls_workers, {"forever": float("inf"), "far": 1e300})
    redis_client.rpush(KEYS.start_urls_processing, b"forever\nhttp://a.example/f", b"expired3\nhttp://a.example/e")

    async def go() -> Any:
        r = reader(redis_url, "w1")
        calls = []
        for i in range(5):
            seen = await r.take(0, now=1000 + i)
            calls.append((seen, await r.adopt(seen.expired, now=1000 + i)))
        await r.close()
        return calls

    calls = run(go())
    # the first adoption gives back the strays and its workers' entries, in one pass; a deadline no lease
    # gives (inf, 1e300) counts as run out
    (first, adopted), *later = calls
    assert sorted(first.expired) == sorted([f"expired{i}" for i in range(5)] + ["far", "forever"])
    assert adopted == (7, 2, len(junk))
    assert all(a == (0, 0, 0) for _, a in later)
    assert redis_client.lrange(KEYS.start_urls_processing, 0, -1) == []
    assert redis_client.zrange(KEYS.start_urls_workers, 0, -1) == [b"w1"]
    back = redis_client.lrange(KEYS.start_urls, 0, -1)
    assert len(back) == len(junk) + 2 and b"http://a.example/f" in back and b"junk0" in back


def test_a_processing_list_past_its_bound_is_tidied_by_the_next_take(
    redis_url: str, redis_client: Any
) -> None:
    # garbage filed under a live worker's id: every acknowledgement (LREM) scanned it, at every take
    redis_client.zadd(KEYS.start_urls_workers, {"live": 2000})
    mine = [f"live\nhttp://a.example/{i}".encode() for i in range(3)]
    redis_client.rpush(KEYS.start_urls_processing, *mine)
    redis_client.rpush(KEYS.start_urls_processing, *[b"live\njunk"] * (2 * HELD_CAP), b"nobody")
    redis_client.rpush(KEYS.start_urls, b"http://a.example/new")

    async def go() -> Any:
        r = reader(redis_url, "w1")
        first = await r.take(1, now=1000)
        second = await r.take(1, now=1001)
        await r.close()
        return first, second

    first, second = run(go())
    # the live worker keeps its first HELD_CAP entries; the rest goes back to the seeds key (where it is read
    # as seeds and rejected)
    assert first.strays == HELD_CAP + 4 and second.strays == 0
    rest = redis_client.lrange(KEYS.start_urls_processing, 0, -1)
    assert rest[:3] == mine and rest[3:HELD_CAP] == [b"live\njunk"] * (HELD_CAP - 3)
    assert rest[HELD_CAP:] == [b"w1\n" + e for e in first.entries + second.entries]
    assert redis_client.llen(KEYS.start_urls) == HELD_CAP + 4 + 1 - 2


def test_a_processing_key_of_another_type_does_not_stop_a_real_crawl(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    site = site_factory(pages=30, links=3)
    client = redis.Redis.from_url(redis_url)
    client.set(LINKS.start_urls_processing, "not ours")
    client.hset(LINKS.start_urls_workers, "a", "b")
    client.rpush(LINKS.start_urls, site.page_url(0))
    project = make_project(
        tmp_path, {"REDIS_URL": redis_url, "SCHEDULER_IDLE_BEFORE_CLOSE": 2}, spiders=SEED_LINKS_SPIDER
    )
    project.crawl()
    try:
        assert project.wait_all(60) == [0]
    finally:
        project.stop_all()
    logs = project.logs()
    assert lost_and_dupes(site) == (0, links_back(site.graph))  # the seed's page, found again by a link
    assert not log_problems(logs), log_problems(logs)[:5]
    for key in (LINKS.start_urls_processing, LINKS.start_urls_workers):
        assert logs.count(f"Repaired garbage in {key}") == 1
