"""Signed queue entries are bound to their crawl and to the kind of key they were written for, and an
entry counts once: against a real Redis, with schedulers driven round by round."""

from __future__ import annotations

import base64
import json
import time
from typing import Any, cast

import pytest
import redis
import redis.asyncio
from click.testing import CliRunner
from helpers import open_bloom_scheduler, run
from scrapy import Request

from scrapy_dist.cli import main
from scrapy_dist.frontier.orders import dead_letter_record
from scrapy_dist.frontier.scheduler import Scheduler
from scrapy_dist.frontier.shard import Frontier, SyncBatch, lease_member
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.settings import SchedulerSettings
from scrapy_dist.wire.codec import EntryPolicy

SECRET = "one-secret-for-two-crawls"
HOSTILE = Request(
    "http://elsewhere.test/steal", meta={"proxy": "http://proxy.attacker.test:3128"},
    headers={"Authorization": "Bearer CRAWL-A-TOKEN"},
)


async def _opened(redis_url: str, name: str, **settings: Any) -> Scheduler:
    sched = await open_bloom_scheduler(
        redis_url, name, {"allowed_domains": ["site.test"]}, SCHEDULER_ENTRY_SECRET=SECRET, **settings
    )
    return cast("Scheduler", sched)


async def _fetched(sched: Scheduler, rounds: int = 3) -> list[Request]:
    """What the scheduler hands out over a few rounds (each one acknowledges what the last handed out)."""
    assert sched.loop is not None
    out = []
    for _ in range(rounds):
        sched.loop.collect_finished(time.monotonic())
        await sched.loop.round(lease=10, renew=False)
        while (request := sched.next_request()) is not None:
            out.append(request)
    return out


def _reasons(client: redis.Redis, key: str) -> list[str]:
    return [json.loads(r)["reason"] for r in client.lrange(key, 0, -1)]


