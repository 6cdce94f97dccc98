"""A coroutine run every few seconds on the reactor's asyncio loop, that survives Redis outages."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from scrapy_dist.outage import Backoff, Outage


class PeriodicTask:
    """Await ``func()`` every ``interval`` seconds until :meth:`stop`.

    A failing call never ends the task. Failures follow the outage policy (:mod:`scrapy_dist.outage`):
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

    def start(self) -> PeriodicTask:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def stop(self) -> None:
        """Cancel the task and wait until it has stopped."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
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
