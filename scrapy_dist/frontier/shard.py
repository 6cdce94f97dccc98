"""The Redis side of the shared frontier: one worker's batched exchange with the ``sync`` script, declared
here once (keys, ARGV head, sections, answer); one :class:`Frontier` per shard, one round trip per call."""

from __future__ import annotations

import hashlib
import math
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from scrapy_dist.exceptions import FrontierScriptError, FrontierStateError
from scrapy_dist.redis.scripts import Library, text
from scrapy_dist.settings import SchedulerSettings
from scrapy_dist.wire.codec import decode_request

if TYPE_CHECKING:
    from scrapy import Request

    from scrapy_dist.dupefilter import RedisDupeFilter
    from scrapy_dist.redis.keys import CrawlKeys
    from scrapy_dist.wire.entrypolicy import EntryPolicy

SEQ_BYTES = 6  #: length of the sequence prefix of every queue member
PRIORITY_KEY_BYTES = 11  #: crawl-wide politeness: a member starts "<domain>\0" + an 11-digit priority key
LEASE_MARK = b"\0\xff"  #: between a lease key's member and its tag (``LEASE_MARK`` in lua/sync_sweep.lua)
CALL_RECORDS = 48  #: most discovered requests per call to a shard (a script holds Redis; docs/capacity.md)
SETTLE_PER_RECORD = 6  #: an ack, a lease or a renewal costs the script about a sixth of a discovered request
SETTLE_MIN_RECORDS = 8  #: discovered requests the call settling a shard's leases always carries
CALLS_PER_ROUND = 8  #: most calls of one round to one shard (sent concurrently, one round trip)


