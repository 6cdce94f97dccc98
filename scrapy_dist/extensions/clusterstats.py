"""Crawl-wide stats, the worker heartbeat and registry, and the base the extensions share (a periodic task).
:class:`ClusterStats` sends what changed in Scrapy's stats in one ``clusterstats.lua`` call per interval; a
sequence number makes a resent flush count once. The registry: ``{spider}:workers`` (id -> last seen) and
one ``{spider}:worker:<id>`` HASH per worker, read back through :func:`parse_worker_hash`."""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import math
import os
import re
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, ClassVar

from scrapy import signals
from scrapy.exceptions import NotConfigured

from scrapy_dist.frontier.engine import engine_of
from scrapy_dist.frontier.layout import start_time
from scrapy_dist.frontier.scheduler import get_scheduler, make_worker_id
from scrapy_dist.redis import connection, scripts
from scrapy_dist.redis.keys import crawler_keys
from scrapy_dist.redis.outage import BackgroundTask, Outage
from scrapy_dist.redis.scripts import hash_fields
from scrapy_dist.settings import DistSettings
from scrapy_dist.settings.reader import refusing, start_error
from scrapy_dist.utils import RateLimitedLog, finite_float

if TYPE_CHECKING:
    from scrapy import Spider
    from scrapy.crawler import Crawler
    from typing_extensions import Self

logger = logging.getLogger(__name__)

#: Stats merged as the maximum over workers (fnmatch patterns), besides names with a ``max`` word.
MAX_STATS = ("finish_time", "elapsed_time_seconds", "dupefilter/bloom/*")
MIN_STATS = ("start_time",)  #: Stats merged as the minimum over workers.
#: A name whose last segment has ``max`` / ``min`` as a word (``memusage/max``, ``request_depth_max``).
_MAX_WORD = re.compile(r"(?:^|[/_.\-])max(?:$|[/_.\-])")
_MIN_WORD = re.compile(r"(?:^|[/_.\-])min(?:$|[/_.\-])")
CLOSE_FLUSH_TIMEOUT = 10.0  #: Seconds the final flush at close keeps retrying while Redis is unreachable.
#: Seconds a worker's details stay in Redis after its last heartbeat (closed: when SCHEDULER_PERSIST is off).
WORKER_TTL = 7 * 24 * 3600
CLOSED_TTL_NOT_PERSISTENT = 60
LOST_AFTER_INTERVALS = 3  #: A worker unseen for this many of its heartbeat intervals is shown as lost.
MAX_COUNT = 10**15  #: Largest count a worker hash may report (anything above is garbage, shown as unknown).
MAX_TEXT = 200  #: Longest text field kept from a worker hash.

RUNNING, LOST, CLOSED = "running", "lost", "closed"


class PeriodicTask(BackgroundTask):
    """Await ``func()`` every ``interval`` seconds until :meth:`stop`. A failing call never ends the task:
    an outage goes to the worker's :class:`Outage`, anything else is logged at ERROR at most once a minute."""

    interrupt = True

    def __init__(self, func: Callable[[], Awaitable[object]], interval: float, what: str,
                 logger: logging.Logger, outage: Outage | None = None) -> None:
        super().__init__((outage or Outage()).guard(what, log=logger))
        self.func, self.interval = func, interval

    async def step(self) -> bool:
        # after a failed call, Redis answering again ends the wait
        await (self.back_off(self.interval) if self.guard.backoff.failures else self.rest(self.interval))
        if self.closing:
            return False
        await self.run_once()
        return True

    async def run_once(self, now: float | None = None) -> bool:
        """One call with the task's error handling; returns whether it succeeded."""
        try:
            await self.func()
        except Exception as exc:
            self.failed(exc, now)
            return False
        self.succeeded(now)
        return True


