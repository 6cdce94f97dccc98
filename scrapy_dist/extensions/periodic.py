"""A coroutine run every few seconds on the reactor's asyncio loop, that survives Redis outages."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from scrapy_dist.redis.outage import BackgroundTask, Backoff, Outage


class PeriodicTask(BackgroundTask):
    """Await ``func()`` every ``interval`` seconds until :meth:`stop`, which cancels a call in progress.

    A failing call never ends the task. Failures follow the outage policy (:mod:`scrapy_dist.redis.outage`):
    an outage is reported to the worker's shared :class:`Outage` (one warning per worker, not per
    monitor), anything else is logged at ERROR at most once a minute per exception type. ``what`` names
    the task in those messages.
    """

    interrupt = True

    def __init__(
        self,
        func: Callable[[], Awaitable[object]],
        interval: float,
        what: str,
        logger: logging.Logger,
        outage: Outage | None = None,
    ) -> None:
        # the task runs every interval whatever happens: the backoff only names the policy's wait
        every = max(interval, 0.01)
        super().__init__((outage or Outage()).guard(what, Backoff(every, every), logger))
        self.func = func
        self.interval = interval
        self.what = what
        self.logger = logger

    async def step(self) -> bool:
        await self.rest(self.interval)
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
