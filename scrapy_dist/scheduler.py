"""The shared frontier as a drop-in Scrapy scheduler: ``SCHEDULER = "scrapy_dist.scheduler.Scheduler"``.

Scrapy calls ``enqueue_request``, ``next_request`` and ``has_pending_requests`` synchronously on the
reactor thread, many times per page. None of them touches Redis: they work on in-memory buffers that a
background asyncio task (:meth:`Scheduler._run`) exchanges with Redis in batches, one ``sync`` Lua call
(= one round trip) at a time:

* discovered requests are encoded, buffered, and sent at most ``SCHEDULER_FLUSH_INTERVAL`` seconds later
  (or once ``SCHEDULER_FLUSH_BATCH`` wait); the script dedupes them through the dupefilter and enqueues
  the new ones atomically;
* requests are leased ahead of demand (``SCHEDULER_PREFETCH``) in the same call;
* a leased request is acknowledged only once the engine has finished it (download, callback and item
  pipelines) -- and the acknowledgement travels in the same atomic call as the requests its callback
  produced, so a worker killed at any moment loses nothing: what it held is requeued when its leases
  (``SCHEDULER_LEASE_SECONDS``, renewed while it works) run out;
* the frontier's crawl-wide state (queued, in flight on any worker, delayed) comes back with every call,
  so ``has_pending_requests`` answers from memory and stays true while any worker holds work.

Redis outages: the task logs one warning, keeps every buffer, retries with capped backoff and carries on.

Sharded frontier (``SCHEDULER_SHARDS = N > 1``, see docs/frontier.md): each round is one ``sync`` per
shard, sent concurrently (``asyncio.gather``). A discovered request or a delayed retry goes to the shard of
its fingerprint (:func:`scrapy_dist.frontier.shard_of`); an ack, renewal, release or rejection goes to the
shard its member was leased from; dead letters ride with shard 0. The lease count is split over the shards
by their queue lengths, and leased requests wait in a buffer served highest priority first. A request's
acknowledgement can no longer share one atomic call with the requests its callback produced when those
went to other shards, so it is held back until a round carrying them has landed on every shard: a worker
killed in between re-crawls the request, it never loses its children.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import os
import secrets
import socket
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from scrapy.utils.defer import deferred_from_coro
from scrapy.utils.httpobj import urlparse_cached
from scrapy.utils.misc import build_from_crawler, load_object

from scrapy_dist import _engine, connection, defaults, queue
from scrapy_dist.codec import decode_request, encode_request
from scrapy_dist.dupefilter import RedisDupeFilter
from scrapy_dist.exceptions import RejectedEntry, ScrapyDistError, ShardingRefused, UnserializableRequest
from scrapy_dist.frontier import Frontier, SyncBatch, SyncResult, shard_of, shards_idle
from scrapy_dist.keys import CrawlKeys, crawl_keys
from scrapy_dist.politeness import DomainLimits
from scrapy_dist.rejections import RateLimitedLog, rejection_record

if TYPE_CHECKING:
    from scrapy import Request, Spider
    from scrapy.crawler import Crawler
    from twisted.internet.defer import Deferred
    from typing_extensions import Self

logger = logging.getLogger(__name__)

#: Redis down, restarting or failing over (cluster errors included): keep the buffers, wait, retry
_REDIS_DOWN: tuple[type[BaseException], ...] = (
    RedisConnectionError, RedisTimeoutError, *connection.OUTAGE_ERRORS,
)
#: most fingerprints remembered per process to skip links already sent (cleared when full)
RECENT_LIMIT = 500_000

#: A leased member and the shard it was leased from (always 0 with one shard).
Lease = tuple[int, bytes]


class LeasedBuffer:
    """Leased requests waiting to be handed to the engine.

    With one shard (``by_score=False``) a plain FIFO: requests arrive in the queue's own order. With
    several, a heap on the queue score (``-priority``), ties in the order leased: whatever shards a
    worker's requests came from, it starts the highest priority it holds first.
    """

    def __init__(self, by_score: bool) -> None:
        self.by_score = by_score
        self._fifo: deque[tuple[Request, Lease]] = deque()
        self._heap: list[tuple[float, int, Request, Lease]] = []
        self._count = itertools.count()

    def push(self, score: float, request: Request, lease: Lease) -> None:
        if self.by_score:
            heapq.heappush(self._heap, (score, next(self._count), request, lease))
        else:
            self._fifo.append((request, lease))

    def pop(self) -> tuple[Request, Lease]:
        if self.by_score:
            _, _, request, lease = heapq.heappop(self._heap)
            return request, lease
        return self._fifo.popleft()

    def leases(self) -> list[Lease]:
        """Every lease in the buffer (for releasing them at close)."""
        return [e[-1] for e in self._heap] if self.by_score else [lease for _, lease in self._fifo]

    def clear(self) -> None:
        self._fifo.clear()
        self._heap.clear()

    def __len__(self) -> int:
        return len(self._heap) + len(self._fifo)

    def __bool__(self) -> bool:
        return bool(self._heap or self._fifo)


def make_worker_id() -> str:
    """``host:pid:random`` -- unique per process, readable in ``scrapy-dist status``."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(2)}"