def encode_datetime(value: datetime) -> str:
    """Fixed-width ISO 8601 in UTC, so that stored timestamps compare correctly as strings."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f+00:00")


class StatsMerger:
    """What changed in one worker's stats since the last snapshot as ``clusterstats.lua`` merge operations."""

    def __init__(self, max_stats: Iterable[str] = (), min_stats: Iterable[str] = ()) -> None:
        self.max_stats, self.min_stats = (*MAX_STATS, *max_stats), (*MIN_STATS, *min_stats)
        self._flushed: dict[str, Any] = {}

    def mode(self, name: str, value: Any) -> str | None:
        """How ``name`` merges across workers: ``sum``, ``max``, ``min``, ``set``, or None (not merged)."""
        if any(fnmatch.fnmatchcase(name, p) for p in self.min_stats):
            return "min"
        if any(fnmatch.fnmatchcase(name, p) for p in self.max_stats):
            return "max"
        if isinstance(value, datetime):
            return "min" if "start" in name.rsplit("/", 1)[-1] else "max"
        if isinstance(value, (bool, str)):
            return "set"
        if not isinstance(value, (int, float)) or isinstance(value, float) and not math.isfinite(value):
            return None
        return "max" if _MAX_WORD.search(name) else "min" if _MIN_WORD.search(name) else "sum"

    def operations(self, stats: dict[str, Any]) -> list[tuple[str, str, str]]:
        """Merge operations for ``stats`` relative to the previous snapshot (which becomes ``stats``)."""
        ops: list[tuple[str, str, str]] = []
        for name, value in stats.items():
            if (mode := self.mode(name, value)) == "sum":
                if delta := value - self._flushed.get(name, 0):
                    ops.append(("sum", name, _encode(delta if isinstance(delta, float) else int(delta))))
                self._flushed[name] = value
            elif mode is not None:
                encoded = encode_datetime(value) if isinstance(value, datetime) else _encode(value)
                if self._flushed.get(name) != encoded:
                    ops.append((mode, name, encoded))
                    self._flushed[name] = encoded
        return ops


