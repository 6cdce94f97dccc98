"""The shared frontier as a drop-in Scrapy scheduler: ``SCHEDULER = "scrapy_dist.scheduler.Scheduler"``.

Scrapy calls ``enqueue_request``, ``next_request`` and ``has_pending_requests`` on the reactor thread many
times per page, and none of them touches Redis: :class:`Scheduler` is a thin facade (docs/architecture.md)
over the :class:`RequestEncoder` (what a request becomes in the ledger), the
:class:`~scrapy_dist.frontier.ledger.Ledger`, the :class:`~scrapy_dist.frontier.syncloop.SyncLoop`, the
:class:`~scrapy_dist.frontier.layout.ShardRouter` and the :class:`~scrapy_dist.frontier.layout.CrawlLayout`.
A leased request is acknowledged only once the engine has finished it, in the same atomic call as the
requests its callback produced, so a worker killed at any moment loses nothing.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from scrapy.utils.defer import deferred_from_coro
from scrapy.utils.httpobj import urlparse_cached

from scrapy_dist.dupefilter import RecentFingerprints, RedisDupeFilter
from scrapy_dist.egress import checked_request
from scrapy_dist.exceptions import ScrapyDistError, UnserializableRequest
from scrapy_dist.frontier import engine as _engine
from scrapy_dist.frontier import orders as queue
from scrapy_dist.frontier.control import FrontierReport, NoStats
from scrapy_dist.frontier.engine import FeedBarrier
from scrapy_dist.frontier.layout import CrawlLayout, ShardRouter, crawl_fingerprinter
from scrapy_dist.frontier.ledger import Delay, Ledger, Outgoing
from scrapy_dist.frontier.orders import START_NOW, DomainLimits, DomainPenalties
from scrapy_dist.frontier.revisit import Revisits
from scrapy_dist.frontier.shard import Frontier, RequestDecoder
from scrapy_dist.frontier.syncloop import SyncLoop
from scrapy_dist.redis import connection
from scrapy_dist.redis.keys import CrawlKeys, crawl_keys
from scrapy_dist.redis.outage import Outage
from scrapy_dist.settings import DistSettings, SchedulerSettings
from scrapy_dist.settings.reader import refuse_start, start_error
from scrapy_dist.wire.codec import EntryPolicy, encode_request
from scrapy_dist.wire.entrypolicy import DEAD

if TYPE_CHECKING:
    from scrapy import Request, Spider
    from scrapy.crawler import Crawler
    from scrapy.statscollectors import StatsCollector
    from twisted.internet.defer import Deferred
    from typing_extensions import Self

    from scrapy_dist.frontier.engine import Engine

logger = logging.getLogger(__name__)


def make_worker_id() -> str:
    """``host:pid:random`` -- unique per process, readable in ``scrapy-dist status``."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(2)}"


def get_scheduler(crawler: Crawler) -> Scheduler | None:
    """The running scrapy-dist scheduler of ``crawler``, if it uses one."""
    sched = _engine.scheduler(crawler)
    return sched if isinstance(sched, Scheduler) else None