def domain_shard(domain: str, shards: int) -> int:
    """The shard of every request of ``domain`` (lower-case host) when routing by domain."""
    if shards <= 1:
        return 0
    digest = hashlib.blake2b(domain.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % shards


def shard_of(fingerprint: bytes, shards: int) -> int:
    """A request's shard: its fingerprint's first 8 bytes modulo ``shards``, the same in every process."""
    return int.from_bytes(fingerprint[:8], "big") % shards if shards > 1 else 0


async def shards_idle(redis: Any, shard_keys: list[CrawlKeys]) -> bool:
    """Whether there was a moment when no shard held anything queued, leased or delayed: every way into a
    shard increments its ``seq``, so two reads finding all empty with the same ``seq`` values prove one."""

    async def collect() -> list[Any]:
        pipe = redis.pipeline(transaction=False)
        for k in shard_keys:
            for key in (k.queue, k.leases, k.delayed):
                pipe.zcard(key)
            pipe.get(k.seq)
        return list(await pipe.execute())
    first = await collect()
    return not any(int(v) for i, v in enumerate(first) if i % 4 != 3) and await collect() == first


def lease_parts(key: bytes) -> tuple[bytes, bytes | None, bytes | None]:
    """A lease key (the queue member followed by its tag) as ``(member, score, worker id)``; ``score`` and
    ``worker`` are None for a key without a tag (an older lease) or a tag without a space."""
    if (size := len(key)) >= 6:
        at = size - 4 - int.from_bytes(key[-2:], "big")
        if at >= 1 and key[at : at + 2] == LEASE_MARK:
            score, sep, worker = key[at + 2 : -2].partition(b" ")
            return (key[:at], score, worker) if sep else (key[:at], None, None)
    return key, None, None


def lease_member(key: bytes) -> bytes:
    return lease_parts(key)[0]


@dataclass(frozen=True)
class ItemRoute:
    """Where items riding their page's ack go: ``mode`` "list" (RPUSH) or "stream" (XADD, ``maxlen`` cap)."""

    key: str
    mode: str = "list"
    maxlen: int | None = None


@dataclass
class SyncBatch:
    """Everything one ``sync`` call sends (encoded by :func:`encode_sync_sections`)."""

    #: (t1, t2, score, payload, domain, limits); t1 == "" skips dedupe, payload == b"" dedupes only;
    #: domain and limits ("delay concurrency jitter") matter only with crawl-wide politeness
    enqueue: list[tuple[Any, Any, float, bytes, str, str]] = field(default_factory=list)
    #: ack, renew, release, reject and revisit name leases by their lease keys (as ``leased`` answered)
    ack: list[bytes] = field(default_factory=list)
    renew: list[bytes] = field(default_factory=list)
    release: list[bytes] = field(default_factory=list)
    #: (score, payload, not_before, domain, limits): not_before in this machine's unix time, sent as a
    #: delay relative to now (the server's clock decides, whatever the skew)
    delay: list[tuple[float, bytes, float, str, str]] = field(default_factory=list)
    reject: list[tuple[bytes, str]] = field(default_factory=list)  # (lease key, JSON record)
    dead: list[str] = field(default_factory=list)  # JSON records
    penalize: list[tuple[str, float]] = field(default_factory=list)  # (domain, seconds) (429/503)
    lease: int = 0
    #: (lease key, delay in seconds, new queue member or b""): acks that file the request again (revisits)
    revisit: list[tuple[bytes, float, bytes]] = field(default_factory=list)
    forget: list[tuple[Any, Any]] = field(default_factory=list)  # (t1, t2) tokens, DEADLETTER_FORGET
    #: (lease key, encoded item): appended only if that lease's ack is accepted (lua/sync_items.lua)
    items: list[tuple[bytes, bytes | str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))


@dataclass
class SyncResult:
    """What one ``sync`` call answers (decoded by name by :func:`decode_sync_result`)."""

    new: list[bool]
    leased: list[tuple[bytes, float]]  # (lease key, queue score): the request is the key's member
    requeued: int
    moved: int
    queued: int
    inflight: int
    delayed: int
    bloom_n: int
    paused: bool
    seq: int = 0  # the shard's sequence counter (grows with every entry created)
    rejected: int = 0  # queue members the script rejected whole (lua/sync_lease.lua)
    replayed: int = 0  # of which copies of a signed entry already handed out
    repaired: list[str] = field(default_factory=list)  # keys whose garbage the script repaired
    forgets: str = ""  # the control hash's forget generation (untrusted, compared only; scrapy-dist forget)
    work_repaired: bool = False  # a repaired key held work (queue, leases or delayed): moved aside, empty
    #: items appended to the items key, items refused with their ack, acks refused (lua/sync_items.lua)
    items: int = 0
    items_refused: int = 0
    acks_refused: int = 0


SYNC_KEYS = (  #: KEYS in order, with the type kept there (another is moved aside); then the dupefilter's
    ("queue", "zset"), ("leases", "zset"), ("lease_meta", "hash"), ("seq", "string"), ("delayed", "zset"),
    ("delayed_meta", "hash"), ("queue_rejected", "list"), ("deadletter", "list"), ("workers", "zset"),
    ("control", "hash"), ("domains", "zset"), ("domain_info", "hash"), ("queue_tails", "hash"),
    ("spent", "zset"))
SYNC_HEAD = (  #: the ARGV head, by name; then P and the P dupe params
    "now", "worker", "lease_seconds", "lease", "order", "politeness", "seed", "heartbeat",
    "max_entry_bytes", "rejected_maxlen", "dead_maxlen", "dupe_mode", "limits_bound", "limits_default",
    "replay_memory", "items_mode", "items_maxlen")


@dataclass(frozen=True)
class SyncSection:
    """One section of a sync call: a count, then per item ``fields`` (and ``polite_fields`` if polite)."""

    name: str
    fields: tuple[str, ...]
    polite_fields: tuple[str, ...]
    encode: Callable[[Any, float], tuple[Any, ...]]


def _score(x: float) -> str:
    # Redis refuses a NaN score, and a refusal half way through a script is a half-done call
    return repr(float(x)) if math.isfinite(x) else "0.0"


SYNC_SECTIONS = (  #: the sections, in ARGV order
    SyncSection("enqueue", ("t1", "t2", "score", "payload"), ("domain", "limits"),
                lambda e, now: (e[0], e[1], _score(e[2]), e[3], e[4], e[5])),
    SyncSection("ack", ("member",), (), lambda m, now: (m,)),
    SyncSection("renew", ("member",), (), lambda m, now: (m,)),
    SyncSection("release", ("member",), (), lambda m, now: (m,)),
    SyncSection("delay", ("score", "payload", "delay"), ("domain", "limits"),
                lambda e, now: (_score(e[0]), e[1], _score(max(0.0, float(e[2]) - now)), e[3], e[4])),
    SyncSection("reject", ("member", "record"), (), lambda e, now: (e[0], e[1])),
    SyncSection("dead", ("record",), (), lambda r, now: (r,)),
    SyncSection("penalize", ("domain", "seconds"), (), lambda e, now: (e[0], _score(e[1]))),
    SyncSection("revisit", ("member", "delay", "new"), (),
                lambda e, now: (e[0], _score(max(0.0, float(e[1]))), e[2])),
    SyncSection("forget", ("t1", "t2"), (), lambda e, now: (e[0], e[1])),
    SyncSection("items", ("member", "data"), (), lambda e, now: (e[0], e[1])))


def sync_prelude() -> str:
    """The Lua declarations of the protocol above, put before the sync script's fragments."""
    keys = ", ".join(f"'{name}'" for name, _ in SYNC_KEYS)
    types = ", ".join(f"{name} = '{kind}'" for name, kind in SYNC_KEYS)
    head = ", ".join(f"'{name}'" for name in SYNC_HEAD)
    sections = ", ".join(f"{{'{s.name}', {len(s.fields)}, {len(s.polite_fields)}}}" for s in SYNC_SECTIONS)
    by_name = ", ".join(f"{name} = keys[{i}]" for i, (name, _) in enumerate(SYNC_KEYS, 1))
    head_by_name = ", ".join(f"{name} = argv[{i}]" for i, name in enumerate(SYNC_HEAD, 1))
    no_sections = ", ".join(f"{s.name} = false" for s in SYNC_SECTIONS)
    return (
        "-- generated from scrapy_dist/frontier/shard.py (SYNC_KEYS, SYNC_HEAD, SYNC_SECTIONS)\n"
        f"local SYNC_KEYS = {{{keys}}}\n"
        f"local SYNC_TYPES = {{{types}}}\n"
        f"local SYNC_HEAD = {{{head}}}\n"
        "-- name, items' width without politeness, extra width with politeness\n"
        f"local SYNC_SECTIONS = {{{sections}}}\n"
        "-- KEYS, the ARGV head and (to fill) the sections by name: tables built whole, one allocation each\n"
        f"local function sync_names(keys, argv)\n  return {{{by_name}}},\n    {{{head_by_name}}},\n"
        f"    {{{no_sections}}}\nend\n")


def split_calls(out: list[Any], shards: int, settle: list[int], max_records: int = CALL_RECORDS,
                max_calls: int = 1) -> tuple[list[list[Any]], list[int], list[Any]]:
    """Each call's requests, each call's shard, and what is left: one call per shard (index = shard), then
    up to ``max_calls - 1`` more calls of ``max_records`` to a shard with more. A shard's first call also
    settles ``settle[shard]`` leases, acks and renewals, so it takes fewer."""
    sent: list[list[Any]] = [[] for _ in range(shards)]
    shard_of = list(range(shards))
    filling, calls = list(range(shards)), [1] * shards  # per shard: the call being filled, calls used
    room = [max(SETTLE_MIN_RECORDS, max_records - load // SETTLE_PER_RECORD) for load in settle]
    left: list[Any] = []
    for entry in out:
        shard = entry.shard
        call = filling[shard]
        if len(sent[call]) >= (room[shard] if call < shards else max_records):
            if calls[shard] >= max_calls:
                left.append(entry)
                continue
            call = filling[shard] = len(sent)
            calls[shard] += 1
            sent.append([])
            shard_of.append(shard)
        sent[call].append(entry)
    return sent, shard_of, left


def encode_sync_sections(batch: SyncBatch, now: float, polite: bool) -> list[Any]:
    """The sections of ``batch`` as the sync script's ARGV (after the head and dupe params)."""
    out: list[Any] = []
    for sec in SYNC_SECTIONS:
        items = getattr(batch, sec.name)
        width = len(sec.fields) + (len(sec.polite_fields) if polite else 0)
        out.append(len(items))
        for item in items:
            out += sec.encode(item, now)[:width]
    return out


SYNC_RESULT = (  #: the answer's names, in the order the script returns them (lua/sync.lua)
    "flags", "leased", "requeued", "moved", "queued", "inflight", "delayed", "bloom_n", "paused", "seq",
    "rejected", "repaired", "replayed", "items", "items_refused", "acks_refused", "forgets")
_NOT_COUNTS = ("flags", "leased", "paused", "repaired", "forgets")


def _count(named: dict[str, Any], name: str) -> int:
    value = named.get(name, 0)
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise FrontierScriptError(f"sync answered {name}={value!r}, not a count") from None
    if n < 0:
        raise FrontierScriptError(f"sync answered {name}={n}, a negative count")
    return n


def decode_sync_result(raw: Any, n_enqueue: int) -> SyncResult:
    """The :class:`SyncResult` of a sync answer (a flat name, value list). Raises :class:`FrontierStateError`
    for the script's ``{-2, reason, key}`` refusal, :class:`FrontierScriptError` for anything malformed."""
    if not isinstance(raw, list) or len(raw) < 2:
        raise FrontierScriptError(f"sync answered {type(raw).__name__}, not a list")
    if raw[0] == -2:
        raise FrontierStateError(text(raw[1])[:100], text(raw[2] if len(raw) > 2 else "")[:200])
    if len(raw) % 2:
        raise FrontierScriptError("sync answered an odd-length list")
    named = {text(raw[i]): raw[i + 1] for i in range(0, len(raw), 2)}
    if missing := [n for n in SYNC_RESULT[:10] if n not in named]:
        raise FrontierScriptError(f"sync answered without {', '.join(missing)}")
    if len(flags := text(named["flags"])) != n_enqueue or flags.strip("01"):
        raise FrontierScriptError(f"sync returned {len(flags)} flags for {n_enqueue} requests")
    if not isinstance(flat := named["leased"], list) or len(flat) % 2:
        raise FrontierScriptError("sync answered a malformed leased list")
    leased = []
    for member, score in zip(flat[::2], flat[1::2], strict=True):
        if not isinstance(member, bytes):
            raise FrontierScriptError("sync answered a leased member that is not bytes")
        try:
            value = float(score)
        except (TypeError, ValueError):
            raise FrontierScriptError(f"sync answered a lease score {score!r}") from None
        leased.append((member, value if math.isfinite(value) else 0.0))
    repaired = named.get("repaired", [])
    counts: dict[str, Any] = {name: _count(named, name) for name in SYNC_RESULT if name not in _NOT_COUNTS}
    return SyncResult([f == "1" for f in flags], leased, paused=named["paused"] in (b"1", "1"), **counts,
                      repaired=[text(k) for k in repaired] if isinstance(repaired, list) else [],
                      forgets=text(named.get("forgets"))[:32])


@dataclass(eq=False)  # compared and hashed by identity
class Frontier:
    """Async access to one crawl's frontier in Redis (a ``redis.asyncio`` client)."""

    redis: Any
    keys: CrawlKeys
    worker_id: str
    dupefilter: RedisDupeFilter | None
    config: SchedulerSettings = field(default_factory=SchedulerSettings)
    sequence: str = "asc"
    #: ``"<delay> <jitter>"`` no domain's limits exceed (:meth:`DomainLimits.bound`); "" = polite.lua's bounds
    limits_bound: str = ""
    #: ``"<delay> <concurrency> <jitter>"`` of a domain no ``DOMAIN_LIMITS`` rule matches; "" = none
    limits_default: str = ""
    heartbeat: bool = True  #: False for shards > 0: shard 0 writes the worker's heartbeat
    items: ItemRoute | None = None  #: where the items riding the acks go; None: calls carry none
    functions: bool = True  #: False: EVALSHA even where FUNCTION libraries exist (more server work)

    def __post_init__(self) -> None:
        self._polite = self.config.politeness == "cluster"
        self._rng = random.Random()
        self._script = Library(self.redis, "sync", sync_prelude(), self.functions)
        self._fixed_keys = [getattr(self.keys, name) for name, _ in SYNC_KEYS]
        self._work_keys = frozenset((self.keys.queue, self.keys.leases, self.keys.delayed))

    def _head(self, batch: SyncBatch, now: float | None, mode: str) -> list[Any]:
        cfg = self.config
        head = {
            "now": "" if now is None else repr(now), "worker": self.worker_id,
            "lease_seconds": repr(cfg.lease_seconds), "lease": batch.lease, "order": self.sequence,
            "politeness": cfg.politeness, "seed": self._rng.randrange(2**31),
            "heartbeat": "1" if self.heartbeat else "0", "max_entry_bytes": cfg.max_entry_bytes,
            "rejected_maxlen": cfg.rejected_maxlen, "dead_maxlen": cfg.dead_maxlen, "dupe_mode": mode,
            "limits_bound": self.limits_bound, "limits_default": self.limits_default,
            "replay_memory": cfg.replay_memory,
            "items_mode": "" if self.items is None else self.items.mode,
            "items_maxlen": "" if self.items is None or self.items.maxlen is None else self.items.maxlen}
        return [head[name] for name in SYNC_HEAD]

    async def sync(self, batch: SyncBatch, now: float | None = None) -> SyncResult:
        """Send ``batch`` in one atomic script call (retried with more bloom keys if the chain grew); raises
        :class:`FrontierStateError` when the script refused to write."""
        df = self.dupefilter
        body = encode_sync_sections(batch, time.time() if now is None else now, self._polite)
        for _ in range(64):
            mode, dkeys, params = (df.script_args(len(batch.enqueue), now) if df is not None
                                   else ("none", [self.keys.forgotten, self.keys.fingerprints], []))
            args = [*self._head(batch, now, mode), len(params), *params, *body]
            tail = [] if self.items is None else [self.items.key]
            raw = await self._script(keys=self._fixed_keys + dkeys + tail, args=args)
            if isinstance(raw, list) and len(raw) == 2 and raw[0] == -1:
                if df is None:
                    raise FrontierScriptError("sync script asked for bloom keys without a bloom filter")
                df.observe(int(raw[1]))
                continue
            result = decode_sync_result(raw, len(batch.enqueue))
            if df is not None:
                df.observe(result.bloom_n)
            result.work_repaired = not self._work_keys.isdisjoint(result.repaired)
            return result
        raise FrontierScriptError("bloom filter chain did not settle")  # pragma: no cover

    async def own_leases(self, limit: int) -> list[bytes]:
        """Up to ``limit`` lease keys in this shard's leases ZSET that name this worker (ZSCAN, MATCH on its
        id; a third party's member is only ever given back, and the queue rejects it if it is no request)."""
        worker = self.worker_id.encode()
        # a lease key's tag ends with the worker id and two length bytes
        pattern = b"*" + re.sub(rb"([*?\[\]\\])", rb"\\\1", worker) + b"??"
        found: list[bytes] = []
        async for key, _ in self.redis.zscan_iter(self.keys.leases, match=pattern, count=1000):
            if lease_parts(key)[2] == worker:
                found.append(key)
                if len(found) >= limit:
                    break
        return found


def member_prefix(member: bytes, polite: bool) -> bytes:
    """The part of a queue member before its payload (seq, or domain, priority key and seq)."""
    if polite:
        return member[: member.index(b"\0") + 1 + PRIORITY_KEY_BYTES + SEQ_BYTES]
    return member[:SEQ_BYTES]


@dataclass
class RequestDecoder:
    """Leased members (lease keys) as requests under the crawl's entry policy, or RejectedEntry."""

    spider: Any
    policy: EntryPolicy
    polite: bool
    #: a last check raising RejectedEntry (a host written as a denied IP address: the resolver never sees it)
    check: Callable[[Request], Request]

    def __call__(self, shard: int, member: bytes) -> Request:
        member = lease_member(member)
        return self.check(decode_request(member[len(member_prefix(member, self.polite)) :], self.spider,
                                         self.policy))
