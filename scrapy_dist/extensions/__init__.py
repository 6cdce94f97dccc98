"""Seeing and steering a running cluster: crawl-wide stats and worker heartbeats (:class:`ClusterStats`),
closing every worker together when the crawl runs out of work (:class:`IdleMonitor`), crawl-wide error
thresholds (:class:`ErrorMonitor`), and :class:`RedisStatsCollector` (``STATS_CLASS``). The add-on enables
all three extensions; ``EXTENSIONS = {"scrapy_dist.extensions.IdleMonitor": 500}`` enables one."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis
from scrapy.statscollectors import MemoryStatsCollector
from scrapy.utils.misc import load_object

from scrapy_dist.extensions.clusterstats import ClusterStats, PeriodicExtension
from scrapy_dist.extensions.errors import ErrorMonitor
from scrapy_dist.frontier import engine as _engine
from scrapy_dist.frontier.layout import ControlState, end_chains, report_problems
from scrapy_dist.frontier.scheduler import get_scheduler
from scrapy_dist.frontier.shard import shards_idle
from scrapy_dist.redis import connection
from scrapy_dist.redis.keys import crawler_keys
from scrapy_dist.redis.scripts import text

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

__all__ = ["ClusterStats", "ErrorMonitor", "IdleMonitor", "RedisStatsCollector"]

logger = logging.getLogger(__name__)

#: The extension that writes the crawl-wide stats (enabled by this collector if the project has not).
CLUSTER_STATS = "scrapy_dist.extensions.ClusterStats"


class RedisStatsCollector(MemoryStatsCollector):
    """Scrapy's in-memory stats for this worker; crawl-wide stats go to Redis through :class:`ClusterStats`
    (enabled unless ``EXTENSIONS`` disables it), not one write per increment (``STATS_KEY`` is not read)."""

    def __init__(self, crawler: Crawler) -> None:
        super().__init__(crawler)
        self.crawler = crawler
        enable_cluster_stats(crawler)

    def crawl_stats(self) -> dict[str, str]:
        """The crawl-wide merged stats (every worker's, as last flushed): one ``HGETALL``."""
        raw = connection.ClientPool.of(self.crawler).sync_client().hgetall(crawler_keys(self.crawler).stats)
        return {text(k): text(v) for k, v in raw.items()}


def enable_cluster_stats(crawler: Crawler) -> bool:
    """Add ClusterStats to the crawler's (not yet frozen) ``EXTENSIONS`` at the add-on's order unless there;
    one disabled with ``None`` stays so, with a WARNING. True if it will run."""
    settings = crawler.settings
    for path, order in settings.getwithbase("EXTENSIONS").items():
        try:
            cls = load_object(path) if isinstance(path, str) else path
        except (ImportError, NameError, ValueError):
            continue
        if cls is ClusterStats:
            if order is None:
                logger.warning("scrapy-dist: STATS_CLASS=RedisStatsCollector keeps no crawl-wide stats"
                               " because EXTENSIONS disables %s; enable it for them in Redis", CLUSTER_STATS)
            return order is not None
    if getattr(settings, "frozen", False):
        return False
    settings["EXTENSIONS"].set(CLUSTER_STATS, 500, priority="addon")
    return True


MAX_POLL = 1.0  #: Most seconds between two polls (fewer when SCHEDULER_IDLE_BEFORE_CLOSE is short).
FOREVER_POLL = 5.0  #: Seconds between polls of a crawl that never closes (SCHEDULER_IDLE_BEFORE_CLOSE = None)


@dataclass
class IdleClock:
    """How long the crawl has been observed without work (pure; time is a parameter)."""

    idle_before_close: float
    since: float | None = None

    def observe(self, busy: bool, now: float) -> bool:
        """Record one observation; True once there has been no work for ``idle_before_close`` seconds."""
        if busy:
            self.since = None
            return False
        if self.since is None:
            self.since = now
        return now - self.since >= self.idle_before_close


class IdleMonitor(PeriodicExtension):
    """Scrapy extension: one crawl-wide ``finished`` decision, every worker closing on it (docs/monitoring.md,
    "Closing together"): once the frontier and seeds had no work for ``SCHEDULER_IDLE_BEFORE_CLOSE`` s, and
    this worker holds none, ``idle.lua`` re-checks atomically (0: it only relays close decisions)."""

    script, what = "idle", "idle monitor"

    def __init__(self, crawler: Crawler) -> None:
        super().__init__(crawler)
        idle = self.settings.scheduler.idle_before_close
        self.shard_keys = self.keys.shards(self.settings.scheduler.shards)  # all workers agree on it
        self.clock = IdleClock(idle)
        self.interval = (FOREVER_POLL if math.isinf(idle)  # never closes on its own: only relays flags
                         else min(MAX_POLL, max(0.2, idle / 4)) if idle > 0 else MAX_POLL)
        self._ends_chains = False  # closed by ``scrapy-dist close``
        #: server time at the last poll, from the server time at start (a cluster pipeline cannot send TIME)
        self.server_now: float | None = None

    async def closed(self, reason: str) -> None:
        """After this worker's last sync: remove the revisits filed since ``scrapy-dist close``."""
        if not self._ends_chains:
            return
        polite = self.settings.scheduler.politeness == "cluster"
        client = connection.ClientPool.of(self.crawler).sync_client()
        try:
            ended = await asyncio.to_thread(end_chains, client, self.shard_keys, polite)
        except redis.RedisError as exc:
            logger.warning("Could not end the crawl's revisit chains at close: %s", exc)
            return
        if ended:
            logger.info("The crawl was closed: %d scheduled revisits filed since removed", ended)

    async def read(self) -> tuple[int, ControlState]:
        """Work left crawl-wide (queued, leased, delayed, seeds) and the control flags: one round trip."""
        k = self.keys
        pipe = self.redis.pipeline(transaction=False)
        for shard in self.shard_keys:
            pipe.zcard(shard.queue).zcard(shard.leases).zcard(shard.delayed)
        {"zset": pipe.zcard, "set": pipe.scard}.get(self.settings.seeds.kind, pipe.llen)(k.start_urls)
        pipe.llen(k.start_urls_processing).hgetall(k.control)
        *counts, control = await pipe.execute(raise_on_error=False)
        if isinstance(control, Exception):
            raise control
        if self._opened_mono is not None:  # bounds how far in the future a close decision may lie
            self.server_now = self.started_at + (time.monotonic() - self._opened_mono)
        state = ControlState.from_hash(control)
        report_problems(k.control, state)
        # a seeds key of another type than configured (WRONGTYPE) holds nothing the spider can take
        return sum(int(c) for c in counts if not isinstance(c, Exception)), state

    def locally_idle(self) -> bool:
        """This worker has no request of its own in progress."""
        sched = get_scheduler(self.crawler)
        return not _engine.inprogress(self.crawler) and (sched is None or not sched.ledger.local)

    async def check(self, now: float | None = None) -> str:
        """One poll: the reason this worker is closing for, or ``""``."""
        if self._close_task is not None or _engine.is_closing(self.crawler):
            return ""
        work, control = await self.read()
        reason = control.close_reason(self.started_at, self.server_now)
        # only a worker whose requests go through the shared frontier may call the crawl finished
        judges = _engine.engine_of(self.crawler) is None or get_scheduler(self.crawler) is not None
        if reason:  # stop filing revisits
            if (revisits := getattr(_engine.scheduler(self.crawler), "revisits", None)) is not None:
                revisits.stop()
            self._ends_chains = revisits is not None
        elif self.clock.idle_before_close > 0 and judges:
            now = time.monotonic() if now is None else now
            # a paused crawl is waiting for `scrapy-dist resume`, not finished
            if self.clock.observe(work > 0 or control.paused, now) and self.locally_idle():
                reason = await self._decide()
        if reason and not _engine.is_closing(self.crawler) and self.close_spider(reason):
            logger.info("Closing: the crawl was closed crawl-wide (reason %s)", reason)
        return reason

    tick = check

    async def _decide(self) -> str:
        """Ask ``idle.lua`` to call the crawl finished; returns the close reason (now or before) or ``""``."""
        if len(self.shard_keys) > 1 and not await shards_idle(self.redis, self.shard_keys):
            self.clock.since = None  # a request was moving between shards
            return ""
        k = self.keys
        decided, reason, _ = await self._script(keys=[k.queue, k.leases, k.delayed, k.control, k.workers],
                                                args=["finished", repr(self.started_at)])
        if decided:
            logger.info("The crawl has had no work for %.1fs: every worker closes (reason finished)",
                        self.clock.idle_before_close)
        elif not reason:
            self.clock.since = None  # work appeared between the poll and the decision
        return text(reason)
