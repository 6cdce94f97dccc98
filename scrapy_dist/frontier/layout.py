"""A crawl's layout in Redis: its shards with their keys and dupefilters (joined at start, removed at the
end), which shard a request goes to (:class:`ShardRouter`), and the control hash ``{spider}:control``."""

from __future__ import annotations

import contextlib
import logging
import math
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis
from scrapy.utils.httpobj import urlparse_cached

from scrapy_dist.exceptions import RejectedEntry, ScrapyDistError, ShardingRefused
from scrapy_dist.frontier import shard as _shard
from scrapy_dist.redis import scripts
from scrapy_dist.redis.connection import CONNECT_ERRORS
from scrapy_dist.redis.keys import GARBAGE
from scrapy_dist.wire.codec import load_payload

if TYPE_CHECKING:
    from collections.abc import Callable, Collection

    from scrapy import Request

    from scrapy_dist.frontier.orders import DomainLimits
    from scrapy_dist.frontier.shard import SyncResult
    from scrapy_dist.redis.keys import CrawlKeys
    from scrapy_dist.settings import SchedulerSettings

logger = logging.getLogger(__name__)

_DELETE_BATCH = 100  # keys per DEL
FRONTIER_FORMAT = 3  #: control field ``format``: bumped by any change an older worker would misread
_FORMAT_LIMIT = 1000  # a larger ``format`` field is garbage (overwritten, warned)
REPAIR_GRACE = 10.0  # seconds after a key holding requests was moved aside: empty is not drained yet
CLOSE_AT_SLACK = 60.0  #: how far past the server's time a ``close_at`` still counts (lua/idle.lua)
MAX_SHARDS = 1024  # the most shards a control hash may record (more is garbage)
REASON = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # a close reason, a paused_by
_reported: set[tuple[str, str]] = set()


def format_check(spider: str, recorded: bytes | None, ours: int, running: int) -> str | None:
    """``None`` (join), ``"write"`` (join and record ``ours``), or :class:`ScrapyDistError` (do not join)."""
    if recorded is None:
        return "write"
    text = recorded.decode(errors="replace")
    if not text.isdigit() or not 0 < int(text) < _FORMAT_LIMIT:
        logger.warning("The crawl %r: its control hash's field format holds %r, not a frontier format;"
                       " recorded %d (this worker's)", spider, text[:40], ours)
        return "write"
    if (theirs := int(text)) > ours:
        raise ScrapyDistError(f"The crawl {spider!r} was written by a newer scrapy-dist (frontier format"
                              f" {theirs}; this worker reads up to {ours}): upgrade this worker, or start"
                              " afresh (SCHEDULER_FLUSH_ON_START).")
    if theirs < ours and running:
        raise ScrapyDistError(f"The crawl {spider!r} has {running} worker(s) of an older scrapy-dist running"
                              f" (frontier format {theirs}; this worker writes {ours}, which they would"
                              " misread): stop them, then start the upgraded workers (docs/operations.md,"
                              " Upgrading).")
    return "write" if theirs < ours else None