def get_scheduler(crawler: Crawler) -> Scheduler | None:
    """The running scrapy-dist scheduler of ``crawler``, if it uses one."""
    try:
        engine = crawler.engine
    except RuntimeError:  # Crawler.engine raises until the crawl starts
        return None
    sched = getattr(getattr(engine, "_slot", None), "scheduler", None)
    return sched if isinstance(sched, Scheduler) else None


class Scheduler:
    """Scrapy scheduler backed by a Redis frontier shared by every worker of the crawl.

    Settings (defaults in :mod:`scrapy_dist.defaults`): ``SCHEDULER_QUEUE_CLASS``, ``SCHEDULER_PERSIST``,
    ``SCHEDULER_FLUSH_ON_START``, ``SCHEDULER_IDLE_BEFORE_CLOSE``, ``SCHEDULER_LEASE_SECONDS``,
    ``SCHEDULER_PREFETCH``, ``SCHEDULER_FLUSH_INTERVAL``, ``SCHEDULER_FLUSH_BATCH``,
    ``SCHEDULER_IDLE_POLL``, ``SCHEDULER_ALLOWED_SCHEMES``, ``SCHEDULER_MAX_ENTRY_BYTES``,
    ``SCHEDULER_SHARDS``.
    """

    def __init__(
        self,
        crawler: Crawler,
        dupefilter: Any,
        *,
        order: queue.QueueOrder | None = None,
        persist: bool = True,
        flush_on_start: bool = False,
        idle_before_close: float = 0.0,
        lease_seconds: float = 60.0,
        prefetch: int = 64,
        flush_interval: float = 0.05,
        flush_batch: int = 500,
        idle_poll: float = 0.25,
        allowed_schemes: tuple[str, ...] = ("http", "https"),
        max_entry_bytes: int = 1024 * 1024,
        politeness: str = "process",
        domain_limits: DomainLimits | None = None,
        shards: int = 1,
    ) -> None:
        self.crawler = crawler
        self.stats = crawler.stats
        self.df = dupefilter
        self.order = order or queue.PriorityQueue()
        self.persist = persist
        self.flush_on_start = flush_on_start
        self.idle_before_close = idle_before_close
        self.lease_seconds = lease_seconds
        self.prefetch = max(1, prefetch)
        self.flush_interval = flush_interval
        self.flush_batch = flush_batch
        self.idle_poll = idle_poll
        self.allowed_schemes = tuple(s.lower() for s in allowed_schemes)
        self.max_entry_bytes = max_entry_bytes
        if politeness not in ("process", "cluster"):
            raise ValueError(f"SCHEDULER_POLITENESS must be 'process' or 'cluster', not {politeness!r}")
        self.politeness = politeness
        self.domain_limits = domain_limits
        if shards < 1:
            raise ValueError(f"SCHEDULER_SHARDS must be >= 1, not {shards!r}")
        self.shards = shards
        self.worker_id = make_worker_id()
        self.keys = crawl_keys(crawler.settings, crawler.spidercls.name)
        #: the keys of every shard; shard 0 is the crawl's own keys
        self.shard_keys = self.keys.shards(shards)
        self.redis: Any = None  # redis.asyncio client, created on the reactor's loop in open()
        #: shard 0's frontier (the only one with one shard)
        self.frontier: Frontier | None = None
        self.frontiers: list[Frontier] = []
        #: one dupefilter per shard (the crawl's own dupefilter with one shard)
        self.shard_dfs: list[Any] = [dupefilter]
        self.spider: Spider | None = None
        #: last crawl-wide state reported by Redis: queued / inflight / delayed, or None before the first
        self.frontier_status: dict[str, int] | None = None
        self.paused = False
        self._local_pause = False
        self._batched_df = isinstance(dupefilter, RedisDupeFilter)
        # buffers (all touched only on the reactor thread)
        self._ready = LeasedBuffer(by_score=shards > 1)
        self._local: deque[Request] = deque()
        #: (request, t1, t2, score, payload, domain, limits, shard)
        self._out: list[tuple[Request, Any, Any, float, bytes, str, str, int]] = []
        self._sent_out: list[list[tuple[Request, Any, Any, float, bytes, str, str, int]]] = []
        self._handed: dict[Request, Lease] = {}
        #: acks whose requests' output is already in Redis (or travels in the same call)
        self._acks: list[Lease] = []
        #: acks of requests just finished: their output may still be in this worker's buffers
        self._acks_new: list[Lease] = []
        #: acks held back during the current round, sendable once it has landed on every shard
        self._acks_waiting: list[Lease] = []
        self._delays: list[tuple[float, bytes, float, str, str]] = []
        self._delay_shards: list[int] = []
        self._penalties: list[tuple[str, float]] = []
        self._dead: list[str] = []
        self._rejects: list[tuple[Lease, str]] = []
        self._releases: list[Lease] = []
        self._held: set[Lease] = set()
        #: last answer of each shard: queued, inflight, delayed, seq
        self._shard_state: list[tuple[int, int, int, int] | None] = [None] * shards
        self._last_snapshot: tuple[tuple[int, int, int, int] | None, ...] | None = None
        #: the crawl-wide frontier was seen empty (with shards: in two rounds, no entry created between)
        self._empty_confirmed = False
        #: (requests leased, requests asked for, queued crawl-wide) of the last complete round
        self._lease_result = (0, 0, 0)
        self._recent: set[Any] = set()
        self._first_pending: float | None = None
        self._in_sync = False
        self._empty_since: float | None = None
        self._next_fetch = 0.0
        self._next_renew = 0.0
        self._last_sync = 0.0
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._outage_since: float | None = None
        self._unserializable_logged: set[str] = set()
        self._reject_log = RateLimitedLog(logger)
        self._no_inprogress_warned = False

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        s = crawler.settings
        dupefilter_cls = load_object(s["DUPEFILTER_CLASS"])
        dupefilter = build_from_crawler(dupefilter_cls, crawler)
        qcls_path = s.get("SCHEDULER_QUEUE_CLASS", defaults.SCHEDULER_QUEUE_CLASS)
        qcls: Any = queue.ALIASES.get(qcls_path) or load_object(qcls_path)
        prefetch = s.getint("SCHEDULER_PREFETCH", defaults.SCHEDULER_PREFETCH) or max(
            16, 2 * s.getint("CONCURRENT_REQUESTS")
        )
        idle = s.getfloat(
            "SCHEDULER_IDLE_BEFORE_CLOSE",
            s.getfloat("MAX_IDLE_TIME_BEFORE_CLOSE", defaults.SCHEDULER_IDLE_BEFORE_CLOSE),
        )
        return cls(
            crawler,
            dupefilter,
            order=qcls(),
            persist=s.getbool("SCHEDULER_PERSIST", defaults.SCHEDULER_PERSIST),
            flush_on_start=s.getbool("SCHEDULER_FLUSH_ON_START", defaults.SCHEDULER_FLUSH_ON_START),
            idle_before_close=idle,
            lease_seconds=s.getfloat("SCHEDULER_LEASE_SECONDS", defaults.SCHEDULER_LEASE_SECONDS),
            prefetch=prefetch,
            flush_interval=s.getfloat("SCHEDULER_FLUSH_INTERVAL", defaults.SCHEDULER_FLUSH_INTERVAL),
            flush_batch=s.getint("SCHEDULER_FLUSH_BATCH", defaults.SCHEDULER_FLUSH_BATCH),
            idle_poll=s.getfloat("SCHEDULER_IDLE_POLL", defaults.SCHEDULER_IDLE_POLL),
            allowed_schemes=tuple(s.getlist("SCHEDULER_ALLOWED_SCHEMES", defaults.SCHEDULER_ALLOWED_SCHEMES)),
            max_entry_bytes=s.getint("SCHEDULER_MAX_ENTRY_BYTES", defaults.SCHEDULER_MAX_ENTRY_BYTES),
            politeness=s.get("SCHEDULER_POLITENESS", defaults.SCHEDULER_POLITENESS),
            domain_limits=DomainLimits.from_settings(s),
            shards=s.getint("SCHEDULER_SHARDS", defaults.SCHEDULER_SHARDS),
        )

    # -- lifecycle ---------------------------------------------------------------------------------
    def open(self, spider: Spider) -> Deferred[None]:
        self.spider = spider
        return deferred_from_coro(self._open())

    async def _open(self) -> None:
        settings = self.crawler.settings
        # one clear line and a non-zero exit if Redis is not there (building a client can fail too)
        connection.ensure_reachable(settings)
        if self.shards > 1 and self.politeness == "cluster":
            # polite.lua keeps a domain's backlog, slots and next allowed time in one hash that every
            # lease of that domain reads and writes atomically; with shards a domain's requests sit in
            # several slots, so no single script could enforce its limits
            connection.abort_crawl(ShardingRefused(
                f"SCHEDULER_SHARDS={self.shards} cannot be combined with SCHEDULER_POLITENESS='cluster':"
                " a domain's timing state must live in one hash slot. Use SCHEDULER_SHARDS=1 or"
                " SCHEDULER_POLITENESS='process'."
            ))
        sync_client = connection.get_redis(settings)
        if self.flush_on_start:
            self._delete_crawl_keys(sync_client)
            logger.info("SCHEDULER_FLUSH_ON_START: cleared the frontier of %r", self.keys.spider)
        # queue entries are laid out differently with crawl-wide politeness, and a request's shard depends
        # on N: one mode and one N per crawl, recorded by its first worker
        pipe = sync_client.pipeline(transaction=False)
        pipe.hsetnx(self.keys.control, "politeness", self.politeness)
        pipe.hsetnx(self.keys.control, "shards", self.shards)
        pipe.hmget(self.keys.control, ["politeness", "shards"])
        mode, shards = pipe.execute()[-1]
        if shards is not None and not shards.isdigit():
            sync_client.close()
            connection.abort_crawl(ScrapyDistError(
                f"{self.keys.control!r} holds an invalid shards field"
                f" {shards[:40].decode(errors='replace')!r}; start afresh (SCHEDULER_FLUSH_ON_START)"
            ))
        if mode is not None and mode.decode() != self.politeness:
            sync_client.close()
            connection.abort_crawl(ScrapyDistError(
                f"The crawl {self.keys.spider!r} runs with SCHEDULER_POLITENESS={mode.decode()!r}; this"
                f" worker has {self.politeness!r}. Use the crawl's mode, or start afresh"
                " (SCHEDULER_FLUSH_ON_START)."
            ))
        if shards is not None and int(shards) != self.shards:
            sync_client.close()
            connection.abort_crawl(ShardingRefused(
                f"The crawl {self.keys.spider!r} runs with SCHEDULER_SHARDS={int(shards)}; this worker has"
                f" {self.shards}. Every worker of a crawl must use the same number of shards (use"
                f" {int(shards)}, or start afresh with SCHEDULER_FLUSH_ON_START)."
            ))
        if self.shards > 1 and self._batched_df:
            self.shard_dfs = [self.df.for_shard(k, self.shards) for k in self.shard_keys]
        if hasattr(self.df, "open"):
            try:
                for df in self.shard_dfs:
                    df.open()
            except ScrapyDistError as exc:  # e.g. a bloom filter written with another bit layout
                sync_client.close()
                connection.abort_crawl(exc)
        sync_client.close()
        self.redis = connection.get_async_redis(settings)
        self.frontiers = [
            Frontier(
                self.redis, keys, self.worker_id, df if self._batched_df else None,
                sequence=self.order.sequence, lease_seconds=self.lease_seconds, politeness=self.politeness,
                heartbeat=i == 0,
            )
            for i, (keys, df) in enumerate(zip(self.shard_keys, self.shard_dfs, strict=True))
        ]
        self.frontier = self.frontiers[0]
        if self.politeness == "cluster":
            from scrapy import signals

            self.crawler.signals.connect(self._response_received, signal=signals.response_received)
        if not self._batched_df and type(self.df).__name__ != "BaseDupeFilter":
            logger.warning(
                "DUPEFILTER_CLASS %s is not a scrapy-dist dupefilter: duplicates are filtered per worker"
                " only. Use scrapy_dist.dupefilter.BloomDupeFilter for crawl-wide deduplication.",
                type(self.df).__name__,
            )
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())
        if self.shards > 1:
            logger.info(
                "scrapy-dist frontier %r open as worker %s (%d shards)", self.keys.queue, self.worker_id,
                self.shards,
            )
        else:
            logger.info("scrapy-dist frontier %r open as worker %s", self.keys.queue, self.worker_id)

    def close(self, reason: str) -> Deferred[None]:
        return deferred_from_coro(self._close(reason))

    async def _close(self, reason: str) -> None:
        self._closing = True
        if self._wakeup is not None:
            self._wakeup.set()
        if self._task is not None:
            await self._task
        self._collect_finished()
        # unstarted and unfinished work goes straight back to the queue instead of waiting for expiry
        self._releases += self._ready.leases() + list(self._handed.values())
        self._ready.clear()
        self._handed.clear()
        deadline = time.monotonic() + min(30.0, self.lease_seconds)
        # with shards, held-back acks need one more round once their requests' output has landed
        while self.frontiers and (self._has_writes() or self._releases or self._acks_new or self._acks):
            error = await self._round(lease=0, renew=False)
            if error is None:
                continue
            if not isinstance(error, _REDIS_DOWN) or time.monotonic() > deadline:
                logger.error(
                    "Redis unreachable at close (%s): %d leased requests will be requeued when their"
                    " leases expire; %d discovered requests were not saved",
                    error, len(self._held), len(self._out),
                )
                break
            await asyncio.sleep(1.0)
        if not self.persist and reason == "finished":
            await self._finish_crawl()
        if hasattr(self.df, "close"):
            self.df.close(reason)
        if self._batched_df:
            for k, v in self._filter_stats().items():
                self.stats.set_value(k, v)
        if self.redis is not None:
            await self.redis.aclose()

    # -- Scrapy's scheduler interface (reactor thread, no I/O) ---------------------------------------
    def has_pending_requests(self) -> bool:
        if self._ready or self._local or self._out or self._handed or self._in_sync:
            return True
        if self._acks or self._acks_new or self._acks_waiting or self._has_writes():
            return True
        if self.paused or self._local_pause:
            return True
        st = self.frontier_status
        if st is None or st["queued"] or st["inflight"] or st["delayed"] or not self._empty_confirmed:
            self._empty_since = None
            return True
        now = time.monotonic()
        if self._empty_since is None:
            self._empty_since = now
        return now - self._empty_since < self.idle_before_close

    def enqueue_request(self, request: Request) -> bool:
        if not self._batched_df and not request.dont_filter and self.df.request_seen(request):
            self.df.log(request, self.spider)
            return False
        try:
            payload = encode_request(request, self.spider)
        except UnserializableRequest as exc:
            self._unserializable(request, exc)
            payload = b""
        t1: Any = ""
        t2: Any = ""
        fp: bytes | None = None
        if self._batched_df and not request.dont_filter:
            fp = self.df.fingerprint(request)
            t1, t2 = self.df.fingerprint_tokens(fp)
            if t1 in self._recent:  # this process already sent it: certainly seen crawl-wide
                self.df.log(request, self.spider)
                return False
            if len(self._recent) >= RECENT_LIMIT:
                self._recent.clear()
            self._recent.add(t1)
        domain, limits = self._domain(request)
        self._out.append(
            (request, t1, t2, self.order.score(request), payload, domain, limits, self._shard(request, fp))
        )
        if self._first_pending is None:
            self._first_pending = time.monotonic()
        if len(self._out) >= self.flush_batch:
            self._wake()
        return True

    def next_request(self) -> Request | None:
        if self.paused or self._local_pause:
            return None
        if self._local:
            return self._local.popleft()
        if not self._ready:
            self._wake()
            return None
        request, lease = self._ready.pop()
        self._handed[request] = lease
        self.stats.inc_value("scheduler/dequeued/redis")
        self.stats.inc_value("scheduler/dequeued")
        if len(self._ready) < self.prefetch // 2:
            self._wake()
        return request

    def __len__(self) -> int:
        st = self.frontier_status or {}
        return len(self._ready) + len(self._local) + len(self._out) + st.get("queued", 0)

    # -- services for other scrapy-dist components -----------------------------------------------------
    def delay_request(self, request: Request, not_before: float, reason: str = "") -> bool:
        """Put ``request`` in the crawl's delayed set until ``not_before`` (unix time); any worker takes it
        then. Batched: written in the next sync, atomically with the ack of the request that failed."""
        try:
            payload = encode_request(request, self.spider)
        except UnserializableRequest as exc:
            self._unserializable(request, exc)
            return False
        self._delays.append((self.order.score(request), payload, not_before, *self._domain(request)))
        self._delay_shards.append(self._shard(request))
        self._mark_pending()
        return True

    def dead_letter(self, record: str) -> None:
        """Append a JSON dead-letter record (batched, atomic with the failed request's ack)."""
        self._dead.append(record)
        self._mark_pending()

    def flushed_since(self, mark: float) -> bool:
        """Whether a sync that started after ``mark`` (a ``time.monotonic()`` value) has succeeded.

        Every sync takes *all* discovered requests buffered when it starts, so once this is true, every
        request enqueued before ``mark`` is in Redis (seeds use it to know when they may be dropped).
        """
        return self._last_sync > mark

    def flush_soon(self) -> None:
        """Send what is buffered at the next turn of the loop, not after ``SCHEDULER_FLUSH_INTERVAL``."""
        self._first_pending = time.monotonic() - self.flush_interval
        self._wake()

    def pause(self) -> None:
        """Stop handing out requests from this worker (crawl-wide pause is the ``paused`` control flag)."""
        self._local_pause = True

    def resume(self) -> None:
        self._local_pause = False
        _engine.wake(self.crawler)

    def penalize_domain(self, domain: str, seconds: float) -> None:
        """Crawl-wide politeness: no request of ``domain`` is leased for ``seconds`` (batched)."""
        self._penalties.append((domain, seconds))
        self._mark_pending()

    def _shard(self, request: Request, fingerprint: bytes | None = None) -> int:
        """The shard a new request (or a delayed retry) goes to: that of its fingerprint (pass it when
        already computed)."""
        if self.shards == 1:
            return 0
        if fingerprint is None:
            fingerprint = bytes(self.crawler.request_fingerprinter.fingerprint(request))  # type: ignore[union-attr]
        return shard_of(fingerprint, self.shards)

    def _domain(self, request: Request) -> tuple[str, str]:
        if self.politeness != "cluster" or self.domain_limits is None:
            return "", ""
        domain = (urlparse_cached(request).hostname or "").lower()
        return domain, self.domain_limits.for_domain(domain).encode()

    def _response_received(self, response: Any, request: Request, spider: Any = None) -> None:
        """429 and 503 slow the whole crawl down on that domain (Retry-After when given)."""
        if response.status not in (429, 503):
            return
        domain = (urlparse_cached(request).hostname or "").lower()
        limit = self.domain_limits.for_domain(domain) if self.domain_limits else None
        seconds = max(1.0, 2 * limit.delay) if limit else 1.0
        header = response.headers.get(b"Retry-After")
        if header:
            from scrapy_dist.deadletter import parse_retry_after

            parsed = parse_retry_after(header, now=time.time())
            if parsed is not None:
                seconds = parsed
        self.stats.inc_value(f"scheduler/politeness/penalized/{response.status}")
        self.penalize_domain(domain, min(seconds, 3600.0))

    # -- background I/O -------------------------------------------------------------------------------
    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _mark_pending(self) -> None:
        if self._first_pending is None:
            self._first_pending = time.monotonic()

    def _collect_finished(self) -> None:
        """Move requests the engine has finished from 'handed out' to 'to acknowledge'."""
        if not self._handed:
            return
        busy = _engine.inprogress(self.crawler)
        if busy is None:
            if not self._no_inprogress_warned:
                self._no_inprogress_warned = True
                logger.warning("Cannot see the engine's requests in progress: acknowledging on hand-out")
            busy = ()
        done = [r for r in self._handed if r not in busy]
        if done:
            for r in done:
                self._acks_new.append(self._handed.pop(r))
            self._mark_pending()

    def _sync_due(self, now: float) -> tuple[bool, int]:
        """Whether to sync now, and how many requests to lease."""
        want = 0
        if not (self.paused or self._local_pause) and len(self._ready) < max(1, self.prefetch // 2):
            want = self.prefetch - len(self._ready)
        fetch = want > 0 and now >= self._next_fetch
        flush = self._first_pending is not None and (
            now - self._first_pending >= self.flush_interval or len(self._out) >= self.flush_batch
        )
        stale = now - self._last_sync >= self.idle_poll
        return (fetch or flush or stale or now >= self._next_renew), (want if fetch or flush or stale else 0)

    def _has_writes(self) -> bool:
        """Whether anything waits to be written (besides acks and releases)."""
        return bool(self._out or self._delays or self._dead or self._rejects or self._penalties)

    def _lease_split(self, want: int) -> list[int]:
        """How many of ``want`` requests to lease from each shard: in proportion to each shard's last
        reported queue length, at least 1 from any non-empty shard; evenly (at least 1 each) while no
        shard is known to hold anything, so that new work anywhere is found in one round."""
        n = self.shards
        if n == 1 or want <= 0:
            return [want] + [0] * (n - 1)
        queued = [st[0] if st is not None else 0 for st in self._shard_state]
        total = sum(queued)
        if total == 0:
            base, extra = divmod(want, n)
            return [max(1, base + (i < extra)) for i in range(n)]
        return [max(1, want * q // total) if q else 0 for q in queued]

    def _take_batches(self, lease: int, renew: bool) -> list[SyncBatch]:
        """One batch per shard with everything buffered (the buffers are emptied; see :meth:`_restore`)."""
        n = self.shards
        batches = [SyncBatch() for _ in range(n)]
        sent: list[list[tuple[Request, Any, Any, float, bytes, str, str, int]]] = [[] for _ in range(n)]
        for entry in self._out:
            batches[entry[7]].enqueue.append(entry[1:7])
            sent[entry[7]].append(entry)
        for delay, shard in zip(self._delays, self._delay_shards, strict=True):
            batches[shard].delay.append(delay)
        for (shard, member), record in self._rejects:
            batches[shard].reject.append((member, record))
        for shard, member in self._releases:
            batches[shard].release.append(member)
        batches[0].dead = self._dead
        batches[0].penalize = self._penalties
        for shard, member in self._acks:
            batches[shard].ack.append(member)
        # An ack may travel with its request's output only in one atomic call: when every write of this
        # round goes to the ack's shard. Else it waits until this round has landed on every shard.
        writes = {i for i, b in enumerate(batches) if b.enqueue or b.delay or b.dead}
        waiting = []
        for shard, member in self._acks_new:
            if writes <= {shard}:
                batches[shard].ack.append(member)
            else:
                waiting.append((shard, member))
        self._acks_waiting = waiting
        if renew:
            for shard, member in self._held:
                batches[shard].renew.append(member)
        for batch, count in zip(batches, self._lease_split(lease), strict=True):
            batch.lease = count
        self._sent_out = sent
        self._out, self._acks, self._acks_new, self._delays, self._delay_shards = [], [], [], [], []
        self._rejects, self._dead, self._penalties, self._releases = [], [], [], []
        self._first_pending = None
        return batches

    def _restore(self, shard: int, batch: SyncBatch) -> None:
        """Put a shard's batch that could not be sent back in front of what came since."""
        self._out = self._sent_out[shard] + self._out
        self._acks = [(shard, m) for m in batch.ack] + self._acks
        self._delays = batch.delay + self._delays
        self._delay_shards = [shard] * len(batch.delay) + self._delay_shards
        self._rejects = [((shard, m), record) for m, record in batch.reject] + self._rejects
        self._releases = [(shard, m) for m in batch.release] + self._releases
        self._dead = batch.dead + self._dead
        self._penalties = batch.penalize + self._penalties
        self._mark_pending()

    async def _round(self, lease: int, renew: bool) -> BaseException | None:
        """One exchange with every shard (concurrently); returns the first error, or None if every shard
        answered. A shard that failed has its batch put back; the others' answers are applied."""
        assert self.frontiers
        batches = self._take_batches(lease, renew)
        self._in_sync = True
        try:
            if self.shards == 1:
                results: list[Any] = []
                try:
                    results.append(await self.frontiers[0].sync(batches[0]))
                except Exception as exc:
                    results.append(exc)
            else:
                results = await asyncio.gather(
                    *(f.sync(b) for f, b in zip(self.frontiers, batches, strict=True)), return_exceptions=True
                )
        finally:
            self._in_sync = False
        error: BaseException | None = None
        got = 0
        for shard, (batch, result) in enumerate(zip(batches, results, strict=True)):
            if isinstance(result, BaseException):
                self._restore(shard, batch)
                error = error or result
            else:
                got += self._apply(shard, batch, result)
        self._sent_out = []
        if error is None:
            # everything sent before this round is in Redis now: the acks held back may go
            self._acks = self._acks + self._acks_waiting
            self._after_round(got, lease)
        else:
            self._acks_new = self._acks_waiting + self._acks_new
            self._last_snapshot = None
        self._acks_waiting = []
        if self._acks:
            self._mark_pending()
        return error

    def _after_round(self, got: int, lease: int) -> None:
        """Crawl-wide state after a round that reached every shard."""
        states = self._shard_state
        queued, inflight, delayed = (sum(st[i] for st in states if st is not None) for i in range(3))
        self.frontier_status = {"queued": queued, "inflight": inflight, "delayed": delayed}
        empty = not (queued or inflight or delayed)
        snapshot = tuple(states)
        if self.shards == 1:
            self._empty_confirmed = empty
        else:
            # the shards answer at slightly different moments: a request could move from one shard to
            # another between two answers. Empty twice with no entry created anywhere in between (the
            # sequence counters did not move) proves an instant when every shard was empty.
            self._empty_confirmed = empty and snapshot == self._last_snapshot
        self._last_snapshot = snapshot if empty else None
        if self._ready or not (queued or inflight):
            _engine.wake(self.crawler)
        self._lease_result = (got, lease, queued)

    async def _run(self) -> None:
        backoff = 0.5
        assert self._wakeup is not None and self.frontier is not None
        while not self._closing:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout=self.flush_interval)
            self._wakeup.clear()
            if self._closing:
                break
            self._collect_finished()
            now = time.monotonic()
            due, lease = self._sync_due(now)
            if not due:
                continue
            renew = now >= self._next_renew
            error = await self._round(lease, renew)
            if error is not None:
                if isinstance(error, _REDIS_DOWN):
                    self._outage(error)
                else:
                    logger.error("Frontier sync failed; retrying", exc_info=error)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            backoff = 0.5
            if self._outage_since is not None:
                logger.warning(
                    "Redis is reachable again after %.1fs; the crawl continues",
                    time.monotonic() - self._outage_since,
                )
                self._outage_since = None
            if renew:
                self._next_renew = now + self.lease_seconds / 3
            self._last_sync = now
            got, lease, queued = self._lease_result
            if lease and got < lease and queued == 0:
                self._next_fetch = now + self.idle_poll  # nothing to lease: poll gently
            else:
                self._next_fetch = now

    def _outage(self, exc: BaseException) -> None:
        # Redis may come back with acknowledged writes rolled back (failover, lost AOF tail): it may no
        # longer hold what this process sent, so stop trusting the per-process "already sent" set
        self._recent.clear()
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            logger.warning(
                "Redis is unreachable (%s: %s): not taking new requests, keeping %d discovered requests"
                " and %d leases in memory, retrying",
                type(exc).__name__, exc, len(self._out), len(self._held),
            )

    def _apply(self, shard: int, batch: SyncBatch, result: SyncResult) -> int:
        """Take in one shard's sync result: filtered/enqueued stats, leased requests, the shard's state."""
        stats = self.stats
        sent = self._sent_out[shard]
        enqueued = 0
        for (request, t1, _, _, payload, _, _, _), new in zip(sent, result.new, strict=True):
            if new:
                if payload:
                    enqueued += 1
                else:
                    self._local.append(request)  # unserializable but new: this worker crawls it
            elif t1 != "":
                self.df.log(request, self.spider)
        if enqueued:
            stats.inc_value("scheduler/enqueued/redis", enqueued)
            stats.inc_value("scheduler/enqueued", enqueued)
        for member in batch.ack:
            self._held.discard((shard, member))
        for member in batch.release:
            self._held.discard((shard, member))
        for member, _ in batch.reject:
            self._held.discard((shard, member))
        if result.requeued:
            stats.inc_value("scheduler/requeued/lease_expired", result.requeued)
        if result.moved:
            stats.inc_value("scheduler/delayed/moved", result.moved)
        frontier = self.frontiers[shard]
        assert self.spider is not None
        for member, score in result.leased:
            lease = (shard, member)
            self._held.add(lease)
            try:
                request = decode_request(
                    frontier.payload_of(member), self.spider, self.allowed_schemes, self.max_entry_bytes
                )
            except (RejectedEntry, ValueError) as exc:
                if not isinstance(exc, RejectedEntry):
                    exc = RejectedEntry("bad_member", "no domain prefix")
                self._reject(lease, exc)
                continue
            self._ready.push(score, request, lease)
        self._shard_state[shard] = (result.queued, result.inflight, result.delayed, result.seq)
        if shard == 0:  # the crawl-wide pause flag lives with shard 0
            was_paused = self.paused
            self.paused = result.paused
            if was_paused != self.paused:
                _engine.wake(self.crawler)
        return len(result.leased)

    def _reject(self, lease: Lease, exc: RejectedEntry) -> None:
        shard, member = lease
        self.stats.inc_value("scheduler/rejected")
        self.stats.inc_value(f"scheduler/rejected/{exc.reason}")
        self._rejects.append((lease, rejection_record(exc.reason, member, self.worker_id, exc.detail)))
        self._mark_pending()
        keys = self.shard_keys[shard]
        self._reject_log.log(
            logging.ERROR, "Rejected a queue entry of %r (%s); moved it to %s",
            keys.queue, exc, keys.queue_rejected,
        )

    def _unserializable(self, request: Request, exc: UnserializableRequest) -> None:
        self.stats.inc_value("scheduler/unserializable")
        if exc.key not in self._unserializable_logged:
            self._unserializable_logged.add(exc.key)
            logger.error(
                "Unable to put %(request)s in the shared frontier: %(reason)s. It is crawled by this worker"
                " only and is lost if it dies. Make %(key)s encodable (str, bytes, numbers, bools, None,"
                " lists, dicts) or pass a spider method name. Further requests failing on %(key)s are only"
                " counted in scheduler/unserializable.",
                {"request": request, "reason": exc, "key": exc.key},
            )

    # -- whole-crawl housekeeping -----------------------------------------------------------------
    def _shard_key_names(self, keys: CrawlKeys, df: Any) -> list[str]:
        """Every key of one shard (all of the crawl's frontier keys for shard 0), bloom blocks included."""
        names = keys.frontier_keys()
        plan = getattr(df, "plan", None)
        if plan is not None:
            n = max(getattr(df, "n", 0), plan.capacity)
            names += [keys.bloom_block(f, b) for f, b in plan.block_coords(n)]
        return names

    def _shard_layouts(self, shards: int) -> list[tuple[CrawlKeys, Any]]:
        """(keys, dupefilter) of every shard of a frontier of ``shards`` shards."""
        if shards == 1:
            return [(self.keys, self.df)]
        if shards == self.shards and len(self.shard_dfs) == shards:
            return list(zip(self.shard_keys, self.shard_dfs, strict=True))
        split = getattr(self.df, "for_shard", None)
        return [(k, split(k, shards) if split else self.df) for k in self.keys.shards(shards)]

    def _delete_crawl_keys(self, client: Any) -> None:
        """SCHEDULER_FLUSH_ON_START: every shard's keys, of this worker's N and of the N recorded for the
        crawl (a crawl restarted with another SCHEDULER_SHARDS leaves nothing behind)."""
        recorded = client.hget(self.keys.control, "shards")
        for shards in sorted({self.shards, int(recorded or 1)}):
            for keys, df in self._shard_layouts(shards):
                names = self._shard_key_names(keys, df)
                for i in range(0, len(names), 100):
                    client.delete(*names[i : i + 100])

    async def _finish_crawl(self) -> None:
        """SCHEDULER_PERSIST=False: the last worker to leave a finished crawl removes its keys.

        With shards, ``finish.lua`` can only see shard 0 (one slot): the other shards are first checked
        empty with :func:`~scrapy_dist.frontier.shards_idle`, and deleted once shard 0's keys have been."""
        from scrapy_dist import scripts

        if self.shards > 1 and not await shards_idle(self.redis, self.shard_keys):
            await self.redis.zrem(self.keys.workers, self.worker_id)
            return
        layouts = self._shard_layouts(self.shards)
        script = scripts.register(self.redis, "finish")
        keys = [self.keys.workers, self.keys.queue, self.keys.leases, self.keys.delayed]
        deleted = await script(
            keys=keys + [k for k in self._shard_key_names(*layouts[0]) if k not in keys],
            args=[self.worker_id, repr(time.time()), repr(self.lease_seconds)],
        )
        if deleted:
            for shard_keys, df in layouts[1:]:
                names = self._shard_key_names(shard_keys, df)
                for i in range(0, len(names), 100):
                    await self.redis.delete(*names[i : i + 100])
            logger.info("SCHEDULER_PERSIST is off and the crawl has finished: removed its frontier keys")

    def _filter_stats(self) -> dict[str, float]:
        """The dupefilter's figures for the stats, summed over the shards' filters."""
        if self.shards == 1 or len(self.shard_dfs) == 1:
            return dict(self.df.stats_snapshot()) if hasattr(self.df, "stats_snapshot") else {}
        plans = [getattr(df, "plan", None) for df in self.shard_dfs]
        if any(p is None for p in plans):
            return {}
        items = sum(df.n for df in self.shard_dfs)
        capacity = sum(p.capacity for p in plans if p is not None)
        return {
            "dupefilter/bloom/items": items,
            "dupefilter/bloom/fill_ratio": round(items / capacity, 6),
            # a URL is looked up in one shard's filter only: the worst shard bounds the rate
            "dupefilter/bloom/fpr_estimate": max(
                p.false_positive_rate(df.n) for p, df in zip(plans, self.shard_dfs, strict=True) if p
            ),
        }