class RequestEncoder:
    """What a request becomes in the ledger: filtered (Scrapy's dupefilter, or the fingerprints this
    process sent lately), encoded under the crawl's entry policy, scored by the queue order and routed to
    its shard -- with crawl-wide politeness, with its domain and that domain's limits. No I/O."""

    def __init__(
        self, dupefilter: Any, order: queue.QueueOrder, router: ShardRouter, report: FrontierReport,
        policy: EntryPolicy, domain_limits: DomainLimits | None = None, *, batched: bool = False,
        polite: bool = False,
    ) -> None:
        self.df = dupefilter
        self.order = order
        self.router = router
        self.report = report
        self.policy = policy
        self.domain_limits = domain_limits
        #: the dupefilter is a scrapy-dist one: fingerprints are checked crawl-wide, in the sync call
        self.batched = batched
        self.polite = polite
        self.spider: Spider | None = None
        #: fingerprints this process sent lately (certainly seen crawl-wide; bounded in time)
        self.recent = RecentFingerprints()
        #: SEEDS_RECORD_FINGERPRINT: a dont_filter start request records its fingerprint; off, it neither
        #: consults nor records the filter, as in Scrapy
        self.record_start = False
        #: DEADLETTER_FORGET: a dead letter's fingerprint is forgotten with it
        self.forget_dead = False

    def warn_local_filter(self) -> None:
        """One WARNING when the dupefilter is Scrapy's own kind: it filters per worker only."""
        if not self.batched and type(self.df).__name__ != "BaseDupeFilter":
            logger.warning(
                "DUPEFILTER_CLASS %s is not a scrapy-dist dupefilter: duplicates are filtered per worker"
                " only. Use scrapy_dist.dupefilter.BloomDupeFilter for crawl-wide deduplication.",
                type(self.df).__name__,
            )

    def forgotten(self, request: Request, shard_dfs: list[Any]) -> tuple[int, tuple[Any, Any]]:
        """``DEADLETTER_FORGET``: the shard and fingerprint tokens of ``request`` to forget."""
        shard = self.router.shard(request)
        tokens = shard_dfs[shard].tokens(request)
        self.recent.discard(tokens[0])  # a link to it found by this worker is new again too
        return shard, tokens

    def filtered(self, request: Request) -> None:
        """Log ``request`` as a duplicate (the dupefilter's own line)."""
        self.df.log(request, self.spider)

    def encode(self, request: Request) -> bytes | None:
        """The encoded request, or None (counted and logged) when it cannot go to Redis."""
        try:
            return encode_request(request, self.spider, self.policy)
        except UnserializableRequest as exc:
            self.report.unserializable(request, exc)
            return None

    def outgoing(self, request: Request, now: float, starts_now: Callable[[Request], bool]) -> list[Outgoing]:
        """The ledger entries of a discovered request; ``[]`` when it is filtered here. ``starts_now``:
        whether the engine would send it at once (scored :data:`~scrapy_dist.frontier.orders.START_NOW`)."""
        if not self.batched and not request.dont_filter and self.df.request_seen(request):
            self.filtered(request)
            return []
        payload = self.encode(request) or b""  # b"": deduped only, then crawled by this worker
        t1: Any = ""
        t2: Any = ""
        fp: bytes | None = None
        if self.batched and not request.dont_filter:
            fp = self.df.fingerprint(request)
            t1, t2 = self.df.fingerprint_tokens(fp)
            if self.recent.seen(t1, now):  # this process sent it lately: seen crawl-wide
                self.filtered(request)
                return []
        domain, limits = self.domain(request)
        score = self.order.score(request)
        # with crawl-wide politeness a domain's requests are ordered by its own schedule, not Scrapy's
        if not self.polite and starts_now(request):
            score = START_NOW
        entries = []
        if self.record_start and request.dont_filter and request.meta.get("is_start_request"):
            # a dedupe-only entry travels with the start request: a page linking back to it is not
            # fetched once more
            fp = self.df.fingerprint(request)
            r1, r2 = self.df.fingerprint_tokens(fp)
            self.recent.add(r1, now)
            shard = self.router.shard(request, fp)
            entries.append(Outgoing(request, r1, r2, score, b"", shard=shard, record_only=True))
        shard = self.router.shard(request, fp)
        entries.append(Outgoing(request, t1, t2, score, payload, domain=domain, limits=limits, shard=shard))
        return entries

    def delayed(self, request: Request, not_before: float) -> Delay | None:
        """The delayed-set entry of ``request`` (None when it cannot be encoded)."""
        payload = self.encode(request)
        if payload is None:
            return None
        domain, limits = self.domain(request)
        return Delay(self.order.score(request), payload, not_before, domain=domain, limits=limits,
                     shard=self.router.shard(request))

    def domain(self, request: Request) -> tuple[str, str]:
        """With crawl-wide politeness, the request's domain and its encoded limits; else ``("", "")``."""
        if not self.polite or self.domain_limits is None:
            return "", ""
        domain = (urlparse_cached(request).hostname or "").lower()
        return domain, self.domain_limits.for_domain(domain).encode()


