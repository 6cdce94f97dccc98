"""Hostile Redis contents against the frontier's scripts: bounded work per call, capped record
lists, values checked before the first write, and bloom parameters bounded. Real Redis, real Frontier."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import pytest
import redis.asyncio
from helpers import lease_key, run

from scrapy_dist.dupefilter import BloomDupeFilter
from scrapy_dist.dupefilter.bloom import MAX_OVERSHOOT, BloomParameterError, BloomPlan, fingerprint_hashes
from scrapy_dist.frontier.shard import (
    PRIORITY_KEY_BYTES,
    SEQ_BYTES,
    SYNC_HEAD,
    SYNC_KEYS,
    SYNC_SECTIONS,
    Frontier,
    FrontierStateError,
    SyncBatch,
    lease_member,
    sync_prelude,
)
from scrapy_dist.redis import scripts
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.redis.outage import Backoff, Outage
from scrapy_dist.settings import SchedulerSettings

KEYS = CrawlKeys("spider")


def _tokens(i: int) -> tuple[int, int]:
    return fingerprint_hashes(f"fp-{i}".encode())


async def _sync(
    url: str, *batches: SyncBatch, df: Any = None, now: float | None = None, **kw: Any
) -> list[Any]:
    client = redis.asyncio.Redis.from_url(url)
    try:
        f = Frontier(client, KEYS, "w1", df, SchedulerSettings(**kw))
        return [await f.sync(b, now=now) for b in batches]
    finally:
        await client.aclose()


def _bloom(redis_client: Any, capacity: int = 10_000) -> BloomDupeFilter:
    df = BloomDupeFilter(redis_client, KEYS, None, capacity=capacity, error_rate=0.01)
    df.open()
    return df


# -- the protocol is declared once ---------------------------------------------------------------
def test_the_sync_script_reads_only_names_the_python_declaration_has() -> None:
    src = scripts.source("sync", sync_prelude())
    assert len(re.findall(r"local SYNC_KEYS = ", src)) == 1, "declared in the generated prelude only"
    # the items key rides after the dupefilter's keys, only in calls that carry items
    assert set(re.findall(r"\bkey_of\.(\w+)", src)) <= {name for name, _ in SYNC_KEYS} | {"items"}
    assert set(re.findall(r"\bcall_args\.(\w+)", src)) == set(SYNC_HEAD)
    named = set(re.findall(r"\bsec\.(\w+)", src)) - {"n", "pos", "w"}  # a section's own fields
    assert named == {s.name for s in SYNC_SECTIONS}


def test_the_prelude_declares_each_key_with_its_type() -> None:
    prelude = sync_prelude()
    types = dict(re.findall(r"(\w+) = '(\w+)'", re.search(r"local SYNC_TYPES = \{(.*?)\}", prelude).group(1)))
    assert types == dict(SYNC_KEYS)
    assert "queue_rejected" in types and types["seq"] == "string"


def test_a_score_beyond_a_priority_keeps_the_polite_member_layout(redis_url: str, redis_client: Any) -> None:
    entries = [("", "", score, b"\x01p%d" % i, "a.example", "0 1 0") for i, score in enumerate((-1e15, 1e15))]
    run(_sync(redis_url, SyncBatch(enqueue=entries), politeness="cluster"))
    members = redis_client.zrange(KEYS.queue, 0, -1)
    keys = sorted(m[m.index(b"\0") + 1 : m.index(b"\0") + 1 + PRIORITY_KEY_BYTES] for m in members)
    assert keys == [b"00000000000", b"04294967295"]  # clamped to the ends, never longer
    assert run(_lease_all(redis_url, 3)) == 2


# -- bounded work per call ------------------------------------------------------------------------
def test_a_million_record_chunk_is_rejected_whole_as_one_record(redis_url: str, redis_client: Any) -> None:
    record = b"\0\0" + b"\0\0\0\0\0\x09"  # length 0, a seq
    chunk = b"\0\0\0\0\0\x09\0" + record * 1_000_000  # 8 MB claiming a million records
    redis_client.zadd(KEYS.queue, {chunk: 0})
    (res,) = run(_sync(redis_url, SyncBatch(lease=10)))
    assert res.leased == [] and res.rejected == 1
    assert redis_client.zcard(KEYS.queue) == 0 and redis_client.zcard(KEYS.leases) == 0
    records = redis_client.lrange(KEYS.queue_rejected, 0, -1)
    assert len(records) == 1 and len(records[0]) < 1000  # one record, of bounded size
    rec = json.loads(records[0])
    assert rec["reason"] == "chunk_too_many_records" and rec["raw_bytes"] == len(chunk)
    assert rec["raw_encoding"] == "hex" and bytes.fromhex(rec["raw"]) == chunk[:64]


def test_an_oversized_single_and_truncated_chunk_are_rejected_in_redis(
    redis_url: str, redis_client: Any
) -> None:
    redis_client.zadd(KEYS.queue, {
        b"\0\0\0\0\0\x01\x01" + b"x" * 5000: 0,  # a single larger than max_entry_bytes
        b"\0\0\0\0\0\x02\0\x00\x10\0\0\0\0\0\x02ab": 1,  # a chunk whose record runs past its end
        b"\0\0\0\0\0\x03\x01good": 2,
    })
    (res,) = run(_sync(redis_url, SyncBatch(lease=10), max_entry_bytes=1000))
    assert [lease_member(m)[SEQ_BYTES:] for m, _ in res.leased] == [b"\x01good"]
    assert res.rejected == 2
    reasons = [json.loads(r)["reason"] for r in redis_client.lrange(KEYS.queue_rejected, 0, -1)]
    assert reasons == ["entry_too_large", "chunk_truncated"]


def test_record_lists_are_capped(redis_url: str, redis_client: Any) -> None:
    redis_client.zadd(KEYS.queue, {b"\0\0\0\0\0" + bytes([i]) + b"\x01e": 0 for i in range(1, 6)})

    async def go() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        f = Frontier(client, KEYS, "w1", None, SchedulerSettings(rejected_maxlen=3, dead_maxlen=2))
        res = await f.sync(SyncBatch(lease=5))
        await f.sync(SyncBatch(reject=[(m, f'{{"n": {i}}}') for i, (m, _) in enumerate(res.leased)],
                               dead=[f'{{"d": {i}}}' for i in range(4)]))
        await client.aclose()

    run(go())
    assert [json.loads(r)["n"] for r in redis_client.lrange(KEYS.queue_rejected, 0, -1)] == [2, 3, 4]
    assert [json.loads(r)["d"] for r in redis_client.lrange(KEYS.deadletter, 0, -1)] == [2, 3]
    assert redis_client.zcard(KEYS.leases) == 0


def test_a_garbage_tail_is_not_appended_to(redis_url: str, redis_client: Any) -> None:
    # the tails hash names a "chunk" of a million records that is also in the queue
    huge = b"\0\0\0\0\0\x09\0" + b"\0\0\0\0\0\0\0\x09" * 1_000_000
    redis_client.zadd(KEYS.queue, {huge: 0})
    redis_client.hset(KEYS.queue_tails, "0.0", huge)
    res = run(_sync(redis_url, SyncBatch(enqueue=[("", "", 0, b"\x01new", "", "")]), SyncBatch(lease=5)))
    assert [lease_member(m)[SEQ_BYTES:] for m, _ in res[1].leased] == [b"\x01new"]
    assert res[1].rejected == 1 and redis_client.zcard(KEYS.queue) == 0


# -- scripts validate before they write -----------------------------------------------------------
@pytest.mark.parametrize("seq", [b"9223372036854775807", b"281474976710655", b"not a number", b"-5", b"1e3"])
def test_a_hostile_seq_loses_no_request(redis_url: str, redis_client: Any, seq: bytes) -> None:
    df = _bloom(redis_client)
    redis_client.set(KEYS.seq, seq)
    t1, t2 = _tokens(1)
    first, leased = run(_sync(
        redis_url, SyncBatch(enqueue=[(t1, t2, 0, b"\x01req", "", "")]), SyncBatch(lease=5), df=df
    ))
    assert first.new == [True] and KEYS.seq in first.repaired and not first.work_repaired
    assert [lease_member(m)[SEQ_BYTES:] for m, _ in leased.leased] == [b"\x01req"]  # seen AND queued
    assert 0 < leased.seq < 2**47


def test_garbage_counters_and_meta_are_repaired_not_fatal(redis_url: str, redis_client: Any) -> None:
    async def go() -> Any:
        client = redis.asyncio.Redis.from_url(redis_url)
        f = Frontier(client, KEYS, "w1", None, SchedulerSettings(lease_seconds=10))
        await f.sync(SyncBatch(enqueue=[("", "", -1, b"\x01a", "", ""), ("", "", -2, b"\x01b", "", "")],
                               delay=[(-3, b"\x01d", 50.0, "", "")]), now=10)
        taken = await f.sync(SyncBatch(lease=2), now=10)
        (a, _), (b, _) = taken.leased
        # a's tag names a score that is no number; b is filed as an older version did, untagged, with
        # garbage in the lease meta HASH
        await client.zrem(KEYS.leases, a, b)
        await client.zadd(KEYS.leases, {lease_key(lease_member(a), "w1", "nan"): 20, lease_member(b): 20})
        await client.hset(KEYS.lease_meta, lease_member(b), "nan w1")
        (dm,) = await client.zrange(KEYS.delayed, 0, -1)
        await client.hset(KEYS.delayed_meta, dm, "1e999999")
        await client.hset(KEYS.queue_tails, "count", "lots")
        await client.hset(KEYS.control, "paused", "\x1b[31m")
        res = await f.sync(SyncBatch(lease=10), now=100)  # leases ran out, the delay is due
        await client.aclose()
        return res

    res = run(go())
    assert res.requeued == 2 and res.moved == 1 and not res.paused
    assert sorted(lease_member(m)[SEQ_BYTES:] for m, _ in res.leased) == [b"\x01a", b"\x01b", b"\x01d"]
    assert all(score == 0 for _, score in res.leased)  # unusable scores became 0, the requests stayed
    assert redis_client.hlen(KEYS.lease_meta) == 0


def _domain_state(redis_client: Any, domain: str = "a.example") -> list[bytes]:
    """A domain's field of the domain info HASH: slots, next time[, delay, concurrency, jitter]."""
    return redis_client.hget(KEYS.domain_info, f"p:{domain}").split(b" ")


