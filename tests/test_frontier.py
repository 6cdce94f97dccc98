"""The frontier's sync script against a real Redis: ordering, leases, acks, delays, dedupe."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio
from helpers import run

from scrapy_dist.dupefilter import BloomDupeFilter, SetDupeFilter
from scrapy_dist.dupefilter.bloom import fingerprint_hashes
from scrapy_dist.frontier.shard import SEQ_BYTES, Frontier, SyncBatch, lease_member, lease_parts
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.settings import SchedulerSettings

KEYS = CrawlKeys("spider")


async def _frontier(
    url: str, sequence: str = "asc", dupefilter: Any = None, worker: str = "w1", lease: float = 10.0
) -> Frontier:
    client = redis.asyncio.Redis.from_url(url)
    return Frontier(client, KEYS, worker, dupefilter, SchedulerSettings(lease_seconds=lease), sequence)


def _payloads(result: Any) -> list[bytes]:
    return [lease_member(m)[SEQ_BYTES:] for m, _ in result.leased]


def test_priority_order_and_fifo_within_priority(redis_url: str, redis_client: Any) -> None:
    async def go() -> Any:
        f = await _frontier(redis_url)
        entries = [
            ("", "", -prio, f"p{prio}-{i}".encode(), "", "") for i in range(3) for prio in (0, 5, -2, 5)
        ]
        await f.sync(SyncBatch(enqueue=entries[:6]))
        await f.sync(SyncBatch(enqueue=entries[6:]))
        res = await f.sync(SyncBatch(lease=100))
        await f.redis.aclose()
        return res

    res = run(go())
    got = _payloads(res)
    # priority 5 first (score -5), then 0, then -2; within a priority the enqueue order, across two calls
    assert got[:6] == [b"p5-0", b"p5-0", b"p5-1", b"p5-1", b"p5-2", b"p5-2"]
    assert got[6:9] == [b"p0-0", b"p0-1", b"p0-2"]
    assert got[9:] == [b"p-2-0", b"p-2-1", b"p-2-2"]
    # identical dont_filter payloads are separate entries, all leased now
    assert redis_client.zcard(KEYS.leases) == 12 and res.queued == 0
    assert redis_client.zcard(KEYS.queue) == 0


def test_lifo_order(redis_url: str) -> None:
    async def go() -> Any:
        f = await _frontier(redis_url, sequence="desc")
        await f.sync(SyncBatch(enqueue=[("", "", 0, b"a", "", ""), ("", "", 0, b"b", "", "")]))
        await f.sync(SyncBatch(enqueue=[("", "", 0, b"c", "", "")]))
        res = await f.sync(SyncBatch(lease=10))
        await f.redis.aclose()
        return res

    assert _payloads(run(go())) == [b"c", b"b", b"a"]


def test_expired_leases_are_requeued_with_their_priority(redis_url: str, redis_client: Any) -> None:
    async def go() -> tuple[Any, Any, Any]:
        dead = await _frontier(redis_url, worker="dead", lease=10)
        alive = await _frontier(redis_url, worker="alive", lease=10)
        await dead.sync(
            SyncBatch(enqueue=[("", "", -7, b"hi", "", ""), ("", "", 0, b"lo", "", "")]), now=1000
        )
        taken = await dead.sync(SyncBatch(lease=1), now=1000)  # "hi" leased by the dead worker
        before = await alive.sync(SyncBatch(), now=1009)  # lease not expired yet
        after = await alive.sync(SyncBatch(lease=5), now=1011)
        for f in (dead, alive):
            await f.redis.aclose()
        return taken, before, after

    taken, before, after = run(go())
    assert _payloads(taken) == [b"hi"]
    assert before.requeued == 0 and before.inflight == 1
    assert after.requeued == 1
    assert _payloads(after) == [b"hi", b"lo"]  # requeued with priority 7, so ahead of "lo"
    assert {m for m, _ in after.leased} == set(redis_client.zrange(KEYS.leases, 0, -1))
    # each lease key's tag names the score it goes back with and its holder; no lease meta is written
    assert sorted(lease_parts(m)[1:] for m, _ in after.leased) == [(b"-7", b"alive"), (b"0", b"alive")]
    assert redis_client.hlen(KEYS.lease_meta) == 0


def test_a_late_ack_drops_the_requeued_copy_and_an_ack_in_time_leaves_the_queue_alone(
    redis_url: str, redis_client: Any
) -> None:
    async def go() -> tuple[Any, Any]:
        f = await _frontier(redis_url, worker="slow", lease=10)
        batch = SyncBatch(enqueue=[("", "", 0, b"late", "", ""), ("", "", 0, b"kept", "", "")])
        await f.sync(batch, now=1000)
        late = (await f.sync(SyncBatch(lease=1), now=1000)).leased[0][0]
        swept = await f.sync(SyncBatch(), now=1011)  # its lease ran out: back in the queue
        acked = await f.sync(SyncBatch(ack=[late]), now=1012)  # the work was done after all
        kept = (await f.sync(SyncBatch(lease=1), now=1012)).leased[0][0]
        redis_client.config_resetstat()
        await f.sync(SyncBatch(ack=[kept]), now=1013)  # in time: only its lease is removed
        await f.redis.aclose()
        return swept, acked

    swept, acked = run(go())
    assert redis_client.info("commandstats")["cmdstat_zrem"]["calls"] == 1
    assert swept.requeued == 1 and swept.queued == 2
    assert acked.queued == 1 and acked.inflight == 0
    assert redis_client.zcard(KEYS.queue) == 0


def test_ack_release_renew(redis_url: str, redis_client: Any) -> None:
    async def go() -> None:
        f = await _frontier(redis_url, lease=10)
        await f.sync(
            SyncBatch(
                enqueue=[("", "", 0, b"a", "", ""), ("", "", 0, b"b", "", ""), ("", "", 0, b"c", "", "")]
            ),
            now=100,
        )
        res = await f.sync(SyncBatch(lease=3), now=100)
        a, b, c = (m for m, _ in res.leased)
        await f.sync(SyncBatch(ack=[a], release=[b], renew=[c]), now=105)
        assert redis_client.zscore(KEYS.leases, c) == 115
        assert redis_client.zscore(KEYS.leases, a) is None
        assert redis_client.zscore(KEYS.queue, lease_member(b)) == 0  # released back to the queue
        res = await f.sync(SyncBatch(ack=[c]), now=112)
        assert res.requeued == 0 and res.inflight == 0 and res.queued == 1
        await f.redis.aclose()

    run(go())


def test_delayed_entries_move_when_due(redis_url: str) -> None:
    async def go() -> tuple[Any, Any]:
        f = await _frontier(redis_url)
        await f.sync(SyncBatch(delay=[(-3, b"retry", 50.0, "", "")]), now=10)
        early = await f.sync(SyncBatch(lease=5), now=49)
        due = await f.sync(SyncBatch(lease=5), now=50)
        await f.redis.aclose()
        return early, due

    early, due = run(go())
    assert early.leased == [] and early.delayed == 1
    assert due.moved == 1 and _payloads(due) == [b"retry"] and due.delayed == 0


@pytest.mark.parametrize("cls", [BloomDupeFilter, SetDupeFilter])
def test_batch_dedupes_through_the_dupefilter(redis_url: str, redis_client: Any, cls: type) -> None:
    kw = {"capacity": 1000, "error_rate": 0.001} if cls is BloomDupeFilter else {}
    df = cls(redis_client, KEYS, None, **kw)
    df.open()

    def tok(i: int) -> tuple[Any, Any]:
        fp = i.to_bytes(20, "big")
        return fingerprint_hashes(fp) if cls is BloomDupeFilter else (fp, "")

    async def go() -> tuple[Any, Any]:
        f = await _frontier(redis_url, dupefilter=df)
        first = await f.sync(SyncBatch(enqueue=[(*tok(i), 0, b"x%d" % i, "", "") for i in (1, 2, 1, 3)]))
        second = await f.sync(SyncBatch(enqueue=[(*tok(i), 0, b"y%d" % i, "", "") for i in (3, 4)]))
        await f.redis.aclose()
        return first, second

    first, second = run(go())
    assert first.new == [True, True, False, True]
    assert second.new == [False, True]
    assert second.queued == 4


def test_paused_flag_stops_leasing(redis_url: str, redis_client: Any) -> None:
    async def go() -> tuple[Any, Any]:
        f = await _frontier(redis_url)
        await f.sync(SyncBatch(enqueue=[("", "", 0, b"a", "", "")]))
        redis_client.hset(KEYS.control, "paused", "1")
        paused = await f.sync(SyncBatch(lease=5))
        redis_client.hset(KEYS.control, "paused", "0")
        resumed = await f.sync(SyncBatch(lease=5))
        await f.redis.aclose()
        return paused, resumed

    paused, resumed = run(go())
    assert paused.paused and paused.leased == []
    assert not resumed.paused and _payloads(resumed) == [b"a"]


def test_entries_are_packed_in_chunks_and_leased_in_order(redis_url: str, redis_client: Any) -> None:
    async def go() -> list[Any]:
        f = await _frontier(redis_url)
        out = []
        await f.sync(SyncBatch(enqueue=[("", "", 0, b"a%02d" % i, "", "") for i in range(20)]))
        assert redis_client.zcard(KEYS.queue) == 2  # 16 + 4 requests in two members
        out.append(await f.sync(SyncBatch(lease=5)))  # takes part of the first chunk
        await f.sync(SyncBatch(enqueue=[("", "", 0, b"b%02d" % i, "", "") for i in range(3)]))
        await f.sync(SyncBatch(enqueue=[("", "", -1, b"hi", "", "")]))
        out.append(await f.sync(SyncBatch(lease=100)))
        await f.redis.aclose()
        return out

    first, rest = run(go())
    assert _payloads(first) == [b"a%02d" % i for i in range(5)]
    assert first.queued == 15
    assert _payloads(rest) == [b"hi"] + [b"a%02d" % i for i in range(5, 20)] + [
        b"b%02d" % i for i in range(3)
    ]
    assert rest.queued == 0
    # what a worker holds is a plain single: 6-byte sequence + payload
    assert all(len(m) == 6 + len(m[6:]) and m[6:7] != b"\0" for m, _ in rest.leased)


def test_singles_written_by_others_mix_with_chunks(redis_url: str, redis_client: Any) -> None:
    redis_client.zadd(KEYS.queue, {b"\0\0\0\0\0\0" + b"\x01outside": 0, b"junk\0\0\0\xff": 0})

    async def go() -> Any:
        f = await _frontier(redis_url)
        await f.sync(SyncBatch(enqueue=[("", "", 0, b"mine", "", "")]))
        res = await f.sync(SyncBatch(lease=10))
        await f.redis.aclose()
        return res

    res = run(go())
    got = _payloads(res)
    assert got[0] == b"\x01outside" and b"mine" in got
    # the malformed chunk is rejected whole by the script, as one record (it is not handed out)
    assert len(got) == 2 and res.rejected == 1
    assert redis_client.llen(KEYS.queue_rejected) == 1


@pytest.mark.parametrize("id_length", [4093, 4094, 5000])
def test_worker_ids_near_and_past_the_lease_tag_limit(
    redis_url: str, redis_client: Any, id_length: int
) -> None:
    """A tag ("<score> <worker id>") is at most 4096 bytes: a longer one leases untagged, with the score
    and worker in the lease meta HASH. Either way leases are settled, swept and requeued with their score."""
    long_id = "h" * id_length

    async def go() -> tuple[Any, Any, Any]:
        f = await _frontier(redis_url, worker=long_id, lease=10)
        await f.sync(SyncBatch(enqueue=[("", "", -3, b"a", "", ""), ("", "", -3, b"b", "", "")]), now=100)
        taken = await f.sync(SyncBatch(lease=2), now=100)
        (a, _), (b, _) = taken.leased
        acked = await f.sync(SyncBatch(ack=[a]), now=101)
        swept = await f.sync(SyncBatch(lease=5), now=200)  # b's lease ran out
        await f.redis.aclose()
        return taken, acked, swept

    taken, acked, swept = run(go())
    tagged = id_length + 3 <= 4096  # "-3 " + the id
    assert [lease_parts(m)[1] for m, _ in taken.leased] == [b"-3" if tagged else None] * 2
    assert acked.inflight == 1
    assert swept.requeued == 1
    assert [(lease_member(m)[SEQ_BYTES:], s) for m, s in swept.leased] == [(b"b", -3.0)]
    # only the untagged case writes meta: the new lease's (the two before were settled)
    assert redis_client.hlen(KEYS.lease_meta) == (0 if tagged else 1)
