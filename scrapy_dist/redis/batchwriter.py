"""A background writer that gathers entries into batches and writes them to Redis one round trip at a time:
what the item pipeline and the shared cookie jar both need.

One task writes batches in the order their entries were added: a batch when it is full or
``flush_interval`` seconds after its first entry, with what else is buffered by then (up to
``max_batches``, so a backlog after an outage drains in bounded round trips). :meth:`BatchWriter.add`
returns a future resolved once the entry is in Redis. An outage or an error reply is retried with capped
backoff (:class:`~scrapy_dist.redis.outage.BackgroundTask`) and nothing buffered is dropped; any other
exception (a bug in the write function) fails the batches' futures and the writer goes on.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from typing import Generic, TypeVar

import redis.exceptions

from scrapy_dist.redis.outage import BackgroundTask, LoopGuard, Outage, is_outage

__all__ = ["BatchWriter"]

T = TypeVar("T")


class _Batch(Generic[T]):
    """Up to ``batch_size`` entries and the future their writers wait on."""

    __slots__ = ("entries", "done", "first_at", "sealed")

    def __init__(self, loop: asyncio.AbstractEventLoop, now: float) -> None:
        self.entries: list[T] = []
        self.done: asyncio.Future[None] = loop.create_future()
        self.first_at = now
        #: taken by a write (in progress or being retried): nothing may join it any more
        self.sealed = False


class BatchWriter(BackgroundTask, Generic[T]):
    """Buffer entries and write them with ``write(entries)`` (one round trip) in the background.

    ``on_failure(exc)`` is called for every failed attempt (for a stat). ``clock`` is monotonic seconds;
    tests may pass their own and call :meth:`wake` after moving it.
    """

    def __init__(
        self,
        write: Callable[[list[T]], Awaitable[None]],
        *,
        guard: LoopGuard | None = None,
        batch_size: int = 1000,
        flush_interval: float = 1.0,
        max_batches: int = 16,
        on_failure: Callable[[BaseException], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        super().__init__(guard or Outage().guard("batch writer"), clock)
        self.write = write
        self.batch_size = batch_size
        self.flush_interval = flush_interval
        self.max_batches = max(1, max_batches)
        self.on_failure = on_failure
        self._batches: deque[_Batch[T]] = deque()
        #: the writer is waiting ``_retry_at`` (monotonic) before the next attempt after a failure
        self._retry_at: float | None = None

    # -- adding -----------------------------------------------------------------------------------
    def add(self, entry: T) -> asyncio.Future[None]:
        """Buffer ``entry``; the future resolves once it is written (starts the writer task if needed)."""
        if self.closing:
            raise RuntimeError("BatchWriter.add() called after close()")
        self.start()
        now = self.clock()
        if not self._batches or self._batches[-1].sealed or len(self._batches[-1].entries) >= self.batch_size:
            self._batches.append(_Batch(asyncio.get_running_loop(), now))
            # the writer sleeps with nothing to do or waits for the interval of the first batch: a new
            # batch either starts that wait or completes a full one
            self.wake()
        batch = self._batches[-1]
        batch.entries.append(entry)
        return batch.done

    def pending(self) -> Iterator[T]:
        """Every entry not yet known to be written, oldest first (those being written included)."""
        for batch in self._batches:
            yield from batch.entries

    @property
    def buffered(self) -> int:
        """How many entries wait to be written (or are being written)."""
        return sum(len(b.entries) for b in self._batches)

    # -- when to write (pure: takes ``now``) -------------------------------------------------------
    def due_in(self, now: float) -> float | None:
        """Seconds until the next write is due (``0``: now), or ``None`` with nothing buffered."""
        if not self._batches:
            return None
        if self._retry_at is not None and now < self._retry_at:
            return self._retry_at - now
        first = self._batches[0]
        if self.closing or first.sealed or len(first.entries) >= self.batch_size:
            return 0.0
        return max(0.0, first.first_at + self.flush_interval - now)

    # -- the task ---------------------------------------------------------------------------------
    #: look again at what is due (after new entries, or a test moving the clock)
    kick = BackgroundTask.wake

    async def close(self) -> None:
        """Write everything buffered (waiting through a Redis outage), then stop the task."""
        self._retry_at = None
        await self.stop()

    async def step(self) -> bool:
        wait = self.due_in(self.clock())
        if wait is None and self.closing:
            return False
        if wait is None or wait > 0:
            await self.rest(wait)
        else:
            await self.flush_once()
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
                # Redis answered with an error or is away: keep everything, try again after the backoff
                self._retry_at = self.clock() + delay
                return False
            # a bug in the write function: fail these entries rather than retry them forever
            for batch in taken:
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