def _set_domain_state(redis_client: Any, at: int, value: Any, domain: str = "a.example") -> None:
    parts = _domain_state(redis_client, domain)
    parts[at] = str(value).encode()
    redis_client.hset(KEYS.domain_info, f"p:{domain}", b" ".join(parts))


@pytest.mark.parametrize("fields", [
    pytest.param({"p:a.example": "9223372036854775807 soon 0 0 0", "layout": "p"}, id="the domain's field"),
    pytest.param({"p:a.example": "garbage", "layout": "p"}, id="a field that is not of the layout"),
    pytest.param({"p:a.example": "-1 0 0 0", "layout": "p"}, id="a field of four values"),
    pytest.param({"s:a.example": "many 9223372036854775807 soon 0 0 0", "layout": "s"},
                 id="the older layout's field"),
    pytest.param({"s:a.example": "garbage", "layout": "s"}, id="an older field that is not six values"),
    pytest.param({"b:a.example": "many", "i:a.example": "9223372036854775807", "n:a.example": "soon"},
                 id="the oldest layout's fields"),
    pytest.param({"i:a.example": "0", "n:a.example": "0"}, id="the oldest layout's fields, no l: field"),
])
def test_garbage_domain_info_is_repaired(redis_url: str, redis_client: Any, fields: dict[str, str]) -> None:
    redis_client.hset(KEYS.domain_info, mapping=fields)
    entry = ("", "", 0, b"\x01p", "a.example", "0 0 0")
    res = run(_sync(redis_url, SyncBatch(enqueue=[entry]), SyncBatch(lease=5), politeness="cluster"))
    assert len(res[1].leased) == 1
    assert _domain_state(redis_client) == [b"1", b"0", b"0", b"0", b"0"]
    kept = [b"layout", b"p:a.example"] if "layout" in fields else [b"p:a.example"]  # old fields deleted
    assert sorted(redis_client.hkeys(KEYS.domain_info)) == kept


