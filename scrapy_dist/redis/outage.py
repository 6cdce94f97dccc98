"""The one outage policy of every background loop (docs/operations.md, "Outages"): a failed call backs its
loop off (:class:`Backoff`, 0.1 s doubling to 5 s); once a component that had failed gets an answer, the
worker's :class:`Outage` ends every loop's wait at once (only such a component wakes them: in a partial
outage, one extra call per recovery, not per answer). :class:`BackgroundTask` runs a loop,
:class:`BatchWriter` writes items and cookies; ``now`` is monotonic seconds."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
import weakref
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import redis.exceptions
from redis.backoff import ExponentialBackoff
from scrapy.utils.reactor import is_reactor_installed

from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.settings import DistSettings
from scrapy_dist.utils import RateLimitedLog

logger = logging.getLogger(__name__)
T = TypeVar("T")
B = TypeVar("B", bound="BackgroundTask")

#: What a client raises while Redis is down, restarting, failing over or full (ConnectionError includes
#: LOADING and a rotated password; asyncio's TimeoutError is not the builtin before Python 3.11).
OUTAGE_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError, redis.exceptions.ReadOnlyError, redis.exceptions.OutOfMemoryError,
    redis.exceptions.RedisClusterException, ConnectionError, TimeoutError, asyncio.TimeoutError, OSError)
_REDIS_CONNECTION_FILES = tuple(os.path.join("redis", *p, "connection.py") for p in ((), ("asyncio",)))


def _torn_connection(exc: BaseException) -> bool:
    """A ``TypeError``/``AttributeError`` raised in redis-py's connection code: a torn-down connection."""
    tb = exc.__traceback__ if isinstance(exc, (TypeError, AttributeError)) else None
    while tb is not None and not tb.tb_frame.f_code.co_filename.endswith(_REDIS_CONNECTION_FILES):
        tb = tb.tb_next
    return tb is not None


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` means "Redis is away for now" (wait and retry), OOM and READONLY included."""
    return isinstance(exc, OUTAGE_ERRORS) or _torn_connection(exc) or (
        (what := refusal(exc)) is not None and not what.startswith("NOPERM"))


#: Redis answers, but will not take this write (yet): the error, and its mark in a script's error reply
_REFUSALS: tuple[tuple[type[BaseException], str, str], ...] = (
    (redis.exceptions.OutOfMemoryError, "-OOM ", "OOM: Redis is at its maxmemory and refuses writes (free"
     " memory, raise maxmemory, or look for oversized values)"),
    (redis.exceptions.ReadOnlyError, "-READONLY ", "READONLY: this server is a replica and refuses writes"
     " (point REDIS_URL at the master, or wait for the failover)"),
    (redis.exceptions.NoPermissionError, "-NOPERM ", "NOPERM: the Redis user lacks an ACL permission this"
     " write needs (grant it: see docs/security.md)"))


def refusal(exc: BaseException) -> str | None:
    """What Redis refused (OOM, READONLY, NOPERM) to a command or a script's write; None for anything else."""
    text = str(exc) if isinstance(exc, redis.exceptions.ResponseError) else ""
    return next((what for kind, mark, what in _REFUSALS if isinstance(exc, kind) or mark in text), None)


def describe(exc: BaseException) -> str:
    """``ExceptionName: message`` on one line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Backoff(ExponentialBackoff):
    """One loop's capped exponential backoff: ``first``, twice that, ... up to ``cap`` seconds."""

    def __init__(self, first: float = 0.1, cap: float = 5.0) -> None:
        if first <= 0 or cap < first:
            raise ValueError(f"Backoff needs 0 < first <= cap, not {first}, {cap}")
        super().__init__(cap, first)
        self.failures = 0

    def failed(self) -> float:
        self.failures += 1
        return self.compute(min(self.failures - 1, 64))

    def reset(self) -> None:
        self.failures = 0


class Outage:
    """Whether this worker sees Redis as away, shared by its components: one WARNING when an outage starts,
    one INFO when every component that failed has succeeded since or not failed for ``stale`` seconds. A
    crawler's (:meth:`for_crawler`) also stops a close that has waited on Redis for
    ``SCHEDULER_SHUTDOWN_GRACE`` seconds."""

    _by_crawler: ClassVar[weakref.WeakKeyDictionary[Any, Outage]] = weakref.WeakKeyDictionary()

    def __init__(self, log: logging.Logger = logger, stale: float = 30.0, crawler: Any = None) -> None:
        self.log, self.stale = log, stale
        self.since: float | None = None  # when the current outage started; None while Redis answers
        self.count = self.failures = 0  # outages seen; failed calls during the current one
        self._failing: dict[str, float] = {}
        self._noticed: dict[str, None] = {}  # components that failed during it, in order
        self._crawler: Callable[[], Any] = weakref.ref(crawler) if crawler is not None else lambda: None
        self.closing_since: float | None = None  # first failed call during a close (reset by any answer)
        self.stopped = False
        self.loops: weakref.WeakSet[BackgroundTask] = weakref.WeakSet()  # woken when Redis answers again

    @classmethod
    def for_crawler(cls, crawler: Any) -> Outage:
        """The one :class:`Outage` of ``crawler`` (created on first use); a fresh one for ``None``."""
        return cls() if crawler is None else cls._by_crawler.setdefault(crawler, cls(crawler=crawler))

    @property
    def down(self) -> bool:
        return self.since is not None

    def failed(self, exc: BaseException, now: float, component: str, detail: str = "") -> bool:
        """``component`` could not reach Redis; returns whether this started the outage (and logged)."""
        self._failing[component] = now
        self._noticed.setdefault(component)
        self.failures += 1
        self.check_close(now)
        if self.since is not None:
            return False
        self.since, self.count = now, self.count + 1
        refused = refusal(exc)
        what, back = ("refuses writes", "takes writes again") if refused else ("is unreachable", "is back")
        self.log.warning("Redis %s (%s; noticed by the %s): this worker keeps its work in memory and"
                         " retries; one line will say when Redis %s%s", what, refused or describe(exc),
                         component, back, f" ({detail})" if detail else "")
        return True

    def succeeded(self, now: float, component: str) -> bool:
        """``component`` got an answer from Redis; returns whether this ended the outage (and logged)."""
        self.closing_since = None
        if self.since is None:
            return False
        if self._failing.pop(component, None) is not None:  # it had failed: Redis is back (for it)
            for loop in list(self.loops):
                loop.recovered()
        if any(now - last < self.stale for last in self._failing.values()):
            return False
        self.log.info("Redis is reachable again after %.1fs (%d failed calls of the %s); the crawl continues",
                      max(0.0, now - self.since), self.failures, ", ".join(self._noticed))
        self.since, self.failures, self._failing, self._noticed = None, 0, {}, {}
        return True

    def closing(self) -> bool:
        """Whether the crawler is closing: a stop was asked for, or the engine is closing the spider."""
        crawler = self._crawler()
        if crawler is None or getattr(crawler, "crawling", True) is False:
            return crawler is not None
        slot = getattr(getattr(crawler, "engine", None), "_slot", None)
        return getattr(slot, "closing", None) is not None

    @functools.cached_property
    def grace(self) -> float:
        """``SCHEDULER_SHUTDOWN_GRACE``, at most ``SCHEDULER_LEASE_SECONDS`` (as the frontier's close)."""
        sched = DistSettings.for_crawler(self._crawler()).scheduler
        return min(sched.shutdown_grace, sched.lease_seconds)

    def check_close(self, now: float) -> bool:
        """A call failed at ``now``; returns whether this stopped the worker (its close waited too long)."""
        if self.stopped or not self.closing():
            return False
        if self.closing_since is None:
            self.closing_since = now
            return False
        if now - self.closing_since < self.grace:
            return False
        self.stopped = True
        logger.error("Closing: Redis has not answered for the %.0fs of SCHEDULER_SHUTDOWN_GRACE; stopping"
                     " this worker without waiting for it. Its unwritten items and unacknowledged requests"
                     " are not lost: the requests come back to the queue when their leases expire",
                     now - self.closing_since)
        if is_reactor_installed():  # Scrapy's own forced shutdown
            from twisted.internet import reactor
            with contextlib.suppress(RuntimeError):  # already stopping
                reactor.stop()  # type: ignore[attr-defined,misc]
        return True

    def guard(self, component: str, backoff: Backoff | None = None,
              log: logging.Logger | None = None) -> LoopGuard:
        return LoopGuard(self, component, backoff or Backoff(), log or self.log)


class LoopGuard:
    """One loop's side of the policy: an outage goes to the shared :class:`Outage`; any other error is
    logged at ERROR at most once a minute per type (with the traceback for a bug)."""

    def __init__(self, outage: Outage, component: str, backoff: Backoff, log: logging.Logger) -> None:
        self.outage, self.component, self.backoff, self.log = outage, component, backoff, log
        self.errors = RateLimitedLog(log, period=60.0, burst=1)

    def failed(self, exc: BaseException, now: float, detail: str = "") -> float:
        """Report a failed call; returns how long to wait before the next attempt (seconds)."""
        if is_outage(exc):
            self.outage.failed(exc, now, self.component, detail)
        elif isinstance(exc, (redis.exceptions.RedisError, ScrapyDistError)):  # explained: one line
            what = "got an error from Redis" if isinstance(exc, redis.exceptions.RedisError) else "failed"
            self.errors.log(logging.ERROR, "The %s %s (%s); retrying", self.component, what,
                            refusal(exc) or describe(exc), key=type(exc).__name__, now=now)
            self.outage.check_close(now)
        else:
            self.errors.log(logging.ERROR, "The %s failed (%s)", self.component, describe(exc),
                            key=type(exc).__name__, now=now, exc_info=exc)
        return self.backoff.failed()

    def succeeded(self, now: float) -> None:
        self.backoff.reset()
        self.outage.succeeded(now, self.component)


class BackgroundTask:
    """An asyncio task that repeats :meth:`step` until it returns ``False``, through outages and bugs: a
    step that raises is reported to the :class:`LoopGuard` and the task waits its backoff. A loop its caller
    drives iterates :meth:`turns` instead of calling :meth:`start`."""

    interrupt = False  #: :meth:`stop` cancels the step in progress instead of letting it finish

    def __init__(self, guard: LoopGuard, clock: Callable[[], float] = time.monotonic) -> None:
        self.guard, self.clock = guard, clock
        self.closing = False  # stop() was called: the next step ends the loop (or drains, then ends it)
        self._wakeup: asyncio.Event | None = None
        self._recovery: asyncio.Event | None = None  # set while back_off() waits
        guard.outage.loops.add(self)
        self._task: asyncio.Task[None] | None = None

    async def step(self) -> Any:
        """One turn of the loop, its rest included; ``False`` or ``None`` ends it."""
        raise NotImplementedError

    def start(self: B) -> B:
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())
            self._task.add_done_callback(self._ended)
        return self

    def wake(self) -> None:
        """End the current :meth:`rest` now (new work, or a test that moved the clock)."""
        if self._wakeup is not None:
            self._wakeup.set()

    async def rest(self, timeout: float | None) -> None:
        """Wait ``timeout`` seconds (``None``: without end) or until :meth:`wake` (also an earlier one)."""
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        if not self._wakeup.is_set() and (timeout is None or timeout > 0):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout)
        self._wakeup.clear()

    async def back_off(self, delay: float) -> None:
        """Wait ``delay`` seconds after a failed call, or until :meth:`recovered`."""
        self._recovery = asyncio.Event()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._recovery.wait(), delay)
        self._recovery = None

    def recovered(self) -> None:
        """Redis answered a component of this worker that had failed: a loop backing off tries again now."""
        if self._recovery is not None:
            self._recovery.set()

    async def stop(self) -> None:
        """Set :attr:`closing`, wake the task and wait for its end (with :attr:`interrupt`: cancel it)."""
        self.closing = True
        self.wake()
        if (task := self._task) is not None and not self.interrupt:
            with contextlib.suppress(Exception):
                await task
        elif task is not None:
            while not task.done():  # again: Python < 3.12 may swallow a cancellation (asyncio.wait_for)
                task.cancel()
                await asyncio.wait({task}, timeout=0.5)
            if not task.cancelled():
                task.exception()  # retrieved, so that asyncio does not report it at exit

    async def turns(self) -> AsyncGenerator[Any, None]:
        while True:
            try:
                out = await self.step()
            except Exception as exc:  # a bug or an outage must not end the loop: report, back off, go on
                await self.back_off(self.failed(exc))
                continue
            if out is False or out is None:
                return
            yield out

    async def _run(self) -> None:
        async for _ in self.turns():
            pass

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not (self.closing or task.cancelled()):
            self.crashed(task.exception())

    def crashed(self, exc: BaseException | None) -> None:
        """The task ended without :meth:`stop` (``exc``, or ``None`` if it returned)."""
        self.guard.log.critical("The %s stopped unexpectedly (%s)", self.guard.component,
                                describe(exc) if exc else "returned", exc_info=exc)

    def failed(self, exc: BaseException, now: float | None = None, detail: str = "") -> float:
        return self.guard.failed(exc, self.clock() if now is None else now, detail)

    def succeeded(self, now: float | None = None) -> None:
        self.guard.succeeded(self.clock() if now is None else now)

    async def attempt(self, call: Awaitable[T]) -> T | None:
        """Await one call to Redis, reported either way; after a failure, the backoff and ``None``."""
        try:
            result = await call
        except Exception as exc:
            await self.back_off(self.failed(exc))
            return None
        self.succeeded()
        return result


#: What a call to Redis may raise when it does not answer (RedisClusterException is not a RedisError)
READ_ERRORS = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError)


class ToolOutage:
    """The policy of an operator tool that reads Redis on demand (metrics exporter, dashboard)."""

    def __init__(self, what: str, log: logging.Logger = logger) -> None:
        self.what, self.log = what, log
        self.since: float | None = None
        self.failures = 0

    def failed(self, exc: BaseException, now: float) -> None:
        """A read failed with ``exc`` (an outage error, or another Redis error reply)."""
        self.failures += 1
        if self.since is None:
            self.since = now
            self.log.warning("Redis is %s (%s): the %s keeps serving without the crawl's figures and tries"
                             " again at each request; one line will say when Redis is back",
                             "unreachable" if is_outage(exc) else "answering with an error", describe(exc),
                             self.what)

    def succeeded(self, now: float) -> None:
        if self.since is not None:
            self.log.info("Redis is reachable again after %.1fs (%d failed reads); the %s shows the crawl"
                          " again", max(0.0, now - self.since), self.failures, self.what)
        self.since, self.failures = None, 0


@dataclass(eq=False)
class _Batch(Generic[T]):
    """Up to ``batch_size`` entries and the future their writers wait on."""

    done: asyncio.Future[None]
    first_at: float
    entries: list[T] = field(default_factory=list)
    sealed: bool = False  # taken by a write (in progress or retried): nothing may join it any more


class BatchWriter(BackgroundTask, Generic[T]):
    """Writes entries with ``write(entries)``, in order, one round trip at a time: a batch when full or
    ``flush_interval`` s after its first entry. An outage or error reply is retried with the backoff; any
    other exception (a bug in ``write``) fails those entries. ``on_failure(exc)`` hears of every failure."""

    def __init__(self, write: Callable[[list[T]], Awaitable[None]], *, guard: LoopGuard | None = None,
                 batch_size: int = 1000, flush_interval: float = 1.0, max_batches: int = 16,
                 on_failure: Callable[[BaseException], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(guard or Outage().guard("batch writer"), clock)
        self.write, self.batch_size, self.flush_interval = write, batch_size, flush_interval
        self.max_batches, self.on_failure = max(1, max_batches), on_failure
        self._batches: deque[_Batch[T]] = deque()
        self._retry_at: float | None = None  # after a failure: no attempt before then

    def add(self, entry: T) -> asyncio.Future[None]:
        """Buffer ``entry``; the future resolves once it is written (starts the writer task if needed)."""
        if self.closing:
            raise RuntimeError("BatchWriter.add() called after close()")
        self.start()
        batches = self._batches
        if not batches or batches[-1].sealed or len(batches[-1].entries) >= self.batch_size:
            batches.append(_Batch(asyncio.get_running_loop().create_future(), self.clock()))
            self.wake()  # a new batch starts the wait for its interval, or completes a full one
        batches[-1].entries.append(entry)
        return batches[-1].done

    def pending(self) -> Iterator[T]:
        """Every entry not yet known to be written, oldest first (those being written included)."""
        return (entry for batch in self._batches for entry in batch.entries)

    @property
    def buffered(self) -> int:
        return sum(len(b.entries) for b in self._batches)

    def due_in(self, now: float) -> float | None:
        """Seconds until the next write is due (``0``: now), or ``None`` with nothing buffered."""
        if not self._batches:
            return None
        if self._retry_at is not None and now < self._retry_at:
            return self._retry_at - now
        first = self._batches[0]
        due_now = self.closing or first.sealed or len(first.entries) >= self.batch_size
        return 0.0 if due_now else max(0.0, first.first_at + self.flush_interval - now)

    def recovered(self) -> None:
        if self._retry_at is not None:
            self._retry_at = None
            self.wake()

    async def close(self) -> None:
        """Write everything buffered (through an outage), then stop."""
        self._retry_at = None
        await self.stop()

    async def step(self) -> bool:
        if (wait := self.due_in(self.clock())) is None and self.closing:
            return False
        await (self.rest(wait) if wait is None or wait > 0 else self.flush_once())
        return True

    async def flush_once(self) -> bool:
        """One write of what is due (up to ``max_batches`` batches); returns whether it worked."""
        taken = list(self._batches)[: self.max_batches]
        for batch in taken:
            batch.sealed = True
        try:
            await self.write([entry for batch in taken for entry in batch.entries])
        except asyncio.CancelledError:
            for batch in self._batches:
                batch.done.cancel()
            raise
        except Exception as exc:
            if self.on_failure is not None:
                self.on_failure(exc)
            delay = self.failed(exc)
            if is_outage(exc) or isinstance(exc, redis.exceptions.RedisError):
                self._retry_at = self.clock() + delay  # keep everything, try again after the backoff
            else:
                for batch in taken:  # a bug in the write function: fail these rather than retry for ever
                    self._batches.popleft()
                    batch.done.set_exception(exc)
            return False
        self._retry_at = None
        self.succeeded()
        for batch in taken:
            self._batches.popleft()
            if not batch.done.done():
                batch.done.set_result(None)
        return True