@dataclass(eq=False)
class CrawlLayout:
    """The shards of one crawl (``keys.shards(n)``) and the dupefilter of each."""

    keys: CrawlKeys
    df: Any
    config: SchedulerSettings  # its lease: a worker seen within it counts as running
    paused: bool = False  # the crawl-wide pause flag when this worker joined
    #: this worker's per-domain limits (crawl-wide politeness): their bound and default go in every sync call
    limits: DomainLimits | None = None

    def __post_init__(self) -> None:
        self.shards, self.politeness = self.config.shards, self.config.politeness
        self.shard_keys = self.keys.shards(self.shards)  # shard 0 is the crawl's own keys
        self.shard_dfs: list[Any] = [self.df]

    def open(self, client: Any, flush_on_start: bool, batched: bool) -> tuple[int, int]:
        """Join the crawl (cleared first with ``flush_on_start``); its backlog."""
        move_aside_foreign(client, self.keys.control)
        if flush_on_start:
            self.delete(client)
            logger.info("SCHEDULER_FLUSH_ON_START: cleared the frontier of %r", self.keys.spider)
        self.join(client, batched)
        return self.backlog(client)

    def join(self, client: Any, batched: bool) -> None:
        """Record or check the crawl's mode, N and format, then open every shard's dupefilter."""
        keys = self.keys
        pipe = client.pipeline(transaction=False)
        pipe.hsetnx(keys.control, "politeness", self.politeness)
        pipe.hsetnx(keys.control, "shards", self.shards)
        if self.politeness == "cluster" and self.limits:  # what `status` shows a domain without its own
            pipe.hset(keys.control, "limits", self.limits.default.encode())
        pipe.hmget(keys.control, ["politeness", "shards", "format", "paused"])
        mode, shards, recorded, paused = pipe.execute()[-1]
        self.paused = paused == b"1"
        now = server_time(client)  # the clock heartbeats are written with (not pipelined: Cluster)
        running = 0
        with contextlib.suppress(redis.ResponseError):  # not a ZSET: garbage a sync call moves aside
            running = client.zcount(keys.workers, now - self.config.lease_seconds, "+inf")
        if format_check(keys.spider, recorded, FRONTIER_FORMAT, running) == "write":
            client.hset(keys.control, "format", FRONTIER_FORMAT)
        if shards is not None and not shards.isdigit():
            bad = shards[:40].decode(errors="replace")
            raise ScrapyDistError(f"{keys.control!r} holds an invalid shards field {bad!r}; start afresh"
                                  " (SCHEDULER_FLUSH_ON_START)")
        if mode is not None and (theirs := mode.decode(errors="replace")) != self.politeness:
            raise ScrapyDistError(f"The crawl {keys.spider!r} runs with SCHEDULER_POLITENESS={theirs!r}; this"
                                  f" worker has {self.politeness!r}. Use the crawl's mode, or start afresh"
                                  " (SCHEDULER_FLUSH_ON_START).")
        if shards is not None and int(shards) != self.shards:
            raise ShardingRefused(f"The crawl {keys.spider!r} runs with SCHEDULER_SHARDS={int(shards)}; this"
                                  f" worker has {self.shards}. Every worker of a crawl must use the same"
                                  f" number: use {int(shards)}, or start afresh (SCHEDULER_FLUSH_ON_START).")
        if self.shards > 1 and batched:
            self.shard_dfs = [self.df.for_shard(k, self.shards) for k in self.shard_keys]
        if hasattr(self.df, "open"):
            for df in self.shard_dfs:
                df.open()

    def backlog(self, client: Any) -> tuple[int, int]:
        """(requests queued, leased or delayed; fingerprints remembered) over every shard."""
        pipe = client.pipeline(transaction=False)
        for k in self.shard_keys:
            pipe.hget(k.queue_tails, "count")  # queue members may be chunks of several requests
            for key in (k.queue, k.leases, k.delayed):
                pipe.zcard(key)
            pipe.hmget(k.bloom, ["n", "live"])  # live: the bloom generations' items (DUPEFILTER_TTL)
            pipe.scard(k.fingerprints)
            pipe.zcard(k.fingerprints_ttl)
        replies = pipe.execute()
        pending = remembered = 0
        for i in range(0, len(replies), 7):
            counted, members, leased, delayed, (bloom_n, live), fps, expiring = replies[i : i + 7]
            pending += max(scripts.count(counted), members) + leased + delayed
            remembered += scripts.count(bloom_n) + scripts.count(live) + fps + expiring
        return pending, remembered

    def frontiers(self, redis: Any, worker_id: str, sequence: str, batched: bool) -> list[_shard.Frontier]:
        bound, default = (self.limits.bound(), self.limits.default.encode()) if self.limits else ("", "")
        return [_shard.Frontier(redis, keys, worker_id, df if batched else None, self.config, sequence,
                                limits_bound=bound, limits_default=default, heartbeat=i == 0)
                for i, (keys, df) in enumerate(zip(self.shard_keys, self.shard_dfs, strict=True))]

    @staticmethod
    def key_names(keys: CrawlKeys, df: Any) -> list[str]:
        own = getattr(df, "key_names", None)
        return keys.frontier_keys() + (own() if own is not None else [])

    def layouts(self, shards: int) -> list[tuple[CrawlKeys, Any]]:
        if shards == 1:
            return [(self.keys, self.df)]
        if shards == self.shards and len(self.shard_dfs) == shards:
            return list(zip(self.shard_keys, self.shard_dfs, strict=True))
        split = getattr(self.df, "for_shard", None)
        return [(k, split(k, shards) if split else self.df) for k in self.keys.shards(shards)]

    def delete(self, client: Any) -> None:
        """``SCHEDULER_FLUSH_ON_START``: delete every shard's keys (of this worker's N and the recorded N)."""
        recorded = client.hget(self.keys.control, "shards")
        recorded_n = int(recorded) if recorded is not None and recorded.isdigit() else 1
        for shards in sorted({self.shards, max(1, min(recorded_n, MAX_SHARDS))}):
            for keys, df in self.layouts(shards):
                for batch in _batches(self.key_names(keys, df)):
                    client.delete(*batch)

    async def finish(self, redis: Any, worker_id: str) -> None:
        """``SCHEDULER_PERSIST = False``: the last worker to leave a finished crawl removes its keys."""
        keys = self.keys
        if self.shards > 1 and not await _shard.shards_idle(redis, self.shard_keys):
            await redis.zrem(keys.workers, worker_id)
            return
        layouts = self.layouts(self.shards)
        first = [keys.workers, keys.queue, keys.leases, keys.delayed]
        deleted = await scripts.register(redis, "finish")(
            keys=first + [k for k in self.key_names(*layouts[0]) if k not in first],
            args=[worker_id, repr(self.config.lease_seconds)])
        if deleted:
            for shard_keys, df in layouts[1:]:
                for batch in _batches(self.key_names(shard_keys, df)):
                    await redis.delete(*batch)
            logger.info("SCHEDULER_PERSIST is off and the crawl has finished: removed its frontier keys")

    async def leave_unmonitored(self, redis: Any, worker_id: str) -> None:
        """A worker without a details hash (no ClusterStats) leaves the workers ZSET, else shown lost."""
        with contextlib.suppress(*CONNECT_ERRORS):  # Redis away: shown lost, as a worker that vanished
            if not await redis.exists(self.keys.worker(worker_id)):
                await redis.zrem(self.keys.workers, worker_id)

    def filter_stats(self) -> dict[str, float]:
        if self.shards == 1 or len(self.shard_dfs) == 1:
            return dict(self.df.stats_snapshot()) if hasattr(self.df, "stats_snapshot") else {}
        plans = [getattr(df, "plan", None) for df in self.shard_dfs]
        if any(p is None for p in plans):
            return {}
        items = sum(df.n for df in self.shard_dfs)
        capacity = sum(p.capacity for p in plans if p is not None)
        # a URL is looked up in one shard's filter only: the worst shard bounds the rate
        worst = max(p.false_positive_rate(df.n) for p, df in zip(plans, self.shard_dfs, strict=True) if p)
        return {"dupefilter/bloom/items": items, "dupefilter/bloom/fill_ratio": round(items / capacity, 6),
                "dupefilter/bloom/fpr_estimate": worst}