@pytest.mark.parametrize("older", ["s", "b/i/n/l"])
def test_a_crawl_of_an_older_domain_layout_goes_on(redis_url: str, redis_client: Any, older: str) -> None:
    """A domain info HASH written by a version before the p: field (s: per domain, marked 'layout' = 's';
    before it b:/i:/n:/l: per domain, no mark) is read, and each domain rewritten as p: when a call first
    touches it. Those versions kept every domain with a backlog scheduled, as this one does."""
    entries = [("", "", 0, b"\x01p%d" % i, "a.example", "0 1 0") for i in range(3)]
    _, first = run(_sync(redis_url, SyncBatch(enqueue=entries), SyncBatch(lease=5), politeness="cluster"))
    i, n, *limits = _domain_state(redis_client)
    assert (i, b" ".join(limits)) == (b"1", b"0 1 0")
    # as the older version would have written it
    redis_client.delete(KEYS.domain_info)
    if older == "s":
        redis_client.hset(KEYS.domain_info, mapping={"s:a.example": b"2 1 " + n + b" 0 1 0", "layout": "s"})
    else:
        redis_client.hset(KEYS.domain_info, mapping={
            "b:a.example": "2", "i:a.example": "1", "n:a.example": n, "l:a.example": "0 1 0"})
    (res,) = run(_sync(redis_url, SyncBatch(lease=5), politeness="cluster"))
    assert res.leased == []  # its one slot is still taken
    assert _domain_state(redis_client) == [b"1", n, b"0", b"1", b"0"]
    kept = [b"layout", b"p:a.example"] if older == "s" else [b"p:a.example"]
    assert sorted(redis_client.hkeys(KEYS.domain_info)) == kept
    (held, _), = first.leased
    (res,) = run(_sync(redis_url, SyncBatch(ack=[held], lease=5), politeness="cluster"))
    assert len(res.leased) == 1  # the slot given back: the next request follows