class Scheduler:
    """Scrapy scheduler backed by a Redis frontier shared by every worker of the crawl.

    ``__init__`` takes plain objects (:meth:`from_crawler` wires them from a crawler); as Scrapy's own
    scheduler, it can be built from a dupefilter alone: the keys then come from the spider's name at
    :meth:`open`, and Redis from ``$REDIS_URL`` or the embedded default. Besides Scrapy's interface it
    offers other components delays, dead letters, pauses and politeness penalties.
    """

    def __init__(
        self,
        dupefilter: Any,
        keys: CrawlKeys | None = None,
        redis_settings: Any = None,
        *,
        crawler: Crawler | None = None,
        config: SchedulerSettings | None = None,
        order: queue.QueueOrder | None = None,
        stats: StatsCollector | None = None,
        engine: Engine | None = None,
        fingerprinter: Any = None,
        domain_limits: DomainLimits | None = None,
        worker_id: str | None = None,
        outage: Outage | None = None,
        policy: EntryPolicy | None = None,
    ) -> None:
        self.config = cfg = config or SchedulerSettings(downloader_aware=False)
        #: what entries read from the queue must satisfy, and the secret signing what this worker writes
        self.policy = policy or EntryPolicy(cfg.allowed_schemes, cfg.max_entry_bytes)
        self.df = dupefilter
        self.crawler = crawler
        rs = redis_settings
        self.redis_settings = rs if isinstance(rs, DistSettings) else DistSettings.from_settings(rs or {})
        self.order = order or queue.PriorityQueue()
        self.stats: Any = stats if stats is not None else NoStats()
        self.engine: Engine = engine or _engine.DetachedEngine()
        self.worker_id = worker_id or make_worker_id()
        polite = cfg.politeness == "cluster"
        self.router = ShardRouter(cfg.shards, fingerprinter, by_domain=polite)
        self.ledger = Ledger(cfg.shards, self.worker_id)
        self.outage = outage or Outage()
        self.redis: Any = None  # redis.asyncio client, created on the reactor's loop in open()
        self.frontiers: list[Frontier] = []
        self.loop: SyncLoop | None = None
        self._batched_df = isinstance(dupefilter, RedisDupeFilter)
        self.report = FrontierReport(self.stats, [], None)
        self.encoder = RequestEncoder(dupefilter, self.order, self.router, self.report, self.policy,
                                      domain_limits, batched=self._batched_df, polite=polite)
        self.report.log_duplicate = self.encoder.filtered
        self.penalties = DomainPenalties(domain_limits, self.ledger, self.router, self.stats)
        self._recent = self.encoder.recent
        self._local_pause = False
        self._empty_since: float | None = None
        #: wired by from_crawler (``refused``: the crawl's start was refused, open nothing)
        self.components: list[Any] = []
        self.refused = False
        self.revisits: Revisits | None = None
        self.networks: list[Any] = []
        self.keys: CrawlKeys
        self.layout: CrawlLayout
        if keys is not None:
            self._place(keys)

    def _place(self, keys: CrawlKeys) -> None:
        """Use the crawl ``keys`` (at construction, or at :meth:`open` from the spider's name)."""
        self.keys = keys
        # what this worker signs is bound to the crawl: another crawl's entries do not verify here
        self.policy = self.encoder.policy = self.policy.bound(crawl=keys.shard(0, 1).tag)
        #: the policy dead letters are signed with (only ``scrapy-dist dead --requeue`` reads them back)
        self.dead_policy = self.policy.bound(kind=DEAD)
        if self.revisits is not None:
            self.revisits.policy = self.policy
        self.layout = CrawlLayout(keys, self.df, self.config.shards, self.config.politeness,
                                  self.config.lease_seconds)
        self.report.shard_keys = self.layout.shard_keys

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        """The scheduler of ``crawler``, wired by :func:`scrapy_dist.frontier.engine.build`."""
        return _engine.build(cls, crawler)

    # -- what other components read ----------------------------------------------------------------
    @property
    def spider(self) -> Spider | None:
        return self.encoder.spider

    @spider.setter
    def spider(self, spider: Spider | None) -> None:
        self.encoder.spider = spider

    @property
    def shards(self) -> int:
        return self.config.shards

    @property
    def idle_before_close(self) -> float:
        return self.config.idle_before_close

    @property
    def lease_seconds(self) -> float:
        return self.config.lease_seconds

    @property
    def frontier(self) -> Frontier | None:
        """Shard 0's frontier (the only one with one shard)."""
        return self.frontiers[0] if self.frontiers else None

    @property
    def frontier_status(self) -> dict[str, int] | None:
        """Last crawl-wide state reported by Redis: queued / inflight / delayed, or None before the first."""
        state = self.loop.state if self.loop is not None else None
        return state.as_dict() if state is not None else None

    @property
    def paused(self) -> bool:
        """The crawl-wide pause flag (``scrapy-dist pause``)."""
        return self.loop is not None and self.loop.paused

    # -- lifecycle ---------------------------------------------------------------------------------
    def open(self, spider: Spider) -> Deferred[None]:
        return deferred_from_coro(self.open_async(spider))

    async def open_async(self, spider: Spider, start: bool = True) -> None:
        """Join the crawl and start the loop (``start=False``: the caller drives ``loop.round()``)."""
        self.spider = spider
        if self.refused or (self.crawler is not None and start_error(self.crawler) is not None):
            self.refused = True
            return
        try:
            pending, remembered = self._join(spider)
        except ScrapyDistError as exc:
            if self.crawler is None:
                raise
            refuse_start(self.crawler, exc)  # one line, and the crawl stops as it opens
            self.refused = True
            return
        cfg = self.config
        self.report.backlog(self.keys.spider, pending, remembered, cfg.persist)
        if self._batched_df:  # the crawl's recorded TTL, which may not be this worker's setting
            self._recent.max_age = min(df.recent_max_age() for df in self.layout.shard_dfs)
        self.redis = self._client(sync=False)
        self.frontiers = self.layout.frontiers(
            self.redis, self.worker_id, cfg, self.order.sequence, batched=self._batched_df,
            limits_bound=self.encoder.domain_limits.bound() if self.encoder.domain_limits else "",
        )
        self.loop = SyncLoop(
            self.ledger, self.router, self.frontiers, self.engine,
            decode=RequestDecoder(
                self.spider, self.policy, cfg.politeness == "cluster",
                check=functools.partial(checked_request, networks=self.networks, stats=self.stats),
            ),
            on_applied=self.report.applied, prefetch=cfg.prefetch,
            flush_interval=cfg.flush_interval, flush_batch=cfg.flush_batch, idle_poll=cfg.idle_poll,
            lease_seconds=cfg.lease_seconds, outage=self.outage, on_outage=self._recent.clear,
            on_forget=self._recent.clear,
            idle_poll_max=cfg.idle_poll_max if math.isinf(cfg.idle_before_close) else cfg.idle_poll,
        )
        if self.crawler is not None:  # local feed files are on disk before their pages' acks
            self.report.feeds = FeedBarrier.install(self.crawler, self.loop) is not None
        self.loop.paused, self.loop.backlog = self.layout.paused, pending
        self.encoder.warn_local_filter()
        if start:
            self.loop.start()
        shards = f" ({cfg.shards} shards)" if cfg.shards > 1 else ""
        logger.info("scrapy-dist frontier %r open as worker %s%s", self.keys.queue, self.worker_id, shards)

    def _join(self, spider: Spider) -> tuple[int, int]:
        """Find the crawl's keys, check Redis answers and join the crawl; raises :class:`ScrapyDistError`."""
        settings = self.redis_settings
        name = getattr(spider, "name", None)
        named = isinstance(name, str) and bool(name)
        if not named and not hasattr(self, "keys"):
            raise ScrapyDistError(f"scrapy-dist: {type(spider).__name__} has no name: the crawl's Redis"
                                  " keys are built from it")
        if not hasattr(self, "keys") or (named and self.crawler is not None and name != self.keys.spider):
            self._place(crawl_keys(settings, str(name)))  # the keys follow the spider's final name
            if self._batched_df:
                self.df.keys = self.keys
        if self.router.fingerprinter is None and self.crawler is not None:
            self.router.fingerprinter = crawl_fingerprinter(self.crawler)
        client = self._client(sync=True)
        try:
            connection.check_reachable(client, settings)
            flush = self.config.flush_on_start
            return self.layout.open(client, flush_on_start=flush, batched=self._batched_df)
        finally:
            client.close()  # a no-op for the crawler's shared client

    def _client(self, sync: bool) -> Any:
        """The crawler's shared client (:class:`ClientPool`); without a crawler, one of its own."""
        if self.crawler is not None:
            pool = connection.ClientPool.of(self.crawler)
            return pool.sync_client() if sync else pool.async_client()
        return (connection.get_redis if sync else connection.get_async_redis)(self.redis_settings)

    def close(self, reason: str) -> Deferred[None]:
        return deferred_from_coro(self.close_async(reason))

    async def close_async(self, reason: str) -> None:
        """Stop the loop, give back what was not started, send what is owed, leave the crawl."""
        if self.refused:
            return
        loop = self.loop
        if loop is not None:
            await loop.stop()
            loop.collect_finished(time.monotonic())
            self.ledger.release_all(time.monotonic())
            released = len(self.ledger.releases)
            await loop.drain(min(self.config.shutdown_grace, self.config.lease_seconds))
            self.report.refusals_done()
            if released or loop.released_at_close:
                self.report.released(reason, released - len(self.ledger.releases) + loop.released_at_close)
        if not self.config.persist and reason == "finished" and self.redis is not None:
            await self.layout.finish(self.redis, self.worker_id, self.config.lease_seconds)
        if hasattr(self.df, "close"):
            self.df.close(reason)
        if self._batched_df and hasattr(self, "layout"):  # opened
            for k, v in self.layout.filter_stats().items():
                self.stats.set_value(k, v)
        if self.redis is not None:
            await self.layout.leave_unmonitored(self.redis, self.worker_id)
            await self.redis.aclose()

    # -- Scrapy's scheduler interface (reactor thread, no I/O) ---------------------------------------
    def has_pending_requests(self) -> bool:
        loop = self.loop
        if self.ledger.busy() or (loop is not None and loop.in_sync) or self.paused or self._local_pause:
            return True
        state = loop.state if loop is not None else None
        if state is None or state.queued or state.inflight or state.delayed or not state.empty_confirmed:
            self._empty_since = None
            return True
        now = time.monotonic()
        if self._empty_since is None:
            self._empty_since = now
        return now - self._empty_since < self.config.idle_before_close

    def enqueue_request(self, request: Request) -> bool:
        now = time.monotonic()
        entries = self.encoder.outgoing(request, now, self._starts_now)
        for entry in entries:
            self.ledger.add(entry, now)
        if len(self.ledger.out) >= self.config.flush_batch:
            self._wake()
        return bool(entries)

    def next_request(self) -> Request | None:
        if self.paused or self._local_pause:
            return None
        ledger, loop = self.ledger, self.loop
        if not ledger.local and loop is not None and not loop.failing and ledger.outranked():
            # a request just discovered outranks every leased one: wait the round that leases it back
            loop.wake()
            return None
        local = bool(ledger.local)
        request = ledger.hand_out(self.engine.slot_load if self.config.downloader_aware else None)
        if request is None:
            self._wake()
            return None
        if not local:
            self.stats.inc_value("scheduler/dequeued/redis")
            self.stats.inc_value("scheduler/dequeued")
            if len(ledger.ready) < self.config.prefetch // 2:
                self._wake()
        return request

    def __len__(self) -> int:
        ledger, st = self.ledger, self.frontier_status or {}
        return len(ledger.ready) + len(ledger.local) + len(ledger.out) + st.get("queued", 0)

    # -- services for other scrapy-dist components -----------------------------------------------------
    def delay_request(self, request: Request, not_before: float, reason: str = "") -> bool:
        """Put ``request`` in the crawl's delayed set until ``not_before`` (unix time), batched: written
        atomically with the ack of the request that failed; any worker takes it then."""
        entry = self.encoder.delayed(request, not_before)
        if entry is not None:
            self.ledger.delay(entry, time.monotonic())
        return entry is not None

    def dead_letter(self, record: str, request: Request | None = None) -> None:
        """Append a JSON dead-letter record (batched, atomic with the failed request's ack)."""
        forget = None
        if request is not None and self.encoder.forget_dead and self._batched_df:
            forget = self.encoder.forgotten(request, self.layout.shard_dfs)
        self.ledger.dead_letter(record, time.monotonic(), forget)

    def flushed_since(self, mark: float) -> bool:
        """Whether every request enqueued before ``mark`` (``time.monotonic()``) is in Redis."""
        return self.loop is not None and self.loop.drained_at > mark

    def pause(self) -> None:
        """Stop handing out requests from this worker (crawl-wide pause is the ``paused`` control flag)."""
        self._local_pause = True
        if self.loop is not None:
            self.loop.local_pause = True

    def resume(self) -> None:
        self._local_pause = False
        if self.loop is not None:
            self.loop.local_pause = False
        self.engine.wake()

    def penalize_domain(self, domain: str, seconds: float) -> None:
        """Crawl-wide politeness: no request of ``domain`` is leased for ``seconds`` (batched)."""
        self.penalties.penalize(domain, seconds)

    def _wake(self) -> None:
        if self.loop is not None:
            self.loop.wake()

    def _starts_now(self, request: Request) -> bool:
        return queue.sends_now(request, self.ledger, self.loop, self.config.concurrent_requests)