def _encode(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


class PeriodicExtension:
    """Base of the extensions: from ``spider_opened`` to ``spider_closed``, a :class:`PeriodicTask` awaits
    :meth:`tick` every :attr:`interval` seconds, with the crawl's async client and ``script`` registered."""

    script: ClassVar[str]
    what: ClassVar[str]  #: the task's name in outage and error lines
    handlers: ClassVar[tuple[str, ...]] = ("spider_opened", "spider_closed")  #: signals connected
    interval: float
    tick: Callable[[], Awaitable[Any]]  #: the call the task makes

    def __init__(self, crawler: Crawler) -> None:
        self.crawler, self.keys = crawler, crawler_keys(crawler)
        self.settings = DistSettings.for_crawler(crawler)
        self.redis: Any = None
        self.started_at = 0.0
        self._opened_mono: float | None = None  # time.monotonic() when started_at was read
        self.closing = False  #: spider_closed came, or this extension had the spider closed
        self._script: Any = None
        self._task: PeriodicTask | None = None
        self._close_task: asyncio.Task[None] | None = None

    @classmethod
    @refusing
    def from_crawler(cls, crawler: Crawler) -> Self:
        o = cls(crawler)
        for name in cls.handlers:
            crawler.signals.connect(getattr(o, name), signal=getattr(signals, name))
        return o

    async def opened(self) -> None:
        """After the client is made and before the task starts."""
        self.started_at, self._opened_mono = await start_time(self.redis), time.monotonic()

    async def closed(self, reason: str) -> None:
        """After the task stopped and before the client is closed."""

    async def spider_opened(self, spider: Spider) -> None:
        if start_error(self.crawler) is not None:  # the crawl stops as it opens
            return
        self.redis = connection.ClientPool.of(self.crawler).async_client()
        self._script = scripts.register(self.redis, self.script)
        log = logging.getLogger(type(self).__module__)
        self._task = PeriodicTask(self.tick, self.interval, self.what, log, Outage.for_crawler(self.crawler))
        await self.opened()
        self._task.start()

    async def spider_closed(self, spider: Spider, reason: str) -> None:
        self.closing = True
        await asyncio.sleep(0)  # the other spider_closed handlers (CoreStats: finish_reason...) run first
        if self._task is not None:
            await self._task.stop()
        if self.redis is not None:
            try:
                await self.closed(reason)
            finally:
                await self.redis.aclose()

    def close_spider(self, reason: str) -> bool:
        """Have the engine close the spider (``reason``); False before it has one."""
        engine = engine_of(self.crawler)
        if engine is None or engine.spider is None:
            return False
        self._close_task = asyncio.get_running_loop().create_task(engine.close_spider_async(reason=reason))
        self.closing = True
        return True


class ClusterStats(PeriodicExtension):
    """Scrapy extension: crawl-wide stats in ``{spider}:stats`` and this worker's heartbeat, one round trip
    per ``CLUSTERSTATS_INTERVAL`` (0 disables; ``CLUSTERSTATS_MAX_STATS`` / ``_MIN_STATS`` merge modes)."""

    script, what = "clusterstats", "crawl-wide stats"

    def __init__(self, crawler: Crawler) -> None:
        super().__init__(crawler)
        if (m := self.settings.monitoring).interval <= 0:
            raise NotConfigured("CLUSTERSTATS_INTERVAL is 0")
        self.interval, self.merger = m.interval, StatsMerger(m.max_stats, m.min_stats)
        # a non-persistent crawl removes its keys when it finishes: closed workers' details go soon too
        self.closed_ttl = WORKER_TTL if self.settings.scheduler.persist else CLOSED_TTL_NOT_PERSISTENT
        self.worker, self.started, self.rate = "", time.time(), RateMeter()
        self._seq = 0
        self._pending: tuple[int, list[tuple[str, str, str]]] | None = None
        self._garbage_log = RateLimitedLog.once(logger)

    async def opened(self) -> None:
        self.worker, self.started = worker_id(self.crawler), time.time()
        assert self._task is not None
        await self._task.run_once()  # registers the worker at once

    async def closed(self, reason: str) -> None:
        # Redis away now: the scheduler's close (before spider_closed) already waited out the shutdown grace
        deadline = time.monotonic() + (0.0 if Outage.for_crawler(self.crawler).down else CLOSE_FLUSH_TIMEOUT)
        while True:
            try:
                await self.flush(final=True, reason=reason)
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    logger.error("Could not write this worker's last stats to %s (%s); the crawl-wide"
                                 " stats miss at most its last %.0fs", self.keys.stats, exc, self.interval)
                    return
                await asyncio.sleep(0.5)

    def _heartbeat(self, stats: dict[str, Any], final: bool, reason: str) -> dict[str, str]:
        """This worker's heartbeat HASH (Redis adds ``last_seen``), with the frontier its scheduler saw."""
        sched = get_scheduler(self.crawler)
        ledger = getattr(sched, "ledger", None)
        # requests handed to the engine, and leased ahead of demand (all a paused worker holds)
        handed, ready = ("", "") if ledger is None else (str(len(ledger.handed)), str(len(ledger.ready)))
        fields = {"id": self.worker, "host": socket.gethostname(), "pid": str(os.getpid()),
                  "spider": self.keys.spider, "started": f"{self.started:.3f}",
                  "pages": str(int(stats.get("response_received_count", 0) or 0)),
                  "items": str(int(stats.get("item_scraped_count", 0) or 0)),
                  "errors": str(error_count(stats)),
                  "inflight": "0" if final else handed, "prefetched": "0" if final else ready,
                  "pages_per_min": f"{0.0 if final else self.rate.per_minute():.1f}",
                  "interval": repr(float(self.interval)), "state": CLOSED if final else RUNNING}
        if reason:
            fields["finish_reason"] = reason
        if isinstance(status := getattr(sched, "frontier_status", None), dict):
            for k in ("queued", "inflight", "delayed"):
                fields[f"frontier_{k}"] = str(int(status.get(k, 0)))
        return fields

    async def flush(self, final: bool = False, reason: str = "") -> int:
        """Send the heartbeat and the changed stats; a failed flush is resent unchanged (same sequence
        number) before anything newer. Returns 1 merged, 0 already merged, -1 the crawl's keys are gone."""
        pages = self.crawler.stats.get_value("response_received_count", 0) or 0
        self.rate.add(float(pages), time.monotonic())
        while True:
            stats = dict(self.crawler.stats.get_stats())
            if fresh := (self._pending is None):
                self._seq += 1
                self._pending = (self._seq, self.merger.operations(stats))
            seq, ops = self._pending
            fields = self._heartbeat(stats, final, reason)
            ttl = self.closed_ttl if final else WORKER_TTL
            args: list[Any] = [self.worker, seq, ttl, "1" if final else "0", len(fields)]
            args += [x for pair in (*fields.items(), *ops) for x in pair]
            keys = [self.keys.stats, self.keys.workers, self.keys.worker(self.worker), self.keys.history]
            result = await self._script(keys=keys, args=args)
            self._pending = None
            if int(result[2]):
                self._garbage_log.log(logging.WARNING, "Repaired garbage in %s (written by someone else?):"
                                      " its flush_seq was not this worker's; the flush was merged",
                                      self.keys.worker(self.worker))
            # a resent flush predates the latest changes: at close they must go now, not next interval
            if fresh or not final:
                return int(result[0])

    tick = flush


def worker_id(crawler: Crawler) -> str:
    """This process's worker id: the scrapy-dist scheduler's, else one made once per crawler."""
    if (sched := get_scheduler(crawler)) is not None:
        return sched.worker_id
    if getattr(crawler, "_scrapy_dist_worker_id", None) is None:
        crawler._scrapy_dist_worker_id = make_worker_id()  # type: ignore[attr-defined]
    return crawler._scrapy_dist_worker_id  # type: ignore[attr-defined]


class RateMeter:
    """Rate of a growing counter over the last ``span`` seconds, from samples taken at each heartbeat."""

    def __init__(self, span: float = 60.0) -> None:
        self.span = span
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, value: float, now: float) -> None:
        self._samples.append((now, value))
        # keep one sample at or before the span's start, so the rate covers the whole span
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.span:
            self._samples.popleft()

    def per_minute(self) -> float:
        """Counter increase per minute over the samples kept (0 until two samples a second apart)."""
        if len(self._samples) < 2:
            return 0.0
        (t0, v0), (t1, v1) = self._samples[0], self._samples[-1]
        return max(0.0, (v1 - v0) * 60.0 / (t1 - t0)) if t1 - t0 >= 1.0 else 0.0