async def _lease_all(url: str, calls: int) -> int:
    """Up to ``calls`` polite sync calls, each acknowledging what the one before leased: requests leased."""
    client = redis.asyncio.Redis.from_url(url)
    try:
        f = Frontier(client, KEYS, "w1", None, SchedulerSettings(politeness="cluster"), limits_bound="0 0.5")
        leased: list[bytes] = []
        for _ in range(calls):
            res = await f.sync(SyncBatch(ack=leased[-1:], lease=5))
            leased += [m for m, _ in res.leased]
        return len(leased)
    finally:
        await client.aclose()


@pytest.mark.parametrize("write", [
    pytest.param({"hset": (0, "999999")}, id="slots in use far past the leases"),
    pytest.param({"hset": (0, "-5")}, id="negative slots"),
    pytest.param({"hset": (1, "+far")}, id="a next allowed time in 30 years"),
    pytest.param({"zrem": True}, id="not scheduled"),
    pytest.param({"zadd": "+far"}, id="scheduled in 30 years"),
    pytest.param({"zadd": 1e15}, id="scheduled as blocked with its slots free"),
])
def test_garbage_in_a_domain_does_not_stall_it_for_ever(
    redis_url: str, redis_client: Any, write: dict[str, Any]
) -> None:
    # each would keep the domain's requests from ever being leased again if taken at its word
    entries = [("", "", 0, b"\x01p%d" % i, "a.example", "0 1 0") for i in range(2)]  # one at a time
    run(_sync(redis_url, SyncBatch(enqueue=entries), politeness="cluster"))
    far = redis_client.time()[0] + 10**9
    if "hset" in write:
        at, value = write["hset"]
        _set_domain_state(redis_client, at, far if value == "+far" else value)
    elif "zrem" in write:
        redis_client.zrem(KEYS.domains, "a.example")
    else:
        redis_client.zadd(KEYS.domains, {"a.example": far if write["zadd"] == "+far" else write["zadd"]})
    assert run(_lease_all(redis_url, 5)) == 2


def test_limits_no_worker_has_do_not_park_a_domain_for_days(redis_url: str, redis_client: Any) -> None:
    # a domain's limits are rewritten only when a new request of the domain is enqueued: "86400 1 10"
    # written after the last one held each of the domain's requests back up to 11 days (clamped to a day
    # and 10)
    entries = [("", "", 0, b"\x01p%d" % i, "a.example", "0 1 0") for i in range(3)]
    run(_sync(redis_url, SyncBatch(enqueue=entries), politeness="cluster"))
    i, n, *_ = _domain_state(redis_client)
    redis_client.hset(KEYS.domain_info, "p:a.example", b" ".join([i, n, b"86400 1 10"]))
    assert run(_lease_all(redis_url, 6)) == 3
    assert _domain_state(redis_client)[2:] == [b"0", b"1", b"0.5"]  # written back clamped, once


