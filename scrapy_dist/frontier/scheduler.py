"""The shared frontier as a drop-in Scrapy scheduler: ``SCHEDULER = "scrapy_dist.scheduler.Scheduler"``, a
thin facade (none of Scrapy's calls touches Redis) over the ledger, the sync loop and the crawl layout."""

from __future__ import annotations

import functools
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from scrapy import signals
from scrapy.dupefilters import BaseDupeFilter
from scrapy.utils.defer import deferred_from_coro
from scrapy.utils.misc import build_from_crawler, load_object
from scrapy.utils.request import RequestFingerprinter

from scrapy_dist.dupefilter import RedisDupeFilter
from scrapy_dist.egress import checked_request, enforce
from scrapy_dist.exceptions import ScrapyDistError, UnserializableRequest
from scrapy_dist.frontier import engine as _engine
from scrapy_dist.frontier import orders as queue
from scrapy_dist.frontier.engine import Engine, EngineView, Revisits, install_feed_barrier
from scrapy_dist.frontier.layout import CrawlLayout, ShardRouter
from scrapy_dist.frontier.ledger import Ledger, RequestEncoder
from scrapy_dist.frontier.orders import DomainLimits, DomainPenalties
from scrapy_dist.frontier.shard import Frontier, RequestDecoder
from scrapy_dist.frontier.syncloop import SyncLoop
from scrapy_dist.redis import connection
from scrapy_dist.redis.keys import CrawlKeys, crawl_keys, crawler_keys
from scrapy_dist.redis.outage import Outage
from scrapy_dist.settings import DistSettings, SchedulerSettings
from scrapy_dist.settings.reader import refuse_start, start_error
from scrapy_dist.utils import RateLimitedLog
from scrapy_dist.wire.entrypolicy import DEAD, EntryPolicy, entry_policy

if TYPE_CHECKING:
    from scrapy import Request, Spider
    from scrapy.crawler import Crawler
    from scrapy.statscollectors import StatsCollector
    from twisted.internet.defer import Deferred
    from typing_extensions import Self

    from scrapy_dist.frontier.ledger import Applied
    from scrapy_dist.frontier.shard import SyncResult

logger = logging.getLogger(__name__)
S = TypeVar("S", bound="Scheduler")


