"""Closing every worker together once the crawl has run out of work (docs/monitoring.md, "Closing
together").

:class:`IdleMonitor` makes it one decision for the crawl: every worker polls the frontier's counts, the
waiting seeds and the control flags; once all have been zero for ``SCHEDULER_IDLE_BEFORE_CLOSE`` seconds
and this worker holds no request, ``idle.lua`` re-checks the frontier atomically and sets ``close =
finished``, which every worker started before it obeys. With ``SCHEDULER_IDLE_BEFORE_CLOSE = 0`` it only
relays close decisions. With shards, :func:`~scrapy_dist.frontier.shard.shards_idle` first proves every
shard was empty at one moment (a double collect), then ``idle.lua`` runs on shard 0.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING, Any

import redis
from scrapy import signals

from scrapy_dist.extensions.clusterstats import engine_of, scheduler_of
from scrapy_dist.extensions.periodic import PeriodicTask
from scrapy_dist.frontier import engine as _engine
from scrapy_dist.frontier.layout import ControlState, end_chains, report_problems, start_time
from scrapy_dist.frontier.shard import shards_idle
from scrapy_dist.redis import connection, scripts
from scrapy_dist.redis.keys import CrawlKeys, crawler_keys
from scrapy_dist.redis.outage import Outage
from scrapy_dist.settings import DistSettings, defaults
from scrapy_dist.settings.reader import refusing, start_error

if TYPE_CHECKING:
    from scrapy import Spider
    from scrapy.crawler import Crawler
    from typing_extensions import Self

logger = logging.getLogger(__name__)

#: Most seconds between two polls (fewer when SCHEDULER_IDLE_BEFORE_CLOSE is short).
MAX_POLL = 1.0
#: Seconds between two polls of a crawl that never closes (SCHEDULER_IDLE_BEFORE_CLOSE = None)
FOREVER_POLL = 5.0


class IdleClock:
    """How long the crawl has been observed without work (pure; time is a parameter)."""

    def __init__(self, idle_before_close: float) -> None:
        self.idle_before_close = idle_before_close
        self.since: float | None = None

    def observe(self, busy: bool, now: float) -> bool:
        """Record one observation; True once there has been no work for ``idle_before_close`` seconds."""
        if busy:
            self.since = None
            return False
        if self.since is None:
            self.since = now
        return now - self.since >= self.idle_before_close


class IdleMonitor:
    """Scrapy extension: one crawl-wide ``finished`` decision, every worker closing on it (see above).

    Settings: ``SCHEDULER_IDLE_BEFORE_CLOSE`` (or scrapy-redis' ``MAX_IDLE_TIME_BEFORE_CLOSE``),
    ``REDIS_START_URLS_AS_SET`` / ``REDIS_START_URLS_AS_ZSET`` (how to count waiting seeds).
    """

    def __init__(
        self,
        crawler: Crawler,
        keys: CrawlKeys,
        idle_before_close: float = defaults.SCHEDULER_IDLE_BEFORE_CLOSE,
        seeds_type: str = "list",
        poll: float | None = None,
        shards: int = 1,
    ) -> None:
        self.crawler = crawler
        self.keys = keys
        #: every shard's keys (``SCHEDULER_SHARDS``; all workers of a crawl agree, the scheduler checks)
        self.shard_keys = keys.shards(shards)
        self.clock = IdleClock(idle_before_close)
        self.seeds_type = seeds_type
        if poll is None:
            poll = min(MAX_POLL, max(0.2, idle_before_close / 4)) if idle_before_close > 0 else MAX_POLL
            if math.isinf(idle_before_close):  # never closes on its own: only relays close/pause flags
                poll = FOREVER_POLL
        self.poll = poll
        self.redis: Any = None
        self.started_at = 0.0
        self._script: Any = None
        self._task: PeriodicTask | None = None
        self._close_task: asyncio.Task[None] | None = None
        #: closed by ``scrapy-dist close``: the revisit chains end (see spider_closed)
        self._ends_chains = False

    @classmethod
    @refusing
    def from_crawler(cls, crawler: Crawler) -> Self:
        ds = DistSettings.for_crawler(crawler)
        o = cls(
            crawler,
            crawler_keys(crawler),
            ds.scheduler.idle_before_close,
            ds.seeds.kind,
            shards=ds.scheduler.shards,
        )
        crawler.signals.connect(o.spider_opened, signal=signals.spider_opened)
        crawler.signals.connect(o.spider_closed, signal=signals.spider_closed)
        return o

    async def spider_opened(self, spider: Spider) -> None:
        if start_error(self.crawler) is not None:  # the crawl stops as it opens
            return
        self.redis = connection.ClientPool.of(self.crawler).async_client()
        self._script = scripts.register(self.redis, "idle")
        self.started_at = await start_time(self.redis)
        self._opened_mono = time.monotonic()
        self._task = PeriodicTask(
            self.check, self.poll, "idle monitor", logger, Outage.for_crawler(self.crawler)
        ).start()

    async def spider_closed(self, spider: Spider, reason: str) -> None:
        if self._task is not None:
            await self._task.stop()
        if self._ends_chains:
            await self._end_chains()
        if self.redis is not None:
            await self.redis.aclose()

    async def _end_chains(self) -> None:
        """After this worker's last sync: remove the revisits filed crawl-wide between the close decision
        and the moment the workers saw it (``scrapy-dist close`` removed the ones before)."""
        ds = DistSettings.for_crawler(self.crawler)
        client = connection.ClientPool.of(self.crawler).sync_client()
        try:
            ended = await asyncio.to_thread(
                end_chains, client, self.shard_keys, ds.scheduler.politeness == "cluster"
            )
        except redis.RedisError as exc:
            logger.warning("Could not end the crawl's revisit chains at close: %s", exc)
            return
        if ended:
            logger.info("The crawl was closed: %d scheduled revisits filed since removed", ended)

    # -- one poll -----------------------------------------------------------------------------------
    async def read(self) -> tuple[int, ControlState]:
        """Work left crawl-wide (queued + leased + delayed + waiting seeds) and the control flags: one
        pipelined round trip."""
        k = self.keys
        pipe = self.redis.pipeline(transaction=False)
        for shard in self.shard_keys:
            pipe.zcard(shard.queue)
            pipe.zcard(shard.leases)
            pipe.zcard(shard.delayed)
        if self.seeds_type == "zset":
            pipe.zcard(k.start_urls)
        elif self.seeds_type == "set":
            pipe.scard(k.start_urls)
        else:
            pipe.llen(k.start_urls)
        pipe.llen(k.start_urls_processing)
        pipe.hgetall(k.control)
        *counts, control = await pipe.execute(raise_on_error=False)
        if isinstance(control, Exception):
            raise control
        # Server time now, from the server time at start plus the time elapsed since (no TIME round trip;
        # a cluster pipeline cannot send TIME): bounds how far in the future a close decision may lie.
        opened = getattr(self, "_opened_mono", None)
        self.server_now = None if opened is None else self.started_at + (time.monotonic() - opened)
        state = ControlState.from_hash(control)
        report_problems(k.control, state)
        # a seeds key of another type than configured (WRONGTYPE) holds nothing the spider can take
        return sum(int(c) for c in counts if not isinstance(c, Exception)), state

    def judges_idleness(self) -> bool:
        """Only a worker whose requests go through the shared frontier may call the crawl finished (with
        another scheduler, an empty frontier says nothing about the work left)."""
        return engine_of(self.crawler) is None or scheduler_of(self.crawler) is not None

    def locally_idle(self) -> bool:
        """This worker has no request of its own in progress (nor any crawled outside the frontier)."""
        if engine_of(self.crawler) is None:
            return True
        if _engine.inprogress(self.crawler):
            return False
        sched = scheduler_of(self.crawler)
        return sched is None or not sched.ledger.local

    async def check(self, now: float | None = None) -> str:
        """One poll: returns the reason this worker is closing for, or ``""``."""
        if self._close_task is not None or _engine.is_closing(self.crawler):
            return ""
        work, control = await self.read()
        reason = control.close_reason(self.started_at, getattr(self, "server_now", None))
        if reason:
            self._ends_chains = _end_revisits(self.crawler)
        if not reason and self.clock.idle_before_close > 0 and self.judges_idleness():
            now = time.monotonic() if now is None else now
            # a paused crawl is waiting for `scrapy-dist resume`, not finished
            if self.clock.observe(work > 0 or control.paused, now) and self.locally_idle():
                if len(self.shard_keys) > 1 and not await shards_idle(self.redis, self.shard_keys):
                    self.clock.since = None  # a request was moving between shards
                    return ""
                decided, reason_b, _ = await self._script(
                    keys=[self.keys.queue, self.keys.leases, self.keys.delayed, self.keys.control,
                          self.keys.workers],
                    args=["finished", repr(self.started_at)],
                )
                reason = reason_b.decode() if isinstance(reason_b, bytes) else str(reason_b or "")
                if decided:
                    logger.info(
                        "The crawl has had no work for %.1fs: every worker closes (reason finished)",
                        self.clock.idle_before_close,
                    )
                elif not reason:
                    self.clock.since = None  # work appeared between the poll and the decision
        if reason:
            self._close(reason)
        return reason

    def _close(self, reason: str) -> None:
        engine = engine_of(self.crawler)
        if engine is None or engine.spider is None:
            return
        if _engine.is_closing(self.crawler):
            return
        logger.info("Closing: the crawl was closed crawl-wide (reason %s)", reason)
        self._close_task = asyncio.get_running_loop().create_task(engine.close_spider_async(reason=reason))


def _end_revisits(crawler: Any) -> bool:
    """A crawl closed crawl-wide (``scrapy-dist close``) ends its revisit chains: what this worker is
    still fetching is acknowledged without being filed again. Whether this worker revisits at all."""
    sched = _engine.scheduler(crawler)
    revisits = getattr(sched, "revisits", None)
    if revisits is not None:
        revisits.stop()
    return revisits is not None
