"""The seed protocol: how one worker takes seeds from ``<spider>:start_urls`` and turns them into requests
(docs/seeds.md, "How seeds are read" and "What happens when a worker dies").

:class:`SeedReader` is the Redis side (one round trip per call): take seeds, recording them as in flight;
wait for them; acknowledge them; adopt the seeds of vanished workers. :class:`SeedFeed` is the loop behind
:meth:`scrapy_dist.spiders.RedisMixin.start`: it waits with ``BLMOVE key key RIGHT LEFT`` (wakes on a push,
moves nothing out), validates every seed (:mod:`scrapy_dist.seeds`; a bad one goes to
``<seeds key>:rejected``), and acknowledges a seed only once the frontier has its request, so seeds are
delivered at least once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from scrapy import Request

from scrapy_dist.exceptions import RejectedEntry
from scrapy_dist.frontier import engine as _engine
from scrapy_dist.frontier.scheduler import Scheduler, get_scheduler, make_worker_id
from scrapy_dist.redis import connection
from scrapy_dist.redis.keys import crawl_keys
from scrapy_dist.redis.outage import BackgroundTask, Backoff, Outage, is_outage
from scrapy_dist.seeds import SeedRules, reason_slug, validate_url
from scrapy_dist.seeds import reader as seedreader
from scrapy_dist.seeds.reader import BLOCK_SECONDS, CONFIRM_POLL, POLL_SECONDS, SeedReader, TakeResult
from scrapy_dist.settings import DistSettings
from scrapy_dist.utils import RateLimitedLog
from scrapy_dist.wire.codec import check_offsite, preview, rejection_record
from scrapy_dist.wire.entrypolicy import priority_from_score

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

    from scrapy_dist.spiders import RedisMixin

__all__ = ["SeedFeed", "SeedReader", "TakeResult"]  # the reader and its result re-exported

logger = logging.getLogger(__name__)

T = TypeVar("T")

@dataclass
class _Taken:
    """Processing-list entries whose requests were handed to the scheduler by ``mark`` (monotonic)."""

    entries: list[bytes]
    mark: float


def _flushed_since(scheduler: Scheduler | None, mark: float) -> bool:
    """Whether every request handed to the scheduler before ``mark`` (monotonic) is in Redis (with
    another scheduler than scrapy-dist's, a request counts as done once the engine has it)."""
    return scheduler is None or scheduler.flushed_since(mark)


class SeedFeed(BackgroundTask):
    """Turns the seeds of one worker into requests: the loop behind :meth:`RedisMixin.start`, which
    iterates its :meth:`~BackgroundTask.turns` (the spider's generator drives it, not a task of its own).

    Takes seeds in batches, validates them (``spider.make_request_from_data``), records rejections,
    acknowledges seeds once their requests are in the frontier, adopts dead workers' seeds, waits for
    new ones, and ends once the crawl has been idle ``SCHEDULER_IDLE_BEFORE_CLOSE`` seconds (never, if 0).
    """

    def __init__(
        self,
        spider: RedisMixin,
        reader: SeedReader,
        *,
        rules: SeedRules,
        batch_size: int = 16,
        idle_before_close: float = 0.0,
        block_seconds: float = BLOCK_SECONDS,
        poll_seconds: float = POLL_SECONDS,
    ) -> None:
        self.spider = spider
        self.crawler: Crawler = spider.crawler
        super().__init__(Outage.for_crawler(self.crawler).guard("seed reader", Backoff(0.5, 5.0), logger))
        self.stats = self.crawler.stats
        self.reader = reader
        self.keys = reader.keys
        self.rules = rules
        self.batch_size = max(1, batch_size)
        self.max_unconfirmed = seedreader.held_most(self.batch_size)
        self.idle_before_close = idle_before_close
        self.block_seconds = block_seconds
        self.poll_seconds = poll_seconds
        self._taken: deque[_Taken] = deque()
        self._acks: list[bytes] = []
        self._records: list[str] = []
        self._last_seed = time.monotonic()
        self._last_exchange = 0.0
        self._busy = False
        self._uncertain = False
        self._finished = False
        self._sched: Scheduler | None = None
        self._reject_log = RateLimitedLog(logger)
        self._error_log = RateLimitedLog(logger)
        self._garbage_log = RateLimitedLog.once(logger)

    @classmethod
    def from_spider(cls, spider: RedisMixin) -> SeedFeed:
        """Build the feed from the spider's settings; creates the async client on the running loop."""
        crawler = spider.crawler
        ds = DistSettings.for_crawler(crawler)
        sched = get_scheduler(crawler)
        keys = crawl_keys(ds, spider.name)
        if spider.redis_key:
            # spider.redis_key is the key itself (scrapy_dist.spiders replaced %(name)s): no template
            keys = dataclasses.replace(keys, start_urls_template=spider.redis_key.replace("%", "%%"))
        batch = spider.redis_batch_size or ds.seeds.batch_size
        idle = sched.idle_before_close if sched is not None else ds.scheduler.idle_before_close
        reader = SeedReader(
            connection.ClientPool.of(crawler).async_client(), keys,
            sched.worker_id if sched is not None else make_worker_id(),
            kind=ds.seeds.kind, lease_seconds=ds.scheduler.lease_seconds,
            rejected_maxlen=ds.seeds.rejected_maxlen, held_cap=seedreader.held_cap(batch),
        )
        return cls(spider, reader, rules=SeedRules.from_dist(ds), batch_size=batch, idle_before_close=idle)

    # -- the loop -----------------------------------------------------------------------------------
    async def requests(self) -> AsyncIterator[Request]:
        """Yield the requests of the seeds, forever or until the crawl is idle (see class docstring)."""
        r = self.reader
        sched = self._sched = get_scheduler(self.crawler)
        if sched is None:
            logger.warning(
                "%s does not use scrapy_dist.scheduler.Scheduler: a seed counts as done once the engine"
                " has it, and is lost if this worker dies before crawling it",
                type(self.spider).__name__,
            )
        logger.info(
            "Reading seeds from %r (%s) as worker %s; rejected seeds go to %r",
            self.keys.start_urls, r.kind, r.worker_id, self.keys.start_urls_rejected,
        )
        await seedreader.warn_at_start(r.redis, self.keys)  # seeds pushed to a misspelt key wait for ever
        async with contextlib.aclosing(self.turns()) as turns:
            async for entries in turns:
                for entry in entries:
                    for request in self._requests(entry):
                        self.stats.inc_value("seeds/requests")
                        yield request
                if entries:
                    self._taken.append(_Taken(entries, time.monotonic()))

    async def step(self) -> list[bytes] | None:
        """One exchange with Redis and the wait after it: the entries taken (``[]``: none this time), or
        ``None`` once the feed is done. A failed call raises (the loop backs off)."""
        if self.closing:
            return None
        r = self.reader
        self._collect_confirmed(self._sched)
        unconfirmed = sum(len(t.entries) for t in self._taken)
        want = self.batch_size if unconfirmed < self.max_unconfirmed else 0
        if not want and not self._acks and time.monotonic() - self._last_exchange < r.lease_seconds / 4:
            await asyncio.sleep(CONFIRM_POLL)  # full: wait for the frontier to take what we hold
            return []
        # after a failed exchange (its reply lost, perhaps after it took seeds) and once nothing of ours
        # awaits confirmation, whatever of ours the processing list still holds is unknown to us: a sweep
        # gives it back
        mode = "sweep" if self._uncertain and not self._taken else "take"
        result = await self._exchange(want, mode)
        if result is None or self.closing:
            return []
        if mode == "sweep":
            self._uncertain = False
        if not result.entries and r.kind == "list" and not self._taken and not self._idle_done():
            await self.attempt(self._call(r.wait(self.block_seconds)))
            return []  # the next take pops what woke us (or renews the lease after the timeout)
        if result.entries:
            self._last_seed = time.monotonic()
            return result.entries
        if self._idle_done():
            logger.info(
                "No seeds for %.1fs and the frontier is empty: %s stops reading %r",
                self.idle_before_close, type(self.spider).__name__, self.keys.start_urls,
            )
            await self._finish("leave")
            return None
        if self._taken:
            await asyncio.sleep(CONFIRM_POLL)
        elif r.kind != "list":
            await asyncio.sleep(self.poll_seconds)
        return []

    async def _exchange(self, want: int, mode: str) -> TakeResult | None:
        """One take (plus pending rejection records and adoptions); ``None`` for a key of the wrong type."""
        r = self.reader
        acks = self._acks
        if self._records:
            records, self._records = self._records, []
            try:
                await self._call(r.record_rejections(records))
            except BaseException:
                self._records = records + self._records
                raise
        self._acks = []
        try:
            result = await self._call(r.take(want, acks, mode))
        except BaseException:
            self._acks = acks + self._acks  # LREM is idempotent: resend them next time
            self._uncertain = True
            raise
        self._last_exchange = time.monotonic()
        if result.status == "lost":
            self.stats.inc_value("seeds/lease_lost")
            logger.warning(
                "The processing lease of worker %s on %r ran out (stalled over %.0fs?): its unconfirmed"
                " seeds went back to the seeds key and may be crawled twice",
                r.worker_id, self.keys.start_urls, r.lease_seconds,
            )
        elif result.status == "wrongtype":
            self._error_log.log(
                logging.ERROR,
                "The seeds key %r is a %s, but %s reads a %s (REDIS_START_URLS_AS_SET /"
                " REDIS_START_URLS_AS_ZSET): not reading seeds until that is fixed",
                self.keys.start_urls, result.key_type, type(self.spider).__name__, r.kind,
            )
            await asyncio.sleep(self.block_seconds)
            return None
        if result.returned > 0:
            self.stats.inc_value("seeds/returned", result.returned)
        self._garbage(result.repaired, result.strays)
        self.succeeded()
        if result.expired:
            # after the take: its entries are ours whatever happens here (a failure is retried next time)
            adopted = await self.attempt(self._call(r.adopt(result.expired)))
            if adopted:
                self._garbage([], adopted[2])
            if adopted and adopted[0]:
                self.stats.inc_value("seeds/adopted", adopted[1])
                logger.info(
                    "Gave %d seeds held by %d vanished worker(s) back to %r",
                    adopted[1], adopted[0], self.keys.start_urls,
                )
        return result

    def _garbage(self, repaired: list[str], strays: int) -> None:
        """Name once what the seeds scripts repaired (someone else wrote there); count the rest."""
        for key in repaired:
            self._garbage_log.log(logging.WARNING, "Repaired garbage in %s (written by someone else?): it"
                                  " held another Redis type; moved to %s:garbage", key, key, key=key)
        if strays:
            self.stats.inc_value("seeds/strays", strays)
            self._garbage_log.log(
                logging.WARNING, "%d entries in %s were no live worker's (written by someone else?): given"
                " back to %r, where they are read as seeds (stat seeds/strays)", strays,
                self.keys.start_urls_processing, self.keys.start_urls, key="strays",
            )

    async def _call(self, coro: Awaitable[T]) -> T:
        """Await a Redis call, marking the feed busy (so :meth:`close` lets it finish first)."""
        self._busy = True
        try:
            return await coro
        finally:
            self._busy = False

    def failed(self, exc: BaseException, now: float | None = None, detail: str = "") -> float:
        if not is_outage(exc):  # a bug or a Redis error reply
            self.stats.inc_value("seeds/errors")
        return super().failed(exc, now, detail)

    # -- acknowledgement and idleness --------------------------------------------------------------
    def _collect_confirmed(self, sched: Any) -> None:
        """Move seeds whose requests are now in the frontier to the acknowledgements (in order)."""
        while self._taken and _flushed_since(sched, self._taken[0].mark):
            self._acks.extend(self._taken.popleft().entries)

    def _idle_done(self) -> bool:
        """Whether to stop reading seeds: idle closing is on, no seed for that long, nothing held, and
        the whole frontier has been empty for that long too."""
        if self.idle_before_close <= 0 or self._taken or self._acks or self._records:
            return False
        if time.monotonic() - self._last_seed < self.idle_before_close:
            return False
        return _frontier_idle(self.crawler)

    # -- seeds -> requests ----------------------------------------------------------------------------
    def _requests(self, entry: bytes) -> list[Request]:
        """The requests of one processing-list entry (none if its seed is rejected, recorded, or skipped)."""
        score: float | None = None
        raw = entry
        if self.reader.kind == "zset":
            head, _, raw = entry.partition(b" ")
            try:
                score = float(head)
            except ValueError:
                score = 0.0
        self.stats.inc_value("seeds/received")
        try:
            requests = seed_requests(self.spider, raw, self.rules, score)
        except RejectedEntry as exc:
            self._reject(raw, exc)
            return []
        if not requests:
            self.stats.inc_value("seeds/skipped")
        return requests

    def _reject(self, raw: bytes, exc: RejectedEntry) -> None:
        reason = reason_slug(exc.reason)
        self.stats.inc_value("seeds/rejected")
        self.stats.inc_value(f"seeds/rejected/{reason}")
        self._records.append(rejection_record(reason, raw, self.reader.worker_id, exc.detail))
        self._reject_log.log(
            logging.WARNING, "Rejected a seed from %r (%s: %s): %s; recorded in %r", self.keys.start_urls,
            reason, preview(exc.detail, 200, quote=False), preview(raw), self.keys.start_urls_rejected,
        )

    # -- shutdown ---------------------------------------------------------------------------------------
    async def close(self) -> None:
        """Stop reading; acknowledge what reached the frontier and give the rest back to the seeds key.
        Called from ``spider_closed``; a take in progress is given a moment to finish, so what it takes is
        given back too (one that lands later keeps the lease, and its seeds go back when it runs out).
        """
        if self._finished:
            return
        await self.stop()
        deadline = time.monotonic() + self.block_seconds + 2.0
        while self._busy and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self._collect_confirmed(get_scheduler(self.crawler))
        await self._finish("leave")

    async def _finish(self, mode: str) -> None:
        self._finished = True
        self.closing = True
        r = self.reader
        # only what the frontier has is acknowledged; the mode gives everything else back
        acks = self._acks
        try:
            if self._records:
                await r.record_rejections(self._records)
                self._records = []
            result = await r.take(0, acks, mode)
            if result.returned > 0:
                self.stats.inc_value("seeds/returned", result.returned)
                logger.info("Gave %d unfinished seeds back to %r", result.returned, self.keys.start_urls)
        except Exception as exc:
            held = sum(len(t.entries) for t in self._taken)
            logger.warning(
                "Could not release the seeds of worker %s (%s: %s): %d seeds go back to %r when its lease"
                " runs out (%.0fs)",
                r.worker_id, type(exc).__name__, exc, held, self.keys.start_urls, r.lease_seconds,
            )
        finally:
            self._acks = []
            self._taken.clear()
            try:
                await r.close()
            except Exception:  # closing a client that lost its server is not worth a traceback
                logger.debug("Error closing the seeds client", exc_info=True)


#: Most requests one seed may give (a hook yielding without end must not stall the feed).
MAX_REQUESTS_PER_SEED = 10_000


def seed_requests(spider: Any, raw: bytes, rules: SeedRules, score: float | None) -> list[Request]:
    """The requests of one seed: ``make_request_from_data`` may return one request, ``None`` or an
    iterable of them (as in scrapy-redis). Raises :class:`RejectedEntry` for a seed too large, a hook that
    fails or a request refused by the rules; one bad request rejects the whole seed."""
    if len(raw) > rules.max_bytes:
        raise RejectedEntry("too_large", f"{len(raw)} bytes > {rules.max_bytes}")
    try:
        requests = _as_requests(spider.make_request_from_data(raw))
    except RejectedEntry:
        raise
    except Exception as exc:  # the spider's own hook: its bugs must not stop the seeds
        raise RejectedEntry("hook_error", f"{type(exc).__name__}: {exc}"[:200]) from None
    out = []
    for request in requests:
        validate_url(request.url, rules)
        check_offsite(request.url, spider)  # dont_filter must not get one past allowed_domains
        if score is not None and not request.priority:
            request = request.replace(priority=priority_from_score(score))
        out.append(request)
    return out


def _as_requests(result: Any) -> list[Request]:
    """``make_request_from_data``'s answer as a list: a request, ``None``, or an iterable of requests
    (a generator is run here, inside the hook's error handling). Raises :class:`RejectedEntry`."""
    if result is None:
        return []
    if isinstance(result, Request):
        return [result]
    if isinstance(result, (str, bytes, dict)) or not isinstance(result, Iterable):
        raise RejectedEntry("bad_hook_result", f"make_request_from_data returned a {type(result).__name__}")
    out: list[Request] = []
    for item in result:
        if not isinstance(item, Request):
            raise RejectedEntry(
                "bad_hook_result", f"make_request_from_data yielded a {type(item).__name__}, not a Request"
            )
        out.append(item)
        if len(out) > MAX_REQUESTS_PER_SEED:
            raise RejectedEntry("bad_hook_result", f"over {MAX_REQUESTS_PER_SEED} requests from one seed")
    return out


def _frontier_idle(crawler: Crawler) -> bool:
    """Whether the crawl has nothing to do: scrapy-dist's scheduler reports the whole frontier empty for
    ``SCHEDULER_IDLE_BEFORE_CLOSE`` seconds; another scheduler has no pending requests and the engine
    downloads nothing."""
    sched = get_scheduler(crawler)
    if sched is not None:
        return not sched.has_pending_requests()
    return _engine.locally_idle(crawler)