def error_count(stats: dict[str, Any]) -> int:
    """Errors in a worker's Scrapy stats: spider exceptions, download exceptions and 5xx/429 responses."""
    n = sum(int(stats.get(k, 0) or 0) for k in ("spider_exceptions/count", "downloader/exception_count"))
    for name, value in stats.items():
        code = name.removeprefix("downloader/response_status_count/")
        if code != name and (code.startswith("5") or code == "429"):
            n += int(value or 0)
    return n


def _count(text: str) -> int | None:
    ok = text.isascii() and text.isdigit() and len(text) <= 16 and int(text) <= MAX_COUNT
    return int(text) if ok else None


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's heartbeat HASH, every field typed and in range, ``None`` where it held nothing usable."""

    host: str = ""
    pid: int | None = None
    started: float | None = None
    pages: int | None = None
    items: int | None = None
    errors: int | None = None
    inflight: int | None = None
    prefetched: int | None = None  #: leased ahead of demand, not handed to the engine yet
    pages_per_min: float | None = None
    interval: float | None = None
    state: str = ""
    finish_reason: str = ""
    garbage: tuple[str, ...] = ()  #: names of fields that held garbage


#: The numbers of a worker's heartbeat HASH, in the order they are checked: bounds, or None for a count.
_NUMBERS: dict[str, tuple[float, float] | None] = {
    "pid": None, "started": (0.0, 1e11), "pages": None, "items": None, "errors": None, "inflight": None,
    "prefetched": None, "pages_per_min": (0.0, 1e12), "interval": (0.001, 86400.0)}


def parse_worker_hash(raw: Any) -> WorkerInfo:
    """The one parser of a worker's heartbeat HASH; :class:`RejectedEntry` only if ``raw`` is not a mapping. A
    garbage field becomes ``None``/empty and is named in ``garbage``; texts are cut, not made printable."""
    d = hash_fields(raw, "worker")
    state = d.get("state", "")
    garbage = [] if state in ("", RUNNING, CLOSED, "closing") else ["state"]
    values: dict[str, Any] = {}
    for name, bounds in _NUMBERS.items():
        text = d.get(name, "")
        values[name] = _count(text) if bounds is None else finite_float(text, *bounds)
        if text and values[name] is None:
            garbage.append(name)
    if (values["pid"] or 0) >= 2**32:
        values["pid"] = None
    return WorkerInfo(host=d.get("host", "")[:MAX_TEXT], state="" if garbage[:1] == ["state"] else state,
                      finish_reason=d.get("finish_reason", "")[:MAX_TEXT], garbage=tuple(garbage), **values)


def worker_state(info: dict[str, str], last_seen: float, now: float, default_interval: float) -> str:
    """``closed``, ``lost`` (unseen for :data:`LOST_AFTER_INTERVALS` heartbeat intervals) or ``running``."""
    if info.get("state") == CLOSED:
        return CLOSED
    interval = finite_float(str(info.get("interval") or ""), 0.001, 86400.0) or default_interval
    # a NaN last_seen is lost, not running
    return RUNNING if now - last_seen <= LOST_AFTER_INTERVALS * interval else LOST
