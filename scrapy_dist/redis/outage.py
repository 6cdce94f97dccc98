"""One outage policy for every background loop (frontier sync, seeds, monitors, item and cookie writers):
which errors mean "Redis is away", how long a loop waits, what is logged (docs/operations.md, "Outages"),
and :class:`BackgroundTask`, the one way such a loop runs through outages.

:func:`is_outage` names the errors that heal without a change to the crawl (no answer, ``LOADING``,
``READONLY``, ``MASTERDOWN``, ``OOM``, ``CLUSTERDOWN``, ``TRYAGAIN``, a rotated password, and the
``TypeError``/``AttributeError`` redis-py's asyncio client lets out when a connection is torn down under a
command). Each loop waits with its :class:`Backoff`; one :class:`Outage` per worker logs one WARNING and
one INFO per outage; :class:`CloseWatch` ends a close that has waited on Redis for
``SCHEDULER_SHUTDOWN_GRACE``. Time is a parameter (``now``, monotonic seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

import redis.exceptions

from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.settings import DistSettings
from scrapy_dist.utils import RateLimitedLog

__all__ = [
    "OUTAGE_ERRORS", "READ_ERRORS", "BackgroundTask", "Backoff", "CloseWatch", "LoopGuard", "Outage",
    "ToolOutage", "is_outage", "refusal",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
B = TypeVar("B", bound="BackgroundTask")

#: seconds between two cancellations of a task that did not stop (see :meth:`BackgroundTask.stop`)
STOP_RETRY = 0.5

#: What a client raises while Redis is down, restarting, failing over or full (``RedisClusterException``
#: is not a ``RedisError``; ``OSError`` covers socket errors a client lets through unwrapped).
OUTAGE_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,  # includes BusyLoadingError (LOADING) and AuthenticationError
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,  # includes MasterDownError
    redis.exceptions.TryAgainError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.RedisClusterException,
    ConnectionError,
    TimeoutError,
    asyncio.TimeoutError,  # not the builtin before Python 3.11
    OSError,
)


#: redis-py's connection modules: a TypeError/AttributeError raised in there is a torn connection
_REDIS_CONNECTION_FILES = (
    os.path.join("redis", "asyncio", "connection.py"), os.path.join("redis", "connection.py"),
)


def _torn_connection(exc: BaseException) -> bool:
    """A ``TypeError``/``AttributeError`` raised inside redis-py's connection code: a torn connection."""
    if not isinstance(exc, (TypeError, AttributeError)):
        return False
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(_REDIS_CONNECTION_FILES):
            return True
        tb = tb.tb_next
    return False


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` means "Redis is away for now" (wait and retry) rather than an error to report."""
    if isinstance(exc, OUTAGE_ERRORS) or _torn_connection(exc):
        return True
    # a script's write refused for lack of memory or on a replica heals by waiting, as the plain command
    what = refusal(exc) if isinstance(exc, redis.exceptions.ResponseError) else None
    return what is not None and not what.startswith("NOPERM")


#: Redis's own refusals, named as such: Redis answers, but will not take this write (yet)
_REFUSALS: tuple[tuple[type[BaseException], str], ...] = (
    (redis.exceptions.OutOfMemoryError, "OOM: Redis is at its maxmemory and refuses writes (free memory,"
     " raise maxmemory, or look for oversized values)"),
    (redis.exceptions.ReadOnlyError, "READONLY: this server is a replica and refuses writes (point"
     " REDIS_URL at the master, or wait for the failover)"),
    (redis.exceptions.NoPermissionError, "NOPERM: the Redis user lacks an ACL permission this write"
     " needs (grant it: see docs/security.md)"),
)


#: how a refusal reads inside a script's error reply (a write inside a Lua script refused by Redis)
_SCRIPT_REFUSALS = (("-OOM ", 0), ("-READONLY ", 1), ("-NOPERM ", 2))


def refusal(exc: BaseException) -> str | None:
    """What Redis refused (OOM, READONLY, NOPERM), raised by a command or by a write inside a script; None
    for anything else."""
    for kind, what in _REFUSALS:
        if isinstance(exc, kind):
            return what
    if isinstance(exc, redis.exceptions.ResponseError):
        text = str(exc)
        for mark, index in _SCRIPT_REFUSALS:
            if mark in text:
                return _REFUSALS[index][1]
    return None


def describe(exc: BaseException) -> str:
    """``ExceptionName: message`` on one line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Backoff:
    """Capped exponential backoff of one loop: ``first``, ``first * factor``, ... up to ``cap`` seconds."""

    def __init__(self, first: float = 0.1, cap: float = 5.0, factor: float = 2.0) -> None:
        if first <= 0 or cap < first or factor < 1:
            raise ValueError(f"Backoff needs 0 < first <= cap and factor >= 1, not {first}, {cap}, {factor}")
        self.first = first
        self.cap = cap
        self.factor = factor
        self.failures = 0

    def failed(self) -> float:
        """Count one more failure; returns how long to wait before the next attempt."""
        delay = min(self.cap, self.first * self.factor ** min(self.failures, 64))
        self.failures += 1
        return delay

    def reset(self) -> None:
        """The last attempt worked: the next failure waits ``first`` again."""
        self.failures = 0


_by_crawler: weakref.WeakKeyDictionary[Any, Outage] = weakref.WeakKeyDictionary()


class Outage:
    """Whether this worker sees Redis as away, shared by all its components: one WARNING when an outage
    starts, one INFO when it is over: at a :meth:`succeeded` call once every component that failed during
    it has succeeded since, or has not failed for ``stale`` seconds (longer than any loop's backoff cap).
    """

    def __init__(self, log: logging.Logger = logger, stale: float = 30.0) -> None:
        self.log = log
        self.stale = stale
        #: monotonic time the current outage started, ``None`` while Redis answers
        self.since: float | None = None
        #: how many outages this worker has seen
        self.count = 0
        #: failed calls during the current outage
        self.failures = 0
        self._failing: dict[str, float] = {}
        #: components that failed during the current outage, in the order they noticed it
        self._noticed: dict[str, None] = {}
        #: stops a close that waits on Redis for too long (:meth:`for_crawler` sets it)
        self.close_watch: CloseWatch | None = None

    @classmethod
    def for_crawler(cls, crawler: Any) -> Outage:
        """The one :class:`Outage` of ``crawler`` (created on first use); a fresh one for ``None``."""
        if crawler is None:
            return cls()
        found = _by_crawler.get(crawler)
        if found is None:
            found = _by_crawler[crawler] = cls()
            found.close_watch = CloseWatch(crawler)
        return found

    @property
    def down(self) -> bool:
        return self.since is not None

    def failed(self, exc: BaseException, now: float, component: str, detail: str = "") -> bool:
        """``component`` could not reach Redis (``exc`` is an outage error); returns whether this call
        started the outage (and logged its one WARNING). ``detail`` is appended to that warning."""
        self._failing[component] = now
        self._noticed.setdefault(component)
        self.failures += 1
        if self.close_watch is not None:
            self.close_watch.check(now)
        if self.since is not None:
            return False
        self.since = now
        self.count += 1
        refused = refusal(exc)
        if refused is not None:
            self.log.warning(
                "Redis refuses writes (%s; noticed by the %s): this worker keeps its work in memory and"
                " retries; one line will say when Redis takes writes again%s",
                refused, component, f" ({detail})" if detail else "",
            )
            return True
        self.log.warning(
            "Redis is unreachable (%s; noticed by the %s): this worker keeps its work in memory and retries;"
            " one line will say when Redis is back%s",
            describe(exc), component, f" ({detail})" if detail else "",
        )
        return True

    def succeeded(self, now: float, component: str) -> bool:
        """``component`` got an answer from Redis; returns whether this ended the outage (and logged)."""
        if self.close_watch is not None:
            self.close_watch.since = None
        if self.since is None:
            return False
        self._failing.pop(component, None)
        if any(now - last < self.stale for last in self._failing.values()):
            return False
        self.log.info(
            "Redis is reachable again after %.1fs (%d failed calls of the %s); the crawl continues",
            max(0.0, now - self.since), self.failures, ", ".join(self._noticed),
        )
        self.since = None
        self.failures = 0
        self._failing.clear()
        self._noticed.clear()
        return True

    def guard(
        self, component: str, backoff: Backoff | None = None, log: logging.Logger | None = None
    ) -> LoopGuard:
        """The view of one loop (named ``component`` in messages) onto this outage."""
        return LoopGuard(self, component, backoff or Backoff(), log or self.log)


class LoopGuard:
    """One background loop's side of the policy: report how each call to Redis went, learn how long to wait.

    An outage error goes to the shared :class:`Outage` (one WARNING per worker). Any other error is this
    loop's own: logged at ERROR at most once a minute per exception type, as one line for an error reply
    or a :class:`~scrapy_dist.exceptions.ScrapyDistError`, with the traceback for anything else (a bug).
    """

    def __init__(self, outage: Outage, component: str, backoff: Backoff, log: logging.Logger) -> None:
        self.outage = outage
        self.component = component
        self.backoff = backoff
        self.log = log
        self.errors = RateLimitedLog(log, period=60.0, burst=1)

    def failed(self, exc: BaseException, now: float, detail: str = "") -> float:
        """Report a failed call; returns how long to wait before the next attempt (seconds)."""
        if is_outage(exc):
            self.outage.failed(exc, now, self.component, detail)
        elif isinstance(exc, (redis.exceptions.RedisError, ScrapyDistError)):  # explained: one line
            what = "got an error from Redis" if isinstance(exc, redis.exceptions.RedisError) else "failed"
            refused = refusal(exc)
            self.errors.log(
                logging.ERROR, "The %s %s (%s); retrying", self.component, what,
                describe(exc) if refused is None else refused, key=type(exc).__name__, now=now,
            )
            # a close must not wait for ever on a write Redis keeps refusing
            if self.outage.close_watch is not None:
                self.outage.close_watch.check(now)
        else:
            self.errors.log(
                logging.ERROR, "The %s failed (%s)", self.component, describe(exc),
                key=type(exc).__name__, now=now, exc_info=exc,
            )
        return self.backoff.failed()

    def succeeded(self, now: float) -> None:
        """Report a call that Redis answered."""
        self.backoff.reset()
        self.outage.succeeded(now, self.component)


class BackgroundTask:
    """An asyncio task that repeats :meth:`step` until it returns ``False``, through outages and bugs.

    A step that raises is reported to the :class:`LoopGuard` and the task waits its backoff; a step rests
    with :meth:`rest`, which :meth:`wake` cuts short. :meth:`stop` sets :attr:`closing` and waits for the
    task; should the task end otherwise, :meth:`crashed` says so. A loop its caller drives (an async
    generator) iterates :meth:`turns` instead of calling :meth:`start`.
    """

    #: :meth:`stop` cancels the step in progress instead of letting it finish
    interrupt = False

    def __init__(self, guard: LoopGuard, clock: Callable[[], float] = time.monotonic) -> None:
        self.guard = guard
        self.clock = clock
        #: :meth:`stop` was called: the next step should end the loop (or drain, then end it)
        self.closing = False
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    async def step(self) -> Any:
        """One turn of the loop, its rest included: what :meth:`turns` yields; ``False`` or ``None`` ends
        the loop."""
        raise NotImplementedError

    def start(self: B) -> B:
        """Start the task on the running event loop (once); returns ``self``."""
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
        """Wait ``timeout`` seconds (``None``: without end) or until :meth:`wake`, whichever comes first; a
        wake since the last rest ends it at once."""
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        if not self._wakeup.is_set() and (timeout is None or timeout > 0):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout)
        self._wakeup.clear()

    async def stop(self) -> None:
        """Set :attr:`closing`, wake the task and wait until it has ended. With :attr:`interrupt`, the step
        in progress is cancelled, again every :data:`STOP_RETRY` seconds while the task runs on: on Python
        < 3.12 ``asyncio.wait_for`` (around every redis-py socket write) swallows a cancellation that
        arrives just as the write completes."""
        self.closing = True
        self.wake()
        task = self._task
        if task is None:
            return
        if not self.interrupt:
            with contextlib.suppress(Exception):
                await task
            return
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=STOP_RETRY)
        if not task.cancelled():
            task.exception()  # retrieved, so that asyncio does not report it at exit

    async def turns(self) -> AsyncGenerator[Any, None]:
        """The loop as an async generator of what each step returns (``False`` or ``None`` ends it)."""
        while True:
            try:
                out = await self.step()
            except Exception as exc:  # a bug or an outage must not end the loop: report, back off, go on
                await asyncio.sleep(self.failed(exc))
                continue
            if out is False or out is None:
                return
            yield out

    async def _run(self) -> None:
        async for _ in self.turns():
            pass

    def _ended(self, task: asyncio.Task[None]) -> None:
        if self.closing or task.cancelled():
            return
        self.crashed(task.exception())

    def crashed(self, exc: BaseException | None) -> None:
        """The task ended without :meth:`stop` (``exc``, or ``None`` if it returned)."""
        self.guard.log.critical(
            "The %s stopped unexpectedly (%s)", self.guard.component, describe(exc) if exc else "returned",
            exc_info=exc,
        )

    def failed(self, exc: BaseException, now: float | None = None, detail: str = "") -> float:
        """Report a failed call to the outage policy; returns the backoff to wait."""
        return self.guard.failed(exc, self.clock() if now is None else now, detail)

    def succeeded(self, now: float | None = None) -> None:
        """Report a call that Redis answered."""
        self.guard.succeeded(self.clock() if now is None else now)

    async def attempt(self, call: Awaitable[T]) -> T | None:
        """Await one call to Redis: reported either way; after a failure, the backoff and ``None``."""
        try:
            result = await call
        except Exception as exc:
            await asyncio.sleep(self.failed(exc))
            return None
        self.succeeded()
        return result


class CloseWatch:
    """Ends a worker's close that has waited on Redis for ``SCHEDULER_SHUTDOWN_GRACE`` seconds: once the
    crawler is closing and no call has reached Redis for the grace, :meth:`check` (called with every failed
    call) logs one ERROR and stops the Twisted reactor, as Scrapy does on a second SIGTERM."""

    def __init__(self, crawler: Any, grace: float | None = None) -> None:
        self._crawler = weakref.ref(crawler)
        self._grace = grace
        #: when a failed call was first seen during the close (reset by any answer from Redis)
        self.since: float | None = None
        self.stopped = False

    def closing(self) -> bool:
        """Whether the crawler is closing: a stop was asked for, or the engine is closing the spider."""
        crawler = self._crawler()
        if crawler is None:
            return False
        if getattr(crawler, "crawling", True) is False:
            return True
        slot = getattr(getattr(crawler, "engine", None), "_slot", None)
        return getattr(slot, "closing", None) is not None

    @property
    def grace(self) -> float:
        """``SCHEDULER_SHUTDOWN_GRACE``, at most ``SCHEDULER_LEASE_SECONDS`` (as the frontier's close)."""
        if self._grace is None:
            crawler = self._crawler()
            sched = DistSettings.for_crawler(crawler).scheduler if crawler is not None else None
            self._grace = min(sched.shutdown_grace, sched.lease_seconds) if sched is not None else 30.0
        return self._grace

    def check(self, now: float) -> bool:
        """A call failed at ``now``; returns whether this stopped the worker."""
        if self.stopped or not self.closing():
            return False
        if self.since is None:
            self.since = now
            return False
        if now - self.since < self.grace:
            return False
        self.stopped = True
        logger.error(
            "Closing: Redis has not answered for the %.0fs of SCHEDULER_SHUTDOWN_GRACE; stopping this worker"
            " without waiting for it. Its unwritten items and unacknowledged requests are not lost: the"
            " requests come back to the queue when their leases expire", now - self.since,
        )
        self.stop()
        return True

    def stop(self) -> None:
        """Stop the Twisted reactor (Scrapy's own forced shutdown); without one there is nothing to stop."""
        from scrapy.utils.reactor import is_reactor_installed

        if not is_reactor_installed():
            return
        from twisted.internet import reactor

        with contextlib.suppress(RuntimeError):  # already stopping
            reactor.stop()  # type: ignore[attr-defined,misc]


#: What a read of an operator tool may raise from Redis: the outage errors and any error reply
READ_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError,
)


class ToolOutage:
    """The same policy for an operator tool that reads Redis on demand (metrics exporter, dashboard): one
    WARNING when an outage starts, one INFO when a read works again. ``what`` names the tool."""

    def __init__(self, what: str, log: logging.Logger = logger) -> None:
        self.what = what
        self.log = log
        #: ``now`` of the first failed read of the current outage, ``None`` while Redis answers
        self.since: float | None = None
        self.failures = 0

    def failed(self, exc: BaseException, now: float) -> None:
        """A read failed with ``exc`` (an outage error, or another Redis error reply)."""
        self.failures += 1
        if self.since is not None:
            return
        self.since = now
        cause = "unreachable" if is_outage(exc) else "answering with an error"
        self.log.warning(
            "Redis is %s (%s): the %s keeps serving without the crawl's figures and tries again at each"
            " request; one line will say when Redis is back", cause, describe(exc), self.what,
        )

    def succeeded(self, now: float) -> None:
        """A read worked."""
        if self.since is None:
            return
        self.log.info("Redis is reachable again after %.1fs (%d failed reads); the %s shows the crawl again",
                      max(0.0, now - self.since), self.failures, self.what)
        self.since = None
        self.failures = 0