@pytest.mark.parametrize("name", [name for name, _ in SYNC_KEYS])
@pytest.mark.parametrize("politeness", ["process", "cluster"])
def test_a_frontier_key_of_another_type_is_moved_aside_and_the_crawl_goes_on(
    redis_url: str, redis_client: Any, name: str, politeness: str
) -> None:
    """A key of the frontier holding another Redis type than the frontier writes there is not ours: it is
    moved to <key>:garbage, named in the answer, and the call goes on with the key empty."""
    df = _bloom(redis_client)
    key = getattr(KEYS, name)
    if name == "seq":  # a string is the right type there
        redis_client.rpush(key, "x")
    else:
        redis_client.set(key, "a string")
    kind = redis_client.type(key)
    entry = (*_tokens(2), 0, b"\x01x", "a.example", "0 2 0")
    batch = SyncBatch(enqueue=[entry if politeness == "cluster" else entry[:4] + ("", "")])
    res, leased = run(_sync(redis_url, batch, SyncBatch(lease=5), df=df, politeness=politeness))
    assert res.new == [True] and key in res.repaired
    assert redis_client.type(f"{key}:garbage") == kind  # kept for whoever wrote it, out of the way
    assert len(leased.leased) == 1
    # only a key that holds requests reads empty for having been moved aside (router.REPAIR_GRACE)
    assert res.work_repaired is (name in ("queue", "leases", "delayed"))


