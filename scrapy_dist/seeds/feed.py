"""The seed protocol (docs/seeds.md, "How seeds are read"): :class:`SeedReader` is one worker's Redis side of
``<spider>:start_urls`` (``lua/seeds_take.lua``, ``lua/seeds_adopt.lua``: one round trip per call);
:class:`SeedFeed` is the loop behind ``RedisMixin.start()``: it validates every seed (a bad one goes to
``<seeds key>:rejected``) and acknowledges it once the frontier has its request (at-least-once delivery)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from scrapy import Request

from scrapy_dist.exceptions import RejectedEntry
from scrapy_dist.frontier import engine as _engine
from scrapy_dist.frontier.scheduler import Scheduler, get_scheduler, make_worker_id
from scrapy_dist.redis import connection, scripts
from scrapy_dist.redis.keys import crawl_keys
from scrapy_dist.redis.outage import BackgroundTask, Outage, is_outage
from scrapy_dist.redis.scripts import text
from scrapy_dist.seeds import SeedRules, reason_slug, validate_url, warn_at_start
from scrapy_dist.settings import DistSettings, defaults
from scrapy_dist.utils import RateLimitedLog
from scrapy_dist.wire.codec import check_offsite, preview, rejection_record
from scrapy_dist.wire.entrypolicy import priority_from_score

if TYPE_CHECKING:
    from scrapy_dist.redis.keys import CrawlKeys
    from scrapy_dist.spiders import RedisMixin

__all__ = ["HELD_CAP", "SeedFeed", "SeedReader", "TakeResult"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: One blocking wait for a LIST seed (seconds): a push wakes it at once; the timeout bounds how late the
#: spider notices it should close, and renews the processing lease that often.
BLOCK_SECONDS = 1.0
#: SET and ZSET seeds cannot be waited for atomically, so they are polled this often (seconds).
POLL_SECONDS = 0.1
ADOPT_BATCH = 10  #: Workers whose lease ran out are reported and adopted this many at a time.
CONFIRM_POLL = 0.01  #: How often to look whether taken seeds have reached the frontier (seconds, local only).
#: Most processing-list entries one worker may hold; more are garbage, given back to the seeds key.
HELD_CAP = 10_000


def held_most(batch_size: int) -> int:
    """Unacknowledged seeds a worker taking ``batch_size`` at a time may hold (flush batches stay full)."""
    return max(4 * batch_size, 2000)


@dataclass
class TakeResult:
    """What one :meth:`SeedReader.take` answers."""

    status: str  #: ``ok``, ``lost`` (another worker adopted this one's seeds) or ``wrongtype``
    entries: list[bytes]  #: entries taken (the seed; ``<score> <seed>`` for a ZSET)
    #: workers whose lease ran out (an id that is not UTF-8, garbage someone wrote, stays ``bytes``)
    expired: list[str | bytes]
    returned: int  #: this worker's entries given back to the seeds key (``sweep``, ``leave``)
    key_type: str = ""  #: the seeds key's type (``none`` if it does not exist)
    #: the processing list and/or workers ZSET, if they held another Redis type (moved aside)
    repaired: list[str] = dataclasses.field(default_factory=list)
    #: entries of no live worker (garbage in the processing list) given back to the seeds key too
    strays: int = 0


def _worker_id(value: Any) -> str | bytes:
    """A worker id read from the workers ZSET: text, or the raw bytes of one that is not UTF-8."""
    with contextlib.suppress(UnicodeDecodeError):
        return value.decode() if isinstance(value, bytes) else str(value)
    return value


class SeedReader:
    """One worker's Redis side of the seeds key, one round trip per call; ``kind``: ``list``, ``set``
    (``REDIS_START_URLS_AS_SET``) or ``zset`` (``..._AS_ZSET``, the score is the priority)."""

    def __init__(
        self, redis: Any, keys: CrawlKeys, worker_id: str, kind: str = "list", lease_seconds: float = 60.0,
        rejected_maxlen: int = defaults.REDIS_START_URLS_REJECTED_MAXLEN, held_cap: int = HELD_CAP) -> None:
        if "\n" in worker_id:
            raise ValueError("a worker id cannot hold a newline (it prefixes processing entries)")
        self.redis, self.keys, self.worker_id, self.kind = redis, keys, worker_id, kind
        self.lease_seconds, self.rejected_maxlen, self.held_cap = lease_seconds, rejected_maxlen, held_cap
        # a deadline in the workers ZSET further ahead than any lease a worker writes is garbage
        self._bounds = [repr(max(100 * lease_seconds, 86_400.0)), held_cap]
        self.registered = False
        self._keys = [keys.start_urls, keys.start_urls_processing, keys.start_urls_workers]
        self._take = scripts.register(redis, "seeds_take")
        self._adopt = scripts.register(redis, "seeds_adopt")

    async def take(self, count: int, acks: Sequence[bytes] = (), mode: str = "take",
                   now: float | None = None) -> TakeResult:
        """Acknowledge ``acks``, renew the lease, take up to ``count`` seeds: one ``seeds_take.lua`` call."""
        raw = await self._take(keys=self._keys, args=[
            "" if now is None else repr(now), self.worker_id, repr(self.lease_seconds), self.kind, count,
            mode, "1" if self.registered else "0", ADOPT_BATCH, *self._bounds, *acks])
        self.registered = mode != "leave"
        return TakeResult(text(raw[0]), list(raw[1]), [_worker_id(w) for w in raw[2]], int(raw[3]),
                          text(raw[4]), [text(k) for k in raw[5]], int(raw[6]))

    async def wait(self, timeout: float = BLOCK_SECONDS) -> bool:
        """Block until the seeds key (a LIST) holds a seed or ``timeout`` passes; True if it does. ``BLMOVE
        key key`` rotates the list onto itself, so the seed stays in Redis; :meth:`take` pops it."""
        k = self.keys.start_urls
        return await self.redis.blmove(k, k, timeout, "RIGHT", "LEFT") is not None

    async def adopt(self, workers: Iterable[str | bytes], now: float | None = None) -> tuple[int, int, int]:
        """Give the seeds of ``workers`` (whose lease ran out), and any garbage of no live worker's, back to
        the seeds key: ``(workers adopted, their entries, garbage)``, one EVALSHA of ``seeds_adopt.lua``."""
        if not (workers := list(workers)):
            return 0, 0, 0
        raw = await self._adopt(keys=self._keys,
                                args=["" if now is None else repr(now), self.kind, *self._bounds, *workers])
        return int(raw[0]), int(raw[1]), int(raw[2])

    async def record_rejections(self, records: Sequence[str]) -> None:
        """Append rejection records to ``<seeds key>:rejected``, keeping the newest ``rejected_maxlen``."""
        if not records:
            return
        pipe = self.redis.pipeline(transaction=False)
        pipe.rpush(self.keys.start_urls_rejected, *records)
        if self.rejected_maxlen > 0:
            pipe.ltrim(self.keys.start_urls_rejected, -self.rejected_maxlen, -1)
        await pipe.execute()

    async def close(self) -> None:
        await self.redis.aclose()


@dataclass
class _Taken:
    """Processing-list entries whose requests were handed to the scheduler by ``mark`` (monotonic)."""

    entries: list[bytes]
    mark: float


class SeedFeed(BackgroundTask):
    """Turns one worker's seeds into requests (``start()`` iterates its :meth:`~BackgroundTask.turns`) until
    the crawl has been idle ``SCHEDULER_IDLE_BEFORE_CLOSE`` s (never, if 0)."""

    def __init__(self, spider: RedisMixin, reader: SeedReader, rules: SeedRules, batch_size: int = 16,
                 idle_before_close: float = 0.0) -> None:
        self.spider, self.crawler = spider, spider.crawler
        super().__init__(Outage.for_crawler(self.crawler).guard("seed reader", log=logger))
        self.stats = self.crawler.stats
        self.reader, self.keys, self.rules = reader, reader.keys, rules
        self.batch_size, self.idle_before_close = max(1, batch_size), idle_before_close
        self.max_unconfirmed = held_most(self.batch_size)
        self._taken: deque[_Taken] = deque()
        self._acks: list[bytes] = []
        self._records: list[str] = []
        self._last_seed, self._last_exchange = time.monotonic(), 0.0
        self._busy = self._uncertain = self._finished = False
        self._sched: Scheduler | None = None
        self._reject_log, self._error_log = RateLimitedLog(logger), RateLimitedLog(logger)
        self._garbage_log = RateLimitedLog.once(logger)

    @classmethod
    def from_spider(cls, spider: RedisMixin) -> SeedFeed:
        """The feed from the spider's settings (made on the running loop, for the async client)."""
        ds, sched = DistSettings.for_crawler(spider.crawler), get_scheduler(spider.crawler)
        keys = crawl_keys(ds, spider.name)
        if spider.redis_key:
            # spider.redis_key is the key itself (scrapy_dist.spiders replaced %(name)s): no template
            keys = dataclasses.replace(keys, start_urls_template=spider.redis_key.replace("%", "%%"))
        batch = max(1, spider.redis_batch_size or ds.seeds.batch_size)
        worker = sched.worker_id if sched is not None else make_worker_id()
        client = connection.ClientPool.of(spider.crawler).async_client()
        reader = SeedReader(client, keys, worker, ds.seeds.kind, ds.scheduler.lease_seconds,
                            ds.seeds.rejected_maxlen, held_cap=max(HELD_CAP, 4 * held_most(batch)))
        idle = (ds.scheduler if sched is None else sched).idle_before_close
        return cls(spider, reader, SeedRules.from_dist(ds), batch, idle)

    async def requests(self) -> AsyncIterator[Request]:
        """Yield the requests of the seeds, forever or until the crawl is idle."""
        r = self.reader
        sched = self._sched = get_scheduler(self.crawler)
        if sched is None:
            logger.warning("%s does not use scrapy_dist.scheduler.Scheduler: a seed counts as done once the"
                           " engine has it, and is lost if this worker dies before crawling it",
                           type(self.spider).__name__)
        logger.info("Reading seeds from %r (%s) as worker %s; rejected seeds go to %r",
                    self.keys.start_urls, r.kind, r.worker_id, self.keys.start_urls_rejected)
        await warn_at_start(r.redis, self.keys)  # seeds pushed to a misspelt key wait for ever
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
        # after a failed exchange (its reply lost, perhaps after it took seeds), once nothing of ours awaits
        # confirmation, a sweep gives back whatever of ours the processing list still holds
        mode = "sweep" if self._uncertain and not self._taken else "take"
        if (result := await self._exchange(want, mode)) is None or self.closing:
            return []
        if mode == "sweep":
            self._uncertain = False
        if not result.entries and r.kind == "list" and not self._taken and not self._idle_done():
            await self.attempt(r.wait())  # takes nothing: close() need not wait for it
            return []  # the next take pops what woke us (or renews the lease after the timeout)
        if result.entries:
            self._last_seed = time.monotonic()
            return result.entries
        if self._idle_done():
            logger.info("No seeds for %.1fs and the frontier is empty: %s stops reading %r",
                        self.idle_before_close, type(self.spider).__name__, self.keys.start_urls)
            await self._finish("leave")
            return None
        if self._taken:
            await asyncio.sleep(CONFIRM_POLL)
        elif r.kind != "list":
            await asyncio.sleep(POLL_SECONDS)
        return []

    async def _exchange(self, want: int, mode: str) -> TakeResult | None:
        """One take (plus pending rejection records and adoptions); ``None`` for a key of the wrong type."""
        r = self.reader
        await self._send_records()
        acks, self._acks = self._acks, []
        try:
            result = await self._call(r.take(want, acks, mode))
        except BaseException:
            self._acks = acks + self._acks  # LREM is idempotent: resend them next time
            self._uncertain = True
            raise
        self._last_exchange = time.monotonic()
        if result.status == "lost":
            self.stats.inc_value("seeds/lease_lost")
            logger.warning("The processing lease of worker %s on %r ran out (stalled over %.0fs?): its"
                           " unconfirmed seeds went back to the seeds key and may be crawled twice",
                           r.worker_id, self.keys.start_urls, r.lease_seconds)
        elif result.status == "wrongtype":
            self._error_log.log(logging.ERROR,
                                "The seeds key %r is a %s, but %s reads a %s (REDIS_START_URLS_AS_SET /"
                                " REDIS_START_URLS_AS_ZSET): not reading seeds until that is fixed",
                                self.keys.start_urls, result.key_type, type(self.spider).__name__, r.kind)
            await asyncio.sleep(BLOCK_SECONDS)
            return None
        if result.returned > 0:
            self.stats.inc_value("seeds/returned", result.returned)
        self._garbage(result.repaired, result.strays)
        self.succeeded()
        if result.expired:
            # after the take: its entries are ours whatever happens here (a failure is retried next time)
            if adopted := await self.attempt(self._call(r.adopt(result.expired))):
                self._garbage([], adopted[2])
            if adopted and adopted[0]:
                self.stats.inc_value("seeds/adopted", adopted[1])
                logger.info("Gave %d seeds held by %d vanished worker(s) back to %r",
                            adopted[1], adopted[0], self.keys.start_urls)
        return result

    async def _send_records(self) -> None:
        """Append the pending rejection records to ``<seeds key>:rejected`` (kept to retry on failure)."""
        records, self._records = self._records, []
        try:
            await self._call(self.reader.record_rejections(records))
        except BaseException:
            self._records = records + self._records
            raise

    def _garbage(self, repaired: list[str], strays: int) -> None:
        """Name once what the seeds scripts repaired (someone else wrote there); count the rest."""
        for key in repaired:
            self._garbage_log.log(logging.WARNING, "Repaired garbage in %s (written by someone else?): it"
                                  " held another Redis type; moved to %s:garbage", key, key, key=key)
        if strays:
            self.stats.inc_value("seeds/strays", strays)
            self._garbage_log.log(logging.WARNING, "%d entries in %s were no live worker's (written by"
                                  " someone else?): given back to %r as seeds (stat seeds/strays)", strays,
                                  self.keys.start_urls_processing, self.keys.start_urls, key="strays")

    async def _call(self, coro: Awaitable[T]) -> T:
        """Await a Redis call, marking the feed busy (so :meth:`close` lets it finish first)."""
        self._busy = True
        try:
            return await coro
        finally:
            self._busy = False

    def failed(self, exc: BaseException, now: float | None = None, detail: str = "") -> float:
        if self.closing:  # a wait cut short by close() (its client closed under it)
            return 0.0
        if not is_outage(exc):  # a bug or a Redis error reply
            self.stats.inc_value("seeds/errors")
        return super().failed(exc, now, detail)

    def _collect_confirmed(self, sched: Any) -> None:
        """Move seeds whose requests are now in the frontier to the acknowledgements (in order)."""
        # with another scheduler than ours, a request counts as done once the engine has it
        while self._taken and (sched is None or sched.flushed_since(self._taken[0].mark)):
            self._acks.extend(self._taken.popleft().entries)

    def _idle_done(self) -> bool:
        """Whether to stop reading seeds: idle closing on, nothing held, no seed and the frontier empty."""
        if (self.idle_before_close <= 0 or self._taken or self._acks or self._records
                or time.monotonic() - self._last_seed < self.idle_before_close):
            return False
        sched = get_scheduler(self.crawler)
        return not sched.has_pending_requests() if sched is not None else _engine.locally_idle(self.crawler)

    def _requests(self, entry: bytes) -> list[Request]:
        """The requests of one processing-list entry (none if its seed is rejected, recorded, or skipped)."""
        score, raw = None, entry
        if self.reader.kind == "zset":
            head, _, raw = entry.partition(b" ")
            score = 0.0
            with contextlib.suppress(ValueError):
                score = float(head)
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
        self._reject_log.log(logging.WARNING, "Rejected a seed from %r (%s: %s): %s; recorded in %r",
                             self.keys.start_urls, reason, preview(exc.detail, 200, quote=False),
                             preview(raw), self.keys.start_urls_rejected)

    async def close(self) -> None:
        """Stop reading (``spider_closed``); acknowledge what reached the frontier and give the rest back.
        A take in progress is given a moment to finish, so what it takes is given back too."""
        if self._finished:
            return
        await self.stop()
        deadline = time.monotonic() + BLOCK_SECONDS + 2.0
        while self._busy and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self._collect_confirmed(get_scheduler(self.crawler))
        await self._finish("leave")

    async def _finish(self, mode: str) -> None:
        self._finished = self.closing = True
        r = self.reader
        # only what the frontier has is acknowledged; the mode gives everything else back
        try:
            await self._send_records()
            if (result := await r.take(0, self._acks, mode)).returned > 0:
                self.stats.inc_value("seeds/returned", result.returned)
                logger.info("Gave %d unfinished seeds back to %r", result.returned, self.keys.start_urls)
        except Exception as exc:
            held = sum(len(t.entries) for t in self._taken)
            logger.warning("Could not release the seeds of worker %s (%s: %s): %d seeds go back to %r when"
                           " its lease runs out (%.0fs)", r.worker_id, type(exc).__name__, exc, held,
                           self.keys.start_urls, r.lease_seconds)
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
    """The requests of one seed (``make_request_from_data``); raises :class:`RejectedEntry` for a seed too
    large, a hook that fails or a request the rules refuse (one bad request rejects the whole seed)."""
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
    """``make_request_from_data``'s answer (a request, ``None`` or an iterable of them) as a list."""
    if result is None:
        return []
    if isinstance(result, Request):
        return [result]
    if isinstance(result, (str, bytes, dict)) or not isinstance(result, Iterable):
        raise RejectedEntry("bad_hook_result", f"make_request_from_data returned a {type(result).__name__}")
    out: list[Request] = []
    for item in result:
        if not isinstance(item, Request):
            raise RejectedEntry("bad_hook_result",
                                f"make_request_from_data yielded a {type(item).__name__}, not a Request")
        out.append(item)
        if len(out) > MAX_REQUESTS_PER_SEED:
            raise RejectedEntry("bad_hook_result", f"over {MAX_REQUESTS_PER_SEED} requests from one seed")
    return out
