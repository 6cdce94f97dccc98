"""Revisits in the sync script against a real Redis, time injected: the ack files the request again in
the delayed set (same atomic call), it comes due later, two workers acknowledging one lease file one copy,
a lease that ran out is fetched again and filed once, and the revisit count stays right."""

from __future__ import annotations

from typing import Any

import redis.asyncio
from helpers import run

from scrapy_dist.frontier.shard import SEQ_BYTES, Frontier, SyncBatch, lease_member
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.settings import SchedulerSettings

KEYS = CrawlKeys("rv")


def _frontier(url: str, worker: str = "w1", lease: float = 10.0, politeness: str = "process") -> Frontier:
    client = redis.asyncio.Redis.from_url(url)
    return Frontier(client, KEYS, worker, None, SchedulerSettings(lease_seconds=lease, politeness=politeness))


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
        (a, _), (b, _) = got.leased  # lease keys
        new_b = b[:SEQ_BYTES] + b"\x01b-with-etag"
        await f.sync(SyncBatch(revisit=[(a, 100.0, b""), (b, 200.0, new_b)]), now=2)
        await f.redis.aclose()
        return lease_member(a), new_b

    a, new_b = run(go())
    assert redis_client.zrange(KEYS.delayed, 0, -1, withscores=True) == [(a, 102.0), (new_b, 202.0)]
    assert _revisits(redis_client) == 2
    assert redis_client.hget(KEYS.delayed_meta, a) == b"0 r"
    assert redis_client.zcard(KEYS.leases) == 0


def test_two_workers_acknowledging_one_lease_file_one_copy(redis_url: str, redis_client: Any) -> None:
    """Worker A is slow: its lease runs out, B leases the page again; both finish and acknowledge it with
    a revisit (A with other validators). One copy is filed -- B's, the lease still held: A's lease ran
    out, so its late acknowledgement settles nothing -- and it is fetched once when due."""

    async def go() -> Any:
        a, b = _frontier(redis_url, "A"), _frontier(redis_url, "B")
        await a.sync(SyncBatch(enqueue=[("", "", 0, b"\x01page", "", "")]), now=1000)
        m = (await a.sync(SyncBatch(lease=1), now=1000)).leased[0][0]
        again = await b.sync(SyncBatch(lease=1), now=1011)  # A's lease ran out: requeued, B leases it
        m_b = again.leased[0][0]
        assert again.requeued == 1 and lease_member(m_b) == lease_member(m) and m_b != m
        await a.sync(SyncBatch(revisit=[(m, 50.0, m[:SEQ_BYTES] + b"\x01page-A")]), now=1012)
        await b.sync(SyncBatch(revisit=[(m_b, 50.0, b"")]), now=1013)
        due_a = await a.sync(SyncBatch(lease=5), now=1100)
        due_b = await b.sync(SyncBatch(lease=5), now=1100)
        for f in (a, b):
            await f.redis.aclose()
        return due_a, due_b

    due_a, due_b = run(go())
    assert [lease_member(m)[SEQ_BYTES:] for m, _ in due_a.leased + due_b.leased] == [b"\x01page"]
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


# -- the worker's side: the ledger and the revisit decision (no Redis) ---------------------------------

def test_a_revisit_travels_as_its_ack_and_survives_a_failed_round() -> None:
    from scrapy import Request

    from scrapy_dist.frontier.ledger import Ledger

    ledger = Ledger()
    req, other = Request("http://site.test/a"), Request("http://site.test/b")
    lease_a, lease_b = (0, b"\0\0\0\0\0\1\x01a"), (0, b"\0\0\0\0\0\2\x01b")
    ledger.handed = {req: lease_a, other: lease_b}
    ledger.riders.revisit_of = lambda r, lease: (60.0, b"") if r is req else None
    ledger.collect_finished((), now=1.0)
    (batch,) = ledger.take_batches([0], renew=False)
    assert batch.revisit == [(lease_a[1], 60.0, b"")] and batch.ack == [lease_b[1]]
    ledger.restore(0, batch, now=2.0)  # Redis was away: both wait for the next round, unchanged
    ledger.finish_round(False, now=2.0)
    (again,) = ledger.take_batches([0], renew=False)
    assert again.revisit == [(lease_a[1], 60.0, b"")] and again.ack == [lease_b[1]]


def test_validators_are_written_into_the_entry_and_trust_is_kept() -> None:
    from scrapy import Request
    from scrapy.http import HtmlResponse

    from scrapy_dist.frontier.engine import Revisits
    from scrapy_dist.wire.codec import encode_request, load_payload
    from scrapy_dist.wire.entrypolicy import EntryPolicy, is_trusted

    for policy in (EntryPolicy(), EntryPolicy(secret=b"s3cret")):
        req = Request("http://site.test/c", meta={"revisit_after": 30})
        member = b"\0\0\0\0\0\7" + encode_request(req, None, policy)
        rv = Revisits(conditional=True, policy=policy)
        validators = {"ETag": '"abc"', "Last-Modified": "Mon, 01 Jan 2024 00:00:00 GMT"}
        resp = HtmlResponse(req.url, headers=validators, body=b"x", request=req)
        rv.response_received(resp, req)
        delay, new = rv.plan(req, (0, member))
        assert delay == 30.0 and new[:6] == member[:6]
        headers = dict((bytes(k), v) for k, v in load_payload(new[6:])["h"])
        assert headers[b"If-None-Match"] == [b'"abc"']
        assert is_trusted(new[6:], policy)
    # an untrusted entry (no tag, the crawl has a secret) stays untrusted
    policy = EntryPolicy(secret=b"s3cret")
    req = Request("http://site.test/d", meta={"revisit_after": 30})
    member = b"\0\0\0\0\0\x08" + encode_request(req, None, EntryPolicy())
    rv = Revisits(conditional=True, policy=policy)
    rv.response_received(HtmlResponse(req.url, headers={"ETag": '"e"'}, body=b"x", request=req), req)
    _, new = rv.plan(req, (0, member))
    assert not is_trusted(new[6:], policy)
    # a callback that raised stops the chain; an oversized or control-character ETag is not stored
    req = Request("http://site.test/e", meta={"revisit_after": 30})
    rv.response_received(HtmlResponse(req.url, headers={"ETag": "x" * 300}, body=b"x", request=req), req)
    assert rv.validators[req] == {}
    rv.spider_error(None, HtmlResponse(req.url, body=b"x", request=req))
    assert rv.plan(req, (0, member)) is None