def test_an_entry_signed_by_another_crawl_with_the_same_secret_is_not_trusted(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    b_keys = CrawlKeys("crawlb")

    async def go() -> list[Request]:
        a = await _opened(redis_url, "crawla")
        assert a.loop is not None
        a.enqueue_request(HOSTILE.replace(dont_filter=True))
        await a.loop.round(lease=0, renew=False)
        await a.redis.aclose()
        for member, score in client.zrange(CrawlKeys("crawla").queue, 0, -1, withscores=True):
            client.zadd(b_keys.queue, {member: score})
        b = await _opened(redis_url, "crawlb")
        got = await _fetched(b)
        await b.redis.aclose()
        return got

    assert run(go()) == []
    assert _reasons(client, b_keys.queue_rejected) == ["bad_tag"]


@pytest.mark.parametrize("layout", [
    {},  # FIFO by priority: queue chunks
    {"SCHEDULER_QUEUE_CLASS": "scrapy_redis.queue.LifoQueue"},  # one member per request
    {"SCHEDULER_POLITENESS": "cluster"},  # members prefixed with their domain
])
def test_a_copy_of_an_entry_handed_out_is_not_fetched_again(
    redis_url: str, layout: dict[str, Any]
) -> None:
    client = redis.Redis.from_url(redis_url)
    keys = CrawlKeys("once")

    async def go() -> tuple[list[Request], int]:
        sched = await _opened(redis_url, "once", **layout)
        assert sched.loop is not None
        sched.enqueue_request(Request("http://site.test/a", dont_filter=True))
        sched.enqueue_request(Request("http://site.test/a", dont_filter=True))  # a twin: fetched twice
        await sched.loop.round(lease=0, renew=False)
        copies = client.zrange(keys.queue, 0, -1, withscores=True)
        assert sched.loop is not None
        await sched.loop.round(lease=10, renew=False)
        first = [r for r in iter(sched.next_request, None)]  # in flight, not acknowledged yet
        for member, score in copies:  # copies put back while the originals are in flight
            client.zadd(keys.queue, {member: score})
        first += await _fetched(sched)
        for _ in range(3):  # the same members, put back after their requests were acknowledged
            for member, score in copies:
                client.zadd(keys.queue, {member: score})
            first += await _fetched(sched)
        await sched.redis.aclose()
        return first, sched.stats.get_value("scheduler/rejected/replayed")

    fetched, replayed = run(go())
    assert replayed == len(client.lrange(keys.queue_rejected, 0, -1)) >= 4
    assert [r.url for r in fetched] == ["http://site.test/a"] * 2
    assert set(_reasons(client, keys.queue_rejected)) == {"replayed"}


def test_a_retry_a_twin_and_a_dead_letter_requeued_are_fetched(redis_url: str, monkeypatch: Any) -> None:
    monkeypatch.setenv("SCRAPY_DIST_SECRET", SECRET)
    keys = CrawlKeys("legit")

    async def first() -> list[str]:
        sched = await _opened(redis_url, "legit")
        sched.enqueue_request(Request("http://site.test/r", meta={"download_slot": "mine"}))
        urls = [r.url for r in await _fetched(sched, rounds=2)]
        sched.delay_request(Request("http://site.test/r", meta={"download_slot": "mine"}, dont_filter=True),
                            0.0)
        urls += [r.url for r in await _fetched(sched, rounds=2)]
        dead = Request("http://site.test/d", meta={"download_slot": "mine"})
        sched.dead_letter(dead_letter_record(dead, reason="500", worker="w", policy=sched.dead_policy), dead)
        await _fetched(sched, rounds=1)
        await sched.redis.aclose()
        return urls

    async def then() -> list[str]:
        sched = await _opened(redis_url, "legit")
        urls = [r.url for r in await _fetched(sched, rounds=2)]
        await sched.redis.aclose()
        return urls

    urls = run(first())
    letter = redis.Redis.from_url(redis_url).lindex(keys.deadletter, 0)
    for _ in range(2):  # the same record requeued twice (planted again): its request is fetched once
        result = CliRunner().invoke(main, ["--redis-url", redis_url, "dead", "legit", "--requeue"])
        assert "requeued 1 dead letters" in result.output, result.output
        urls += run(then())
        redis.Redis.from_url(redis_url).rpush(keys.deadletter, letter)
    assert urls == ["http://site.test/r"] * 2 + ["http://site.test/d"]
    assert _reasons(redis.Redis.from_url(redis_url), keys.queue_rejected) == ["replayed"]


def test_dead_requeue_refuses_a_letter_whose_tag_is_not_this_crawls(redis_url: str, monkeypatch: Any) -> None:
    monkeypatch.setenv("SCRAPY_DIST_SECRET", SECRET)
    client = redis.Redis.from_url(redis_url)

    async def letter_of_crawl_a() -> str:
        a = await _opened(redis_url, "crawla")
        record = dead_letter_record(HOSTILE, reason="500", worker="w", policy=a.dead_policy)
        await a.redis.aclose()
        return record

    client.rpush(CrawlKeys("crawlb").deadletter, run(letter_of_crawl_a()))
    result = CliRunner().invoke(main, ["--redis-url", redis_url, "dead", "crawlb", "--requeue"])
    assert "requeued 0 dead letters" in result.output, result.output
    kept = [line for line in result.output.splitlines() if line.startswith("kept")]
    assert len(kept) == 1 and "tag" in kept[0] and "crawl" in kept[0]
    assert client.zcard(CrawlKeys("crawlb").queue) == 0
    assert client.llen(CrawlKeys("crawlb").deadletter) == 1


def test_a_dead_letter_payload_planted_in_the_queue_is_not_trusted(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    keys = CrawlKeys("kinds")

    async def go() -> list[Request]:
        sched = await _opened(redis_url, "kinds")
        record = json.loads(dead_letter_record(HOSTILE, reason="500", worker="w", policy=sched.dead_policy))
        client.zadd(keys.queue, {(7).to_bytes(6, "big") + base64.b64decode(record["request"]): 0})
        got = await _fetched(sched)
        await sched.redis.aclose()
        return got

    assert run(go()) == []
    assert _reasons(client, keys.queue_rejected) == ["bad_tag"]


def test_a_lease_that_ran_out_or_was_released_is_leased_again(redis_url: str) -> None:
    """Going back to the queue unfinished is not a replay: the next lease of the same member is fetched."""
    keys = CrawlKeys("again")
    payload = EntryPolicy(secret=SECRET.encode()).bound(crawl=keys.tag).seal(b"\x81\xa1u\xa1x")

    async def go() -> list[int]:
        f = Frontier(redis.asyncio.Redis.from_url(redis_url), keys, "w1", None,
                     SchedulerSettings(lease_seconds=10.0))
        await f.sync(SyncBatch(enqueue=[("", "", 0, payload, "", "")]), now=1000)
        got = [len((await f.sync(SyncBatch(lease=5), now=1000)).leased)]
        expired = await f.sync(SyncBatch(lease=5), now=1011)  # ran out: requeued and leased again
        got.append(len(expired.leased))
        (key, _), = expired.leased
        released = await f.sync(SyncBatch(release=[key], lease=5), now=1012)  # given back, leased again
        got.append(len(released.leased))
        (key, _), = released.leased
        await f.sync(SyncBatch(ack=[key]), now=1013)
        await f.redis.aclose()
        client = redis.Redis.from_url(redis_url)
        client.zadd(keys.queue, {lease_member(key): 0})  # a copy after the acknowledgement
        f = Frontier(redis.asyncio.Redis.from_url(redis_url), keys, "w1", None,
                     SchedulerSettings(lease_seconds=10.0))
        replay = await f.sync(SyncBatch(lease=5), now=1014)
        await f.redis.aclose()
        return [*got, len(replay.leased), replay.rejected]

    assert run(go()) == [1, 1, 1, 0, 1]


def test_a_revisit_chain_of_a_signed_entry_goes_on(redis_url: str) -> None:
    """A revisit is signed afresh: the acknowledged entry's nonce does not stop its next fetch."""
    keys = CrawlKeys("chain")

    async def go() -> list[str]:
        sched = await _opened(redis_url, "chain", REVISIT_MIN_INTERVAL=0.2)
        assert sched.revisits is not None
        sched.enqueue_request(Request("http://site.test/r", meta={"revisit_after": 0.3}))
        urls = []
        for _ in range(3):
            for request in await _fetched(sched, rounds=1):
                sched.revisits.outcome[request] = True  # fetched successfully
                urls.append(request.url)
            await _fetched(sched, rounds=1)  # acknowledges it, filing its revisit
            time.sleep(0.4)
        await sched.redis.aclose()
        return urls

    assert run(go()) == ["http://site.test/r"] * 3
    assert redis.Redis.from_url(redis_url).llen(keys.queue_rejected) == 0


def test_a_forked_worker_does_not_repeat_its_parents_nonces() -> None:
    import os

    policy = EntryPolicy(secret=SECRET.encode())
    read, write = os.pipe()
    pid = os.fork()
    nonce = policy.seal(b"\x80")[17:25]
    if pid == 0:  # pragma: no cover - the child
        os.write(write, nonce)
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 8) != nonce
