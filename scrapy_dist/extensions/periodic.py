"""A coroutine run every few seconds on the reactor's asyncio loop, that survives Redis outages."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from scrapy_dist.redis.outage import Backoff, Outage

#: seconds between two cancellations of a task that did not stop (see :meth:`PeriodicTask.stop`)
STOP_RETRY = 0.5


class PeriodicTask:
    """Await ``func()`` every ``interval`` seconds until :meth:`stop`.

    A failing call never ends the task. Failures follow the outage policy (:mod:`scrapy_dist.redis.outage`):
    an outage is reported to the worker's shared :class:`Outage` (one warning per worker, not per
    monitor), anything else is logged at ERROR at most once a minute per exception type. ``what`` names
    the task in those messages.
    """

    def __init__(
        self,
        func: Callable[[], Awaitable[object]],
        interval: float,
        what: str,
        logger: logging.Logger,
        outage: Outage | None = None,
    ) -> None:
        self.func = func
        self.interval = interval
        self.what = what
        self.logger = logger
        # the task runs every interval whatever happens: the backoff only names the policy's wait
        every = max(interval, 0.01)
        self.guard = (outage or Outage()).guard(what, Backoff(every, every), logger)
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def start(self) -> PeriodicTask:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def stop(self) -> None:
        """Stop the task and wait until it has: a stop flag, then a cancellation, sent again every
        :data:`STOP_RETRY` seconds while the task runs on.

        One cancellation is not enough: on Python < 3.12, ``asyncio.wait_for`` (around every redis-py
        socket write) swallows a cancellation that arrives just as the write completes, and the loop would
        go on for ever while the spider's close waits for it."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping = True
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=STOP_RETRY)
        if not task.cancelled():
            task.exception()  # retrieved, so that asyncio does not report it at exit

    async def _run(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.interval)
            if self._stopping:
                return
            await self.run_once()

    async def run_once(self, now: float | None = None) -> bool:
        """One call with the task's error handling; returns whether it succeeded."""
        try:
            await self.func()
        except Exception as exc:
            self.guard.failed(exc, time.monotonic() if now is None else now)
            return False
        self.guard.succeeded(time.monotonic() if now is None else now)
        return True
