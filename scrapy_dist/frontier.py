"""The Redis side of the shared frontier: one worker's batched exchange with the ``sync`` Lua script.

:class:`Frontier` knows keys, the dupefilter's script arguments and the wire layout of ``sync.lua``; it
holds no crawl state of its own (the scheduler does). One :meth:`Frontier.sync` call costs exactly one
Redis round trip (EVALSHA) whatever it carries: requests to dedupe and enqueue, acknowledgements, lease
renewals and releases, delayed retries, rejections, dead letters, and how many requests to lease.

With a sharded frontier (``SCHEDULER_SHARDS = N``) there is one :class:`Frontier` per shard, each on that
shard's keys (:meth:`scrapy_dist.keys.CrawlKeys.shard`) and dupefilter; :func:`shard_of` says which shard
a request belongs to. The scheduler talks to all of them each round (see docs/frontier.md).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scrapy_dist import scripts
from scrapy_dist.exceptions import FrontierScriptError

if TYPE_CHECKING:
    from scrapy_dist.dupefilter import RedisDupeFilter
    from scrapy_dist.keys import CrawlKeys

#: length of the sequence prefix of every queue member
SEQ_BYTES = 6
#: with crawl-wide politeness, members start with "<domain>\0" and an 11-digit priority key
PRIORITY_KEY_BYTES = 11


def shard_of(fingerprint: bytes, shards: int) -> int:
    """The shard of a request of a sharded frontier: its fingerprint's first 8 bytes (big-endian) modulo
    ``shards``. Stable across processes and machines (no hash randomisation), so every worker sends the
    same URL to the same shard and that shard's dupefilter sees every copy of it."""
    if shards <= 1:
        return 0
    return int.from_bytes(fingerprint[:8], "big") % shards


async def shards_idle(redis: Any, shard_keys: list[CrawlKeys]) -> bool:
    """Whether there was a moment when no shard held anything queued, leased or delayed.

    Shards live in different slots (on a cluster, on different nodes), so no single call reads them all
    atomically, and a request may move between two reads (its child enqueued in shard B, then the parent
    acknowledged in shard A). Every way into a shard creates an entry and so increments that shard's
    ``seq``; two collections (pipelined: ZCARD queue, leases, delayed and GET seq per shard, twice) that
    both find every shard empty with the same ``seq`` values prove every shard was empty at any instant
    between them (a "double collect"). Two round trips.
    """

    async def collect() -> list[Any]:
        pipe = redis.pipeline(transaction=False)
        for k in shard_keys:
            pipe.zcard(k.queue)
            pipe.zcard(k.leases)
            pipe.zcard(k.delayed)
            pipe.get(k.seq)
        return list(await pipe.execute())

    first = await collect()
    if any(int(v) for i, v in enumerate(first) if i % 4 != 3):
        return False
    return await collect() == first


def queue_singles(member: bytes) -> list[bytes]:
    """The entries (``6-byte seq + payload``, as leased) inside one member of the queue ZSET.

    Mirrors ``singles_of`` in ``lua/sync.lua``: a member whose 7th byte is ``\\0`` is a chunk of records
    ``<2-byte length><6-byte seq><payload>``; anything else is a single entry. For tools and tests.
    """
    if len(member) < 7 or member[6] != 0:
        return [member]
    out, p = [], 7
    while p < len(member):
        if p + 2 > len(member):
            out.append(member[p:])
            break
        n = int.from_bytes(member[p : p + 2], "big")
        if p + 2 + SEQ_BYTES + n > len(member):
            out.append(member[p:])
            break
        out.append(member[p + 2 : p + 2 + SEQ_BYTES + n])
        p += 2 + SEQ_BYTES + n
    return out


@dataclass
class SyncBatch:
    """Everything one ``sync`` call sends."""

    #: (t1, t2, score, payload, domain, limits); t1 == "" skips dedupe, payload == b"" dedupes only;
    #: domain and limits ("delay concurrency jitter") matter only with crawl-wide politeness
    enqueue: list[tuple[Any, Any, float, bytes, str, str]] = field(default_factory=list)
    ack: list[bytes] = field(default_factory=list)
    renew: list[bytes] = field(default_factory=list)
    release: list[bytes] = field(default_factory=list)
    #: (score, payload, not_before, domain, limits) -- not_before in this machine's unix time; sent as a
    #: delay relative to now, so the Redis server's clock (which the script uses) decides, whatever the skew
    delay: list[tuple[float, bytes, float, str, str]] = field(default_factory=list)
    #: (member, JSON record)
    reject: list[tuple[bytes, str]] = field(default_factory=list)
    #: JSON records
    dead: list[str] = field(default_factory=list)
    #: (domain, seconds): push the domain's next allowed time back (429/503)
    penalize: list[tuple[str, float]] = field(default_factory=list)
    lease: int = 0

    def __bool__(self) -> bool:
        return bool(
            self.enqueue or self.ack or self.renew or self.release or self.delay or self.reject
            or self.dead or self.penalize or self.lease
        )


