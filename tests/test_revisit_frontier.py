"""Revisits in the sync script against a real Redis, time injected: the ack files the request again in
the delayed set (same atomic call), it comes due later, two workers acknowledging one lease file one copy,
a lease that ran out is fetched again and filed once, and the revisit count stays right."""

from __future__ import annotations

from typing import Any

import redis.asyncio
from helpers import run

from scrapy_dist.frontier import SEQ_BYTES, Frontier, SyncBatch
from scrapy_dist.keys import CrawlKeys

KEYS = CrawlKeys("rv")


def _frontier(url: str, worker: str = "w1", lease: float = 10.0, politeness: str = "process") -> Frontier:
    client = redis.asyncio.Redis.from_url(url)
    return Frontier(client, KEYS, worker, None, lease_seconds=lease, politeness=politeness)


def _revisits(r: Any) -> int:
    return int(r.hget(KEYS.delayed_meta, "revisits") or 0)


def test_ack_with_revisit_files_the_request_again_due_later(redis_url: str, redis_client: Any) -> None:
    async def go() -> tuple[Any, ...]:
        f = _frontier(redis_url)
        await f.sync(SyncBatch(enqueue=[("", "", -3, b"\x01page", "", "")]), now=1000)
        got = await f.sync(SyncBatch(lease=5), now=1000)
        member = got.leased[0][0]
        await f.sync(SyncBatch(revisit=[(member, 3600.0, b"")]), now=1010)
        early = await f.sync(SyncBatch(lease=5), now=1010 + 3599)
        due = await f.sync(SyncBatch(lease=5), now=1010 + 3600)
        await f.redis.aclose()
        return member, early, due

    member, early, due = run(go())
    assert early.leased == [] and early.delayed == 1
    # due: leased again, same entry, with its priority (score -3)
    assert due.moved == 1 and due.leased == [(member, -3.0)]
    assert redis_client.zcard(KEYS.delayed) == 0 and _revisits(redis_client) == 0


def test_revisit_count_and_a_new_member_replacing_the_old(redis_url: str, redis_client: Any) -> None:
    async def go() -> tuple[bytes, bytes]:
        f = _frontier(redis_url)
        await f.sync(SyncBatch(enqueue=[("", "", 0, b"\x01a", "", ""), ("", "", 0, b"\x01b", "", "")]), now=1)
        got = await f.sync(SyncBatch(lease=5), now=1)
        (a, _), (b, _) = got.leased
        new_b = b[:SEQ_BYTES] + b"\x01b-with-etag"
        await f.sync(SyncBatch(revisit=[(a, 100.0, b""), (b, 200.0, new_b)]), now=2)
        await f.redis.aclose()
        return a, new_b

    a, new_b = run(go())
    assert redis_client.zrange(KEYS.delayed, 0, -1, withscores=True) == [(a, 102.0), (new_b, 202.0)]
    assert _revisits(redis_client) == 2
    assert redis_client.hget(KEYS.delayed_meta, a) == b"0 r"
    assert redis_client.zcard(KEYS.leases) == 0


def test_two_workers_acknowledging_one_lease_file_one_copy(redis_url: str, redis_client: Any) -> None:
    """Worker A is slow: its lease runs out, B leases the page again; both finish and acknowledge it with
    a revisit (A with other validators). One copy is filed, fetched once when due."""

    async def go() -> Any:
        a, b = _frontier(redis_url, "A"), _frontier(redis_url, "B")
        await a.sync(SyncBatch(enqueue=[("", "", 0, b"\x01page", "", "")]), now=1000)
        m = (await a.sync(SyncBatch(lease=1), now=1000)).leased[0][0]
        again = await b.sync(SyncBatch(lease=1), now=1011)  # A's lease ran out: requeued, B leases it
        assert again.requeued == 1 and again.leased[0][0] == m
        await a.sync(SyncBatch(revisit=[(m, 50.0, m[:SEQ_BYTES] + b"\x01page-A")]), now=1012)
        await b.sync(SyncBatch(revisit=[(m, 50.0, b"")]), now=1013)
        due_a = await a.sync(SyncBatch(lease=5), now=1100)
        due_b = await b.sync(SyncBatch(lease=5), now=1100)
        for f in (a, b):
            await f.redis.aclose()
        return due_a, due_b

    due_a, due_b = run(go())
    assert [m[SEQ_BYTES:] for m, _ in due_a.leased + due_b.leased] == [b"\x01page-A"]
    assert _revisits(redis_client) == 0