def _batches(names: list[str]) -> list[list[str]]:
    return [names[i : i + _DELETE_BATCH] for i in range(0, len(names), _DELETE_BATCH)]


@dataclass(frozen=True)
class FrontierState:
    """The crawl-wide frontier after a round that reached every shard."""

    queued: int
    inflight: int
    delayed: int
    empty_confirmed: bool  # every shard was seen empty at one instant

    def as_dict(self) -> dict[str, int]:
        return {"queued": self.queued, "inflight": self.inflight, "delayed": self.delayed}


class ShardRouter:
    """Routing and the crawl-wide view over ``shards`` shards (1 = unsharded)."""

    def __init__(self, shards: int = 1, fingerprinter: Any = None, by_domain: bool = False) -> None:
        self.shards, self.fingerprinter = shards, fingerprinter
        self.by_domain = by_domain  # route by host: a domain's queue, limits and fingerprints on one shard
        #: each shard's last answer: (queued, inflight, delayed, its sequence counter)
        self.states: list[tuple[int, int, int, int] | None] = [None] * shards
        self._last_snapshot: tuple[tuple[int, int, int, int] | None, ...] | None = None
        self._repaired_at: float | None = None

    def shard(self, request: Request, fingerprint: bytes | None = None) -> int:
        """The shard of a new request: its fingerprint's, or its host's when routing by domain."""
        if self.shards == 1:
            return 0
        if self.by_domain:
            return _shard.domain_shard((urlparse_cached(request).hostname or "").lower(), self.shards)
        return _shard.shard_of(fingerprint or bytes(self.fingerprinter.fingerprint(request)), self.shards)

    def domain(self, domain: str) -> int:
        return _shard.domain_shard(domain, self.shards) if self.by_domain else 0

    def lease_split(self, want: int) -> list[int]:
        """``want`` split over the shards by their last queue length (evenly while all look empty)."""
        if (n := self.shards) == 1 or want <= 0:
            return [want] + [0] * (n - 1)
        queued = [st[0] if st is not None else 0 for st in self.states]
        if (total := sum(queued)) == 0:
            base, extra = divmod(want, n)
            return [max(1, base + (i < extra)) for i in range(n)]
        return [max(1, want * q // total) if q else 0 for q in queued]

    def observe(self, shard: int, result: SyncResult, now: float | None = None) -> None:
        self.states[shard] = (result.queued, result.inflight, result.delayed, result.seq)
        if result.work_repaired:
            self._repaired_at = time.monotonic() if now is None else now

    def forget_snapshot(self) -> None:
        self._last_snapshot = None

    def settle(self, now: float | None = None) -> FrontierState:
        """The crawl-wide state; with shards, empty twice with no sequence counter moved in between."""
        queued, inflight, delayed = (sum(st[i] for st in self.states if st is not None) for i in range(3))
        empty = not (queued or inflight or delayed)
        snapshot = tuple(self.states)
        confirmed = empty if self.shards == 1 else empty and snapshot == self._last_snapshot
        self._last_snapshot = snapshot if empty else None
        if confirmed and self._repaired_at is not None:
            confirmed = (time.monotonic() if now is None else now) - self._repaired_at >= REPAIR_GRACE
        return FrontierState(queued, inflight, delayed, confirmed)


def _shard_count(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= 6 and 1 <= int(text) <= MAX_SHARDS


def parse_control(raw: Any) -> ControlState:
    """The one parser of ``{spider}:control``; raises :class:`RejectedEntry` only if ``raw`` is not a hash."""
    d = scripts.hash_fields(raw, "control")
    problems: list[str] = []

    def checked(field: str, valid: Callable[[str], Any], note: str, fallback: str = "") -> str:
        if not (value := d.get(field, "")) or valid(value):
            return value
        problems.append(f"{field}={value[:40]!r}{note}")
        return fallback
    paused = checked("paused", ("0", "1").__contains__, " (expected 0 or 1)") == "1"
    close = checked("close", REASON.fullmatch, " (not a close reason)")
    at: float | None = None
    if close_at := d.get("close_at", ""):
        with contextlib.suppress(ValueError):
            at = float(close_at)
        if at is None or not math.isfinite(at) or at < 0:
            problems.append(f"close_at={close_at[:40]!r} (not a time)")
            at = None
    shards = checked("shards", _shard_count, f" (expected 1 to {MAX_SHARDS})")
    paused_by = checked("paused_by", REASON.fullmatch, "", "?")
    politeness = checked("politeness", ("process", "cluster").__contains__, " (expected process or cluster)")
    return ControlState(paused, paused_by, close, at, int(shards) if shards else None, politeness,
                        tuple(problems))


@dataclass(frozen=True)
class ControlState:
    """The control flags as :func:`parse_control` read them."""

    paused: bool = False
    paused_by: str = ""
    close: str = ""
    close_at: float | None = None
    shards: int | None = None  # None (and politeness "") if absent or garbage
    politeness: str = ""
    problems: tuple[str, ...] = ()  # one short description per garbage field

    from_hash = staticmethod(parse_control)

    def close_reason(self, started_at: float, now: float | None = None) -> str:
        """The close reason decided since ``started_at`` and not past ``now`` + :data:`CLOSE_AT_SLACK`."""
        if not self.close or self.close_at is None or self.close_at < started_at:
            return ""
        return "" if now is not None and self.close_at > now + CLOSE_AT_SLACK else self.close


def report_problems(control_key: str, state: ControlState) -> None:
    """Log each garbage field of ``control_key`` once per process (WARNING), whatever values it takes."""
    for problem in state.problems:
        if (control_key, (field := problem.partition("=")[0])) not in _reported:
            _reported.add((control_key, field))
            logger.warning("Ignoring garbage in %s: %s", control_key, problem)


def move_aside_foreign(client: Any, control_key: str) -> None:
    """Move a control hash of another Redis type aside to ``<key>:garbage`` (with a warning)."""
    if (kind := scripts.text(client.type(control_key))) not in ("none", "hash"):
        client.rename(control_key, control_key + GARBAGE)
        logger.warning("%s held another Redis type (%s): moved to %s", control_key, kind,
                       control_key + GARBAGE)


def pause_crawl(client: Any, control_key: str, by: str = "cli") -> None:
    """Every worker stops taking new requests at its next sync."""
    move_aside_foreign(client, control_key)
    client.hset(control_key, mapping={"paused": "1", "paused_by": by, "paused_at": repr(time.time())})


def close_crawl(client: Any, control_key: str, reason: str = "shutdown") -> None:
    """Every running worker's idle monitor closes with ``reason``; workers started afterwards ignore it."""
    if not REASON.fullmatch(reason):
        raise ValueError(f"close reason {reason!r}: letters, digits and _.:- only, at most 64")
    move_aside_foreign(client, control_key)
    client.hset(control_key, mapping={"close": reason, "close_at": f"{server_time(client):.6f}"})


def resume_crawl(client: Any, control_key: str, errors_key: str) -> None:
    """Lift the pause and any close decision and empty the error window (which would pause it again)."""
    move_aside_foreign(client, control_key)
    pipe = client.pipeline(transaction=False)
    pipe.hset(control_key, "paused", "0")
    pipe.hdel(control_key, "paused_by", "paused_at", "close", "close_at", "errors_tripped_at")
    pipe.delete(errors_key)
    pipe.execute()


def server_time(client: Any) -> float:
    sec, usec = client.time()
    return int(sec) + int(usec) / 1e6


async def start_time(redis: Any) -> float:
    """Redis server time (the clock every worker and the CLI agree on); this machine's if Redis is away."""
    try:
        sec, usec = await redis.time()
        return int(sec) + int(usec) / 1e6
    except Exception:
        return time.time()


def end_chains(client: Any, shard_keys: list[CrawlKeys], polite: bool,
               urls: Collection[str] | None = None) -> int:
    """Remove the scheduled revisits of ``urls`` (None: all) from every shard's delayed set; how many."""
    ended = 0
    for keys in shard_keys:
        found: list[bytes] = []
        try:
            for member, meta in client.hscan_iter(keys.delayed_meta, count=1000):
                if not (isinstance(meta, bytes) and meta.endswith(b" r")) or member == b"revisits":
                    continue
                if urls is None or _entry_url(member, polite) in urls:
                    found.append(member)
        except redis.ResponseError:  # WRONGTYPE
            continue
        removed = 0
        for i in range(0, len(found), 1000):
            pipe = client.pipeline(transaction=False)
            for member in found[i : i + 1000]:
                pipe.zrem(keys.delayed, member)
                pipe.hdel(keys.delayed_meta, member)
            removed += sum(pipe.execute()[::2])
        if removed:  # the scheduled revisit count (garbage restarts at 0)
            left = scripts.count(client.hget(keys.delayed_meta, "revisits"))
            client.hset(keys.delayed_meta, "revisits", max(0, left - removed))
        ended += removed
    return ended


def _entry_url(member: bytes, polite: bool) -> str | None:
    try:
        url = load_payload(member[len(_shard.member_prefix(member, polite)) :]).get("u")
    except (RejectedEntry, ValueError):
        return None
    return url if isinstance(url, str) else None