@dataclass
class SyncResult:
    """What one ``sync`` call answers."""

    new: list[bool]
    leased: list[tuple[bytes, float]]
    requeued: int
    moved: int
    queued: int
    inflight: int
    delayed: int
    bloom_n: int
    paused: bool
    #: the shard's sequence counter (grows with every entry created; see sync.lua)
    seq: int = 0


class Frontier:
    """Async access to one crawl's frontier in Redis (a ``redis.asyncio`` client)."""

    def __init__(
        self,
        redis: Any,
        keys: CrawlKeys,
        worker_id: str,
        dupefilter: RedisDupeFilter | None,
        sequence: str = "asc",
        lease_seconds: float = 60.0,
        politeness: str = "process",
        heartbeat: bool = True,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.worker_id = worker_id
        self.dupefilter = dupefilter
        self.sequence = sequence
        self.lease_seconds = lease_seconds
        self.politeness = politeness
        self._polite = politeness == "cluster"
        #: False for the shards > 0 of a sharded frontier: the worker's heartbeat is written by shard 0
        self.heartbeat = heartbeat
        self._rng = random.Random()
        self._script = scripts.register(redis, "sync")
        k = keys
        self._fixed_keys = [
            k.queue, k.leases, k.lease_meta, k.seq, k.delayed, k.delayed_meta,
            k.queue_rejected, k.deadletter, k.workers, k.control, k.domains, k.domain_info, k.queue_tails,
        ]

    async def sync(self, batch: SyncBatch, now: float | None = None) -> SyncResult:
        """Send ``batch`` in one atomic script call (retried with more bloom keys if the chain grew)."""
        df = self.dupefilter
        body = self._body(batch, time.time() if now is None else now)
        for _ in range(64):
            if df is not None:
                dkeys, params = df.script_keys_params(len(batch.enqueue))
                mode = df.mode
            else:
                dkeys, params, mode = [self.keys.fingerprints], [], "none"
            args = [
                "" if now is None else repr(now), self.worker_id, repr(self.lease_seconds), batch.lease,
                self.sequence, self.politeness, self._rng.randrange(2**31), mode, len(params), *params,
                *body,
            ]
            raw = await self._script(keys=self._fixed_keys + dkeys, args=args)
            if raw[0] == -1:
                if df is None:
                    raise FrontierScriptError("sync script asked for bloom keys without a bloom filter")
                df.observe(int(raw[1]))
                continue
            return self._result(raw, len(batch.enqueue))
        raise FrontierScriptError("bloom filter chain did not settle")  # pragma: no cover

    def _body(self, b: SyncBatch, now: float) -> list[Any]:
        polite = self._polite
        out: list[Any] = [len(b.enqueue)]
        for t1, t2, score, payload, domain, limits in b.enqueue:
            out += [t1, t2, repr(float(score)), payload]
            if polite:
                out += [domain, limits]
        out.append(len(b.ack))
        out += b.ack
        out.append(len(b.renew))
        out += b.renew
        out.append(len(b.release))
        out += b.release
        out.append(len(b.delay))
        for score, payload, not_before, domain, limits in b.delay:
            out += [repr(float(score)), payload, repr(max(0.0, float(not_before) - now))]
            if polite:
                out += [domain, limits]
        out.append(len(b.reject))
        for member, record in b.reject:
            out += [member, record]
        out.append(len(b.dead))
        out += b.dead
        out.append(len(b.penalize))
        for domain, seconds in b.penalize:
            out += [domain, repr(float(seconds))]
        if not self.heartbeat:
            out.append("0")
        return out

    def payload_of(self, member: bytes) -> bytes:
        """The encoded request inside a queue member."""
        if self._polite:
            return member[member.index(b"\0") + 1 + PRIORITY_KEY_BYTES + SEQ_BYTES :]
        return member[SEQ_BYTES:]

    def _result(self, raw: list[Any], n_enqueue: int) -> SyncResult:
        flags = raw[0].decode() if isinstance(raw[0], bytes) else str(raw[0] or "")
        if len(flags) != n_enqueue:
            raise FrontierScriptError(f"sync returned {len(flags)} flags for {n_enqueue} requests")
        flat = raw[1]
        leased = [(flat[i], float(flat[i + 1])) for i in range(0, len(flat), 2)]
        if self.dupefilter is not None:
            self.dupefilter.observe(int(raw[7]))
        paused = raw[8] in (b"1", "1")
        return SyncResult(
            [f == "1" for f in flags], leased, int(raw[2]), int(raw[3]), int(raw[4]), int(raw[5]),
            int(raw[6]), int(raw[7]), paused, int(raw[9]) if len(raw) > 9 else 0,
        )