def make_worker_id() -> str:
    """``host:pid:random`` -- unique per process, readable in ``scrapy-dist status``."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(2)}"


def get_scheduler(crawler: Crawler) -> Scheduler | None:
    sched = _engine.scheduler(crawler)
    return sched if isinstance(sched, Scheduler) else None


class Scheduler:
    """Scrapy scheduler backed by a Redis frontier shared by every worker of the crawl. Like Scrapy's own,
    it can be built from a dupefilter alone (keys from the spider's name at :meth:`open`)."""

    def __init__(
        self, dupefilter: Any, keys: CrawlKeys | None = None, redis_settings: Any = None, *,
        crawler: Crawler | None = None, config: SchedulerSettings | None = None, worker_id: str | None = None,
        order: queue.QueueOrder | None = None, stats: StatsCollector | None = None,
        engine: Engine | None = None, fingerprinter: Any = None, domain_limits: DomainLimits | None = None,
        outage: Outage | None = None, policy: EntryPolicy | None = None) -> None:
        self.config = cfg = config or SchedulerSettings(downloader_aware=False)
        #: what entries read from the queue must satisfy, and the secret signing what this worker writes
        self.policy = policy or EntryPolicy(cfg.allowed_schemes, cfg.max_entry_bytes)
        self.df, self.crawler = dupefilter, crawler
        self.redis_settings = DistSettings.coerce(redis_settings or {})
        self.order = order or queue.PriorityQueue()
        self.stats: Any = stats if stats is not None else NoStats()
        self.engine = engine or Engine()
        self.worker_id = worker_id or make_worker_id()
        polite = cfg.politeness == "cluster"
        self.router = ShardRouter(cfg.shards, fingerprinter, by_domain=polite)
        self.ledger = Ledger(cfg.shards, self.worker_id)
        self.outage = outage or Outage()
        self.redis: Any = None  # redis.asyncio client, created on the reactor's loop in open()
        self.frontiers: list[Frontier] = []
        self.loop: SyncLoop | None = None
        self._batched_df = isinstance(dupefilter, RedisDupeFilter)
        self.report = FrontierReport(self.stats)
        self.encoder = RequestEncoder(dupefilter, self.order, self.router, self.report, self.policy,
                                      domain_limits, batched=self._batched_df, polite=polite)
        self.report.log_duplicate = self.encoder.filtered
        self.penalties = DomainPenalties(domain_limits, self.ledger, self.router, self.stats)
        self._empty_since: float | None = None
        #: wired by from_crawler (``refused``: the crawl's start was refused, open nothing)
        self.components: list[Any] = []
        self.networks: list[Any] = []
        self.revisits: Revisits | None = None
        self.refused = False
        self.keys: CrawlKeys
        self.layout: CrawlLayout
        if keys is not None:
            self._place(keys)

    def _place(self, keys: CrawlKeys) -> None:
        self.keys = keys
        # what this worker signs is bound to the crawl: another crawl's entries do not verify here
        self.policy = self.encoder.policy = self.policy.bound(crawl=keys.shard(0, 1).tag)
        self.dead_policy = self.policy.bound(kind=DEAD)  #: signs dead letters (read back by dead --requeue)
        if self.revisits is not None:
            self.revisits.policy = self.policy
        self.layout = CrawlLayout(keys, self.df, self.config, limits=self.encoder.domain_limits)
        self.report.shard_keys = self.layout.shard_keys

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        """The scheduler of ``crawler``; if the crawl's start is (or gets) refused, one that opens nothing."""
        if start_error(crawler) is None:
            try:
                sched = _wired(cls, crawler)
            except ScrapyDistError as exc:
                refuse_start(crawler, exc)
            else:
                if start_error(crawler) is None:  # the dupefilter may have refused it
                    return sched
        sched = cls(BaseDupeFilter(), None, crawler=crawler)
        sched.refused = True
        return sched

    @property
    def idle_before_close(self) -> float:
        return self.config.idle_before_close

    @property
    def frontier_status(self) -> dict[str, int] | None:
        state = self.loop.state if self.loop is not None else None
        return state.as_dict() if state is not None else None

    @property
    def paused(self) -> bool:  # the crawl-wide pause flag (``scrapy-dist pause``)
        return self.loop is not None and self.loop.paused

    def open(self, spider: Spider) -> Deferred[None]:
        return deferred_from_coro(self.open_async(spider))

    async def open_async(self, spider: Spider, start: bool = True) -> None:
        """Join the crawl and start the loop (``start=False``: the caller drives ``loop.round()``)."""
        self.encoder.spider = spider
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
        if pending:
            logger.info("Resuming crawl (%d requests scheduled)", pending)
        elif remembered and cfg.persist:
            logger.warning(
                "The crawl %r has run before and finished: %d fingerprints are remembered, requests seen then"
                " are skipped (SCHEDULER_PERSIST=True). To start afresh: -s SCHEDULER_FLUSH_ON_START=True, or"
                " SCHEDULER_PERSIST=False to remove a finished crawl's keys.", self.keys.spider, remembered)
        if self._batched_df:  # the crawl's recorded TTL, which may not be this worker's setting
            self.encoder.recent.max_age = min(df.recent_max_age() for df in self.layout.shard_dfs)
        self.redis = self._client(sync=False)
        self.frontiers = self.layout.frontiers(self.redis, self.worker_id, self.order.sequence,
                                               self._batched_df)
        check = functools.partial(checked_request, networks=self.networks, stats=self.stats)
        self.loop = SyncLoop(self.ledger, self.router, self.frontiers, self.engine, cfg, outage=self.outage,
                             decode=RequestDecoder(spider, self.policy, cfg.politeness == "cluster", check),
                             on_applied=self.report.applied, on_forget=self.encoder.recent.clear)
        if self.crawler is not None:  # local feed files are on disk before their pages' acks
            self.report.feeds = install_feed_barrier(self.crawler, self.loop)
        self.loop.paused, self.loop.backlog = self.layout.paused, pending
        if not self._batched_df and type(self.df).__name__ != "BaseDupeFilter":
            logger.warning("DUPEFILTER_CLASS %s dedupes per worker only: for crawl-wide deduplication use"
                           " scrapy_dist.dupefilter.BloomDupeFilter", type(self.df).__name__)
        if start:
            self.loop.start()
        shards = f" ({cfg.shards} shards)" if cfg.shards > 1 else ""
        logger.info("scrapy-dist frontier %r open as worker %s%s", self.keys.queue, self.worker_id, shards)

    def _join(self, spider: Spider) -> tuple[int, int]:
        name = getattr(spider, "name", None)
        if not (named := isinstance(name, str) and bool(name)) and not hasattr(self, "keys"):
            raise ScrapyDistError(f"scrapy-dist: {type(spider).__name__} has no name: the crawl's Redis"
                                  " keys are built from it")
        if not hasattr(self, "keys") or (named and self.crawler is not None and name != self.keys.spider):
            self._place(crawl_keys(self.redis_settings, str(name)))  # the keys follow the spider's final name
            if self._batched_df:
                self.df.keys = self.keys
        if self.router.fingerprinter is None and self.crawler is not None:
            try:
                self.router.fingerprinter = self.crawler.request_fingerprinter
            except (AttributeError, RuntimeError):  # none yet: Scrapy's default one
                self.router.fingerprinter = RequestFingerprinter(self.crawler)
        client = self._client(sync=True)
        try:
            connection.check_reachable(client, self.redis_settings)
            return self.layout.open(client, self.config.flush_on_start, self._batched_df)
        finally:
            client.close()  # a no-op for the crawler's shared client

    def _client(self, sync: bool) -> Any:
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
        if (loop := self.loop) is not None:
            await loop.stop()
            loop.collect_finished(time.monotonic())
            self.ledger.release_all(time.monotonic())
            released = len(self.ledger.releases)
            await loop.drain(min(self.config.shutdown_grace, self.config.lease_seconds))
            self.report.refusals_done()
            if released or loop.released_at_close:
                given = released - len(self.ledger.releases) + loop.released_at_close
                self.stats.set_value("scheduler/released_at_close", given)
                logger.info("Closing (%s): gave %d leased requests back to the queue", reason, given)
        if not self.config.persist and reason == "finished" and self.redis is not None:
            await self.layout.finish(self.redis, self.worker_id)
        if hasattr(self.df, "close"):
            self.df.close(reason)
        if self._batched_df and hasattr(self, "layout"):  # opened
            for k, v in self.layout.filter_stats().items():
                self.stats.set_value(k, v)
        if self.redis is not None:
            await self.layout.leave_unmonitored(self.redis, self.worker_id)
            await self.redis.aclose()

    def has_pending_requests(self) -> bool:
        loop = self.loop
        if self.ledger.busy() or (loop is not None and loop.in_sync) or self.paused:
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
        if self.paused:
            return None
        ledger, loop = self.ledger, self.loop
        if not ledger.local and loop is not None and not loop.failing and ledger.outranked():
            loop.wake()  # a new request outranks every leased one: wait the round leasing it back
            return None
        local = bool(ledger.local)
        request = ledger.hand_out(self.engine.slot_load if self.config.downloader_aware else None)
        if request is None:
            self._wake()
        elif not local:
            self.encoder.handed_out(request, time.monotonic())
            self.stats.inc_value("scheduler/dequeued/redis")
            self.stats.inc_value("scheduler/dequeued")
            if len(ledger.ready) < self.config.prefetch // 2:
                self._wake()
        return request

    def __len__(self) -> int:
        ledger, st = self.ledger, self.frontier_status or {}
        return len(ledger.ready) + len(ledger.local) + len(ledger.out) + st.get("queued", 0)

    def delay_request(self, request: Request, not_before: float, reason: str = "") -> bool:
        """Put ``request`` in the delayed set until ``not_before`` (unix time), with the failed one's ack."""
        if (entry := self.encoder.delayed(request, not_before)) is not None:
            self.ledger.delay(entry, time.monotonic())
        return entry is not None

    def dead_letter(self, record: str, request: Request | None = None) -> None:
        """Append a JSON dead-letter record (atomic with the failed request's ack)."""
        forget = (self.encoder.forgotten(request, self.layout.shard_dfs)
                  if request is not None and self.encoder.forget_dead and self._batched_df else None)
        self.ledger.dead_letter(record, time.monotonic(), forget)

    def flushed_since(self, mark: float) -> bool:
        """Whether every request enqueued before ``mark`` (monotonic) is in Redis."""
        return self.loop is not None and min(self.loop.flushed_at) > mark

    def _wake(self) -> None:
        if self.loop is not None:
            self.loop.wake()

    def _starts_now(self, request: Request) -> bool:
        """Whether ``request`` is a start request Scrapy's engine would send at once (nothing queued, room)"""
        loop = self.loop
        if not request.meta.get("is_start_request") or loop is None or loop.paused:
            return False
        queued = loop.state.queued if loop.state is not None else loop.backlog
        return not queued and self.ledger.starts_now(self.config.concurrent_requests)


def _wired(cls: type[S], crawler: Crawler) -> S:
    ds = DistSettings.for_crawler(crawler)
    cfg = ds.scheduler
    dupefilter = build_from_crawler(load_object(crawler.settings["DUPEFILTER_CLASS"]), crawler)
    qcls: Any = queue.ALIASES.get(cfg.queue_class) or load_object(cfg.queue_class)
    try:
        keys: CrawlKeys | None = crawler_keys(crawler)
    except ValueError:  # no spider name yet (a harness that builds the scheduler first): at open()
        keys = None
    sched = cls(dupefilter, keys, ds, crawler=crawler, config=cfg, order=qcls(), stats=crawler.stats,
                engine=EngineView(crawler), outage=Outage.for_crawler(crawler), policy=entry_policy(crawler),
                domain_limits=DomainLimits.from_dist(ds) if cfg.politeness == "cluster" else None)
    sched.revisits = Revisits.from_crawler(crawler)
    sched.revisits.policy = sched.policy if keys is not None else None
    sched.ledger.riders.revisit_of = sched.revisits.plan
    sched.encoder.forget_dead = ds.dupefilter.forget_dead
    sched.networks = enforce(crawler, cfg.deny_networks)  # holds without the add-on too
    sched.encoder.record_start = sched._batched_df and ds.seeds.record_fingerprint
    if cfg.politeness == "cluster":
        crawler.signals.connect(sched.penalties.response_received, signal=signals.response_received)
    sched.components = _engine.run_components(crawler, ds)
    return sched


class NoStats:
    """Stats sink of a scheduler built without a stats collector."""

    def inc_value(self, key: str, count: int = 1, start: int = 0) -> None:
        pass

    def set_value(self, key: str, value: Any) -> None:
        pass


@dataclass(eq=False)
class FrontierReport:
    """Stats and log lines of one worker's frontier (``shard_keys``: every shard's keys, for messages)."""

    stats: Any
    log_duplicate: Any = None  # the dupefilter's log of a filtered request
    shard_keys: list[CrawlKeys] = field(default_factory=list)
    feeds: bool = False  # the crawl exports feeds: a refused ack's items are written there twice
    _refused: list[int] = field(default_factory=lambda: [0, 0])  # acks and items since one was accepted
    _log: RateLimitedLog = field(default_factory=lambda: RateLimitedLog(logger))
    _unserializable_log: RateLimitedLog = field(default_factory=lambda: RateLimitedLog.once(logger))

    def applied(self, applied: Applied, result: SyncResult) -> None:
        """Stats and logs of one shard's answer."""
        for request in applied.duplicates:
            self.log_duplicate(request)
        rejected, refused = result.rejected, result.acks_refused  # rejected: members the script parked
        for stat, n in (
            ("scheduler/enqueued/redis", applied.enqueued), ("scheduler/enqueued", applied.enqueued),
            ("scheduler/requeued/lease_expired", result.requeued), ("scheduler/delayed/moved", result.moved),
            ("scheduler/rejected", rejected), ("scheduler/rejected/bad_member", rejected - result.replayed),
            ("scheduler/rejected/replayed", result.replayed if rejected else 0),
            ("redis_items/written", result.items), ("scheduler/acks_refused", refused),
            ("redis_items/refused", result.items_refused if refused else 0),
            ("feeds/duplicate_pages", refused if self.feeds else 0)):
            if n > 0:
                self.stats.inc_value(stat, n)
        if refused:
            self._refused[0] += refused
            self._refused[1] += result.items_refused
        if applied.acked and not refused:  # a call whose every ack counted: the run of refusals is over
            self.refusals_done()
        for key in result.repaired:
            self._log.log(logging.WARNING, "Repaired garbage in %s (written by someone else?) before writing",
                          key, key=f"repaired:{key}")
        for (shard, _), exc in applied.rejected:
            self.stats.inc_value("scheduler/rejected")
            self.stats.inc_value(f"scheduler/rejected/{exc.reason}")
            keys = self.shard_keys[shard]
            self._log.log(logging.ERROR, "Rejected a queue entry of %r (%s); moved it to %s",
                          keys.queue, exc, keys.queue_rejected, key="rejected")

    def refusals_done(self) -> None:
        """One WARNING for a run of refused acks (until an ack is accepted again, or at close)."""
        acks, items = self._refused
        if not acks:
            return
        self._refused = [0, 0]
        logger.warning(
            "The frontier refused %d acknowledgements and their %d items: those leases were no longer this"
            " worker's (stopped or cut off past SCHEDULER_LEASE_SECONDS and taken over, or acknowledged"
            " already). Their items come from the other fetch, once; feeds may hold them twice", acks, items)

    def unserializable(self, request: Request, exc: UnserializableRequest) -> None:
        """A request that cannot go to Redis (crawled by this worker only): logged once per key."""
        self.stats.inc_value("scheduler/unserializable")
        self._unserializable_log.log(
            logging.ERROR, "Unable to put %(request)s in the shared frontier: %(reason)s. Only this worker"
            " crawls it (lost if the worker dies). Make %(key)s encodable (str, bytes, numbers, bools, None,"
            " lists, dicts) or a spider method name; later ones failing on %(key)s only count in the stat"
            " scheduler/unserializable", {"request": request, "reason": exc, "key": exc.key}, key=exc.key)