def test_a_revisit_due_twice_over_is_leased_by_one_worker_only(redis_url: str, redis_client: Any) -> None:
    async def go() -> list[Any]:
        a, b = _frontier(redis_url, "A"), _frontier(redis_url, "B")
        await a.sync(SyncBatch(enqueue=[("", "", 0, b"\x01p", "", "")]), now=0)
        m = (await a.sync(SyncBatch(lease=1), now=0)).leased[0][0]
        await a.sync(SyncBatch(revisit=[(m, 10.0, b"")]), now=1)
        out = [await a.sync(SyncBatch(lease=5), now=20), await b.sync(SyncBatch(lease=5), now=20)]
        for f in (a, b):
            await f.redis.aclose()
        return out

    results = run(go())
    assert sum(len(r.leased) for r in results) == 1


def test_a_lease_that_ran_out_is_fetched_again_and_the_late_ack_still_revisits(
    redis_url: str, redis_client: Any
) -> None:
    """SIGKILL between fetch and ack: nothing acknowledges; the lease runs out and the page is queued again
    (no revisit filed yet); the next worker's ack files it."""

    async def go() -> Any:
        dead, alive = _frontier(redis_url, "dead"), _frontier(redis_url, "alive")
        await dead.sync(SyncBatch(enqueue=[("", "", 0, b"\x01p", "", "")]), now=0)
        await dead.sync(SyncBatch(lease=1), now=0)
        got = await alive.sync(SyncBatch(lease=1), now=11)
        assert redis_client.zcard(KEYS.delayed) == 0
        await alive.sync(SyncBatch(revisit=[(got.leased[0][0], 30.0, b"")]), now=12)
        res = await alive.sync(SyncBatch(), now=13)
        for f in (dead, alive):
            await f.redis.aclose()
        return res

    res = run(go())
    assert res.delayed == 1 and res.inflight == 0 and res.queued == 0
    assert _revisits(redis_client) == 1


def test_revisit_with_crawl_wide_politeness(redis_url: str, redis_client: Any) -> None:
    async def go() -> Any:
        f = _frontier(redis_url, politeness="cluster")
        await f.sync(SyncBatch(enqueue=[("", "", -2, b"\x01p", "site.test", "0.0 2 0.0")]), now=0)
        m = (await f.sync(SyncBatch(lease=1), now=0)).leased[0][0]
        await f.sync(SyncBatch(revisit=[(m, 5.0, b"")]), now=1)
        due = await f.sync(SyncBatch(lease=1), now=7)
        await f.redis.aclose()
        return m, due

    m, due = run(go())
    assert [x for x, _ in due.leased] == [m]


def test_garbage_revisit_count_restarts_at_zero(redis_url: str, redis_client: Any) -> None:
    redis_client.hset(KEYS.delayed_meta, "revisits", "not a number")

    async def go() -> None:
        f = _frontier(redis_url)
        await f.sync(SyncBatch(enqueue=[("", "", 0, b"\x01p", "", "")]), now=0)
        m = (await f.sync(SyncBatch(lease=1), now=0)).leased[0][0]
        await f.sync(SyncBatch(revisit=[(m, 5.0, b"")]), now=1)
        await f.redis.aclose()

    run(go())
    assert _revisits(redis_client) == 1