def test_a_refused_write_is_one_line_in_the_log_not_a_traceback(
    redis_url: str, redis_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # what the sync loop's guard makes of a refusal: the key and what to do, and the loop retries. The seq
    # counter is garbage and a queue member's seq so close to the limit that no fresh one is left
    df = _bloom(redis_client)
    redis_client.set(KEYS.seq, "garbage")
    redis_client.zadd(KEYS.queue, {b"\x7f\xff\xff\xff\xff\x00\x01x": 0})
    before = sorted(redis_client.keys("*"))
    with pytest.raises(FrontierStateError) as err:
        run(_sync(redis_url, SyncBatch(enqueue=_items(1)), df=df))
    assert err.value.reason == "seq" and sorted(redis_client.keys("*")) == before  # nothing written
    guard = Outage().guard("frontier", Backoff(1.0, 4.0), log=logging.getLogger("test.refused"))
    with caplog.at_level(logging.ERROR, logger="test.refused"):
        assert guard.failed(err.value, now=0.0) == 1.0
    (record,) = caplog.records
    assert record.exc_info is None
    assert record.getMessage() == (
        f"The frontier failed (FrontierStateError: The frontier refused to write: {KEYS.seq!r} holds"
        " an unusable value (seq); nothing was written. Repair or delete that key"
        " (SCHEDULER_FLUSH_ON_START clears the crawl)); retrying"
    )


def _small_blocks(redis_client: Any) -> tuple[BloomDupeFilter, list[str]]:
    """A filter of many small blocks (of at most 4 windows) and the block keys a sync call passes."""
    df = BloomDupeFilter(redis_client, KEYS, None, capacity=200_000, error_rate=0.01, block_bits=4 * 4096)
    df.open()
    _, keys, _ = df.script_args(300)
    return df, [str(k) for k in keys if str(k).startswith(f"{KEYS.bloom}:")]


def _items(n: int, tag: bytes = b"") -> list[tuple[Any, ...]]:
    return [(*_tokens(i), 0, b"\x01" + tag + b"%d" % i, "", "") for i in range(n)]


def test_a_bloom_block_of_another_type_is_repaired_and_loses_nothing(
    redis_url: str, redis_client: Any
) -> None:
    # a block key replaced by a LIST must not fail the call half way: the requests before it would be
    # marked seen in the bloom filter, none of them queued -- lost for good
    df, blocks = _small_blocks(redis_client)
    assert len(blocks) > 4
    redis_client.rpush(blocks[1], "junk")
    res, again, leased = run(_sync(
        redis_url, SyncBatch(enqueue=_items(300)), SyncBatch(enqueue=_items(300, b"again")),
        SyncBatch(lease=1000), df=df,
    ))
    assert res.new == [True] * 300 and blocks[1] in res.repaired
    assert redis_client.type(blocks[1]) == b"string"
    assert redis_client.strlen(blocks[1]) == redis_client.strlen(blocks[0])  # a block's full size
    assert again.new == [False] * 300  # the filter works on, the repaired block included
    assert len(leased.leased) == 300


def test_a_bloom_block_cut_short_reads_as_clear_bits(redis_url: str, redis_client: Any) -> None:
    # every block's last window cut in half: a few lookups in ten read a window cut short, which must not
    # be a Lua error half way through the call
    df, blocks = _small_blocks(redis_client)
    run(_sync(redis_url, SyncBatch(enqueue=_items(1, b"first")), df=df))  # the blocks, at their full size
    blocks = [k for k in blocks if redis_client.exists(k)]  # not the next filter's (passed, not created)
    assert len(blocks) > 10
    for key in blocks:
        size = redis_client.strlen(key)
        assert size >= 2 * 512
        redis_client.set(key, b"\0" * (size - 256))
    res, again, leased = run(_sync(
        redis_url, SyncBatch(enqueue=_items(300)), SyncBatch(enqueue=_items(300, b"again")),
        SyncBatch(lease=1000), df=df,
    ))
    assert res.new == [True] * 300 and again.new == [False] * 300
    assert len(leased.leased) == 301


def test_a_bloom_hash_of_another_type_is_moved_aside_and_recounted(redis_url: str, redis_client: Any) -> None:
    df = _bloom(redis_client)
    run(_sync(redis_url, SyncBatch(enqueue=_items(40)), df=df))
    redis_client.delete(KEYS.bloom)
    redis_client.rpush(KEYS.bloom, "junk")
    res, again = run(_sync(
        redis_url, SyncBatch(enqueue=_items(3, b"new")), SyncBatch(enqueue=_items(50, b"more")), df=df
    ))
    assert KEYS.bloom in res.repaired and redis_client.type(f"{KEYS.bloom}:garbage") == b"list"
    assert res.new == [False] * 3  # the filter's bits are still there: dedupe goes on
    assert again.new == [False] * 40 + [True] * 10
    assert 45 <= int(redis_client.hget(KEYS.bloom, "n")) <= 55


# -- bounded memory from recorded parameters ------------------------------------------------------
def test_absurd_settings_are_refused_in_one_line() -> None:
    for kwargs, name in [
        ({"capacity": 10**400, "error_rate": 0.001}, "BLOOMFILTER_CAPACITY"),
        ({"capacity": 1000, "error_rate": float("nan")}, "BLOOMFILTER_ERROR_RATE"),
        ({"capacity": 1000, "error_rate": float("inf")}, "BLOOMFILTER_ERROR_RATE"),
        ({"capacity": 1000, "error_rate": -0.1}, "BLOOMFILTER_ERROR_RATE"),
        ({"capacity": 1000, "error_rate": 0.01, "block_bits": 2**40}, "BLOOMFILTER_BLOCK_BITS"),
    ]:
        with pytest.raises(BloomParameterError) as err:
            BloomPlan(**kwargs)
        msg = str(err.value)
        assert msg.startswith(name) and "\n" not in msg and len(msg) < 200


def test_a_recorded_count_past_the_bound_is_recounted_not_refused_at_start(
    redis_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    redis_client.hset(KEYS.bloom, mapping={"capacity": 1000, "error_rate": "0.01", "block_bits": 2**31,
                                           "hashing": 3, "n": 10**15})
    df = BloomDupeFilter(redis_client, KEYS, None, capacity=1000, error_rate=0.01)
    with caplog.at_level(logging.WARNING):
        df.open()
    assert df.n == 0 and len(df.plan._specs) < 10  # nothing sized for the garbage
    (line,) = [r.getMessage() for r in caplog.records if "field n" in r.getMessage()]
    assert KEYS.bloom in line and "recounts" in line
    assert df.seen_tokens([_tokens(1)]) == [False] and redis_client.hget(KEYS.bloom, "n") == b"1"


def _filled_chain(redis_client: Any, items: int) -> tuple[BloomDupeFilter, list[tuple[int, int]]]:
    """A filter of capacity 1,000 holding ``items`` fingerprints: past 1,000 the chain has several filters."""
    df = _bloom(redis_client, capacity=1000)
    old = [_tokens(i) for i in range(items)]
    inserted = items - sum(df.seen_tokens(old))  # a few are false positives (error rate 0.01)
    assert int(redis_client.hget(KEYS.bloom, "n")) == inserted > items * 0.97
    return df, old


@pytest.mark.parametrize("garbage", ["12abc", "-1", "1e30", b"\xff\x00", "0", "3", str(10**15), "7999"])
@pytest.mark.parametrize("fresh_worker", [False, True], ids=["running", "fresh"])
def test_a_garbage_item_count_is_recounted_from_the_filter_and_the_crawl_goes_on(
    redis_url: str, redis_client: Any, garbage: Any, fresh_worker: bool
) -> None:
    """A count someone wrote -- not a number, past the bound, or one the filter's blocks contradict (too
    low: the filters after it exist; too high: the filter it names does not) -- does not stop the workers:
    the next call recounts it (the newest filter that exists and its fill), writes it back and says so;
    nothing inserted before is forgotten."""
    df, old = _filled_chain(redis_client, 2500)
    redis_client.hset(KEYS.bloom, "n", garbage)
    if fresh_worker:  # a worker started after the garbage: it knows no count but the garbage
        df = BloomDupeFilter(redis_client, KEYS, None, capacity=1000, error_rate=0.01)
        df.open()
    new = _tokens(10**6)
    batch = SyncBatch(enqueue=[(*new, 0, b"\x01new", "", ""), (*old[7], 0, b"\x01old", "", "")])
    (res,) = run(_sync(redis_url, batch, df=df))
    assert res.new == [True, False] and KEYS.bloom in res.repaired
    n = int(redis_client.hget(KEYS.bloom, "n"))
    assert 2500 * 0.9 < n < 2500 * 1.1, n  # the fill of the newest filter gives its items
    assert all(df.seen_tokens(old, add=False))  # every filter is still tested
    (res,) = run(_sync(redis_url, SyncBatch(enqueue=[(*_tokens(10**6 + 1), 0, b"\x01b", "", "")]), df=df))
    assert res.new == [True] and res.repaired == []  # repaired once
    assert int(redis_client.hget(KEYS.bloom, "n")) == n + 1


def test_the_dupefilters_own_calls_recount_a_garbage_count_too(
    redis_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    df, old = _filled_chain(redis_client, 1500)
    redis_client.hset(KEYS.bloom, "n", "x")
    with caplog.at_level(logging.WARNING):
        assert df.seen_tokens([old[3], _tokens(10**6)]) == [True, False]
    assert any(KEYS.bloom in r.getMessage() and "Repaired" in r.getMessage() for r in caplog.records)
    assert 1500 * 0.9 < int(redis_client.hget(KEYS.bloom, "n")) < 1500 * 1.1


def test_a_filter_truly_at_its_bound_refuses_the_next_insert(redis_url: str, redis_client: Any) -> None:
    """The bound itself stays: a chain that really holds MAX_OVERSHOOT times its capacity (its blocks
    agree with its count) refuses one more insert, in one line, with nothing written."""
    df = BloomDupeFilter(redis_client, KEYS, None, capacity=100, error_rate=0.01)
    df.open()
    i = 0
    while int(redis_client.hget(KEYS.bloom, "n") or 0) < 100 * MAX_OVERSHOOT:
        want = 100 * MAX_OVERSHOOT - int(redis_client.hget(KEYS.bloom, "n") or 0)
        df.seen_tokens([_tokens(10**7 + i + j) for j in range(want)])
        i += want
    before = sorted(redis_client.keys("*"))
    with pytest.raises(FrontierStateError) as err:
        run(_sync(redis_url, SyncBatch(enqueue=[(*_tokens(1), 0, b"\x01x", "", "")]), df=df))
    assert err.value.reason == "bloom_bound" and err.value.key == KEYS.bloom
    with pytest.raises(BloomParameterError, match="the bound"):
        df.seen_tokens([_tokens(2)])
    assert sorted(redis_client.keys("*")) == before


def test_a_count_raised_mid_crawl_names_no_millions_of_keys(redis_url: str, redis_client: Any) -> None:
    df = _bloom(redis_client, capacity=1000)
    t1, t2 = _tokens(3)
    run(_sync(redis_url, SyncBatch(enqueue=[(t1, t2, 0, b"\x01x", "", "")]), df=df))
    for n in (10**15, 1000 * MAX_OVERSHOOT + 1, 1000 * MAX_OVERSHOOT - 1):
        redis_client.hset(KEYS.bloom, "n", n)
        t1, t2 = _tokens(n)
        (res,) = run(_sync(redis_url, SyncBatch(enqueue=[(t1, t2, 0, b"\x01y", "", "")]), df=df))
        assert res.new == [True] and KEYS.bloom in res.repaired
        assert int(redis_client.hget(KEYS.bloom, "n")) < 10  # recounted: a handful of items
    assert len(df.plan._specs) < 10  # no plan was built for millions of items
    # the worker's own view past the bound: refused before any key name is built
    df.n = 10**15
    with pytest.raises(BloomParameterError, match="field n was changed"):
        df.script_args(1)


def test_an_oversized_member_is_rejected_with_crawl_wide_politeness(
    redis_url: str, redis_client: Any
) -> None:
    entry = ("", "", 0, b"\x01ok", "a.example", "0 2 0")
    run(_sync(redis_url, SyncBatch(enqueue=[entry]), politeness="cluster"))
    big = b"a.example\0" + b"0" * 11 + b"\0\0\0\0\0\x01" + b"\x01" + b"x" * 5000  # sorts first
    redis_client.zadd(KEYS.queue, {big: 0})
    (res,) = run(_sync(redis_url, SyncBatch(lease=5), politeness="cluster", max_entry_bytes=1000))
    assert [lease_member(m).endswith(b"\x01ok") for m, _ in res.leased] == [True] and res.rejected == 1
    assert json.loads(redis_client.lindex(KEYS.queue_rejected, 0))["reason"] == "entry_too_large"
    assert _domain_state(redis_client)[0] == b"1"  # one slot taken, not two
    assert redis_client.zcard(KEYS.queue) == 0


# -- crawl-wide politeness: the queue must stay one score, its members leasable ------------------------
def _polite_entries(n: int, domain: str = "a.example") -> list[Any]:
    return [("", "", 0, b"\x01p%d" % i, domain, "0 0 0") for i in range(n)]


@pytest.mark.parametrize(("member", "score"), [
    (b"\xff", -1.0), (b"zz.example\0" + b"0" * 17 + b"\x01", float("-inf")), (b"\x00", 1.0),
    (b"a.example\0junk", 1e300),
])
def test_one_queue_member_of_another_score_does_not_hide_the_frontier(
    redis_url: str, redis_client: Any, member: bytes, score: float
) -> None:
    """ZRANGEBYLEX is only defined over members of one score: a single member written at another score
    (ahead of the domain's requests, sorting after them) makes the domain's range read empty, so the
    domain would leave the schedule and no worker would lease again, were it not put back at score 0."""
    run(_sync(redis_url, SyncBatch(enqueue=_polite_entries(5)), politeness="cluster"))
    redis_client.zadd(KEYS.queue, {member: score})
    leased = []
    for _ in range(3):
        (res,) = run(_sync(redis_url, SyncBatch(lease=10), politeness="cluster"))
        leased += [lease_member(m) for m, _ in res.leased]
    ours = {m[m.index(b"\0") + 1 + 11 + SEQ_BYTES :] for m in leased if m.startswith(b"a.example\0")}
    assert ours >= {b"\x01p%d" % i for i in range(5)}  # every queued request was leased
    assert redis_client.zcount(KEYS.queue, "-inf", "(0") == redis_client.zcount(KEYS.queue, "(0", "+inf") == 0


def test_queue_members_no_worker_would_lease_are_taken_up(redis_url: str, redis_client: Any) -> None:
    """Members without a domain part are rejected whole; members of a domain without a backlog (written
    by someone else, or its counter reset) get the backlog recounted, so they are leased; a domain with a
    backlog that someone removed from the schedule is scheduled again. The queue drains."""
    run(_sync(redis_url, SyncBatch(enqueue=_polite_entries(2, "b.example")), politeness="cluster"))
    redis_client.zrem(KEYS.domains, "b.example")  # backlog 2, not scheduled
    foreign = b"c.example\0" + b"0" * 11 + b"\0" * 6 + b"\x01x"  # a domain without a backlog
    redis_client.zadd(KEYS.queue, {b"no domain part": 0, foreign: 0})
    leased: list[bytes] = []
    rejected = 0
    for _ in range(40):
        (res,) = run(_sync(redis_url, SyncBatch(lease=10), politeness="cluster"))
        leased += [lease_member(m) for m, _ in res.leased]
        rejected += res.rejected
        if redis_client.zcard(KEYS.queue) == 0:
            break
    assert redis_client.zcard(KEYS.queue) == 0
    assert rejected == 1 and json.loads(redis_client.lindex(KEYS.queue_rejected, -1))["reason"] == "no_domain"
    assert sorted(m.split(b"\0")[0] for m in leased) == [b"b.example", b"b.example", b"c.example"]


def test_a_lease_tag_cannot_requeue_at_another_score_with_politeness(
    redis_url: str, redis_client: Any
) -> None:
    (_, taken) = run(_sync(redis_url, SyncBatch(enqueue=_polite_entries(1)), SyncBatch(lease=1), now=100,
                          politeness="cluster", lease_seconds=10))
    (key, _), = taken.leased
    redis_client.zrem(KEYS.leases, key)
    redis_client.zadd(KEYS.leases, {lease_key(lease_member(key), "w1", "-5"): 0})
    (res,) = run(_sync(redis_url, SyncBatch(lease=5), now=200, politeness="cluster", lease_seconds=10))
    assert res.requeued == 1 and [lease_member(m) for m, _ in res.leased] == [lease_member(key)]
