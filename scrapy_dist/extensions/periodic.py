"""A coroutine run every few seconds on the reactor's asyncio loop, that survives Redis outages."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from scrapy_dist.connection import OUTAGE_ERRORS

# Any Redis error, and a cluster no node of which answers (RedisClusterException is not a RedisError).
_REDIS_DOWN: tuple[type[BaseException], ...] = (RedisError, *OUTAGE_ERRORS)


class PeriodicTask:
    """Await ``func()`` every ``interval`` seconds until :meth:`stop`.

    A failing call never ends the task: Redis errors are logged once per outage (and the recovery once),
    anything else is logged with its traceback once per exception type.
    """

    def __init__(
        self, func: Callable[[], Awaitable[object]], interval: float, what: str, logger: logging.Logger
    ) -> None:
        self.func = func
        self.interval = interval
        self.what = what
        self.logger = logger
        self._task: asyncio.Task[None] | None = None
        self._down = False
        self._bugs: set[type[BaseException]] = set()

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

    async def run_once(self) -> bool:
        """One call with the task's error handling; returns whether it succeeded."""
        try:
            await self.func()
        except _REDIS_DOWN as exc:
            if not self._down:
                self._down = True
                self.logger.warning(
                    "%s: Redis unavailable (%s: %s); retrying", self.what, type(exc).__name__, exc
                )
            return False
        except Exception as exc:
            if type(exc) not in self._bugs:
                self._bugs.add(type(exc))
                self.logger.exception("%s failed; retrying every %.1fs", self.what, self.interval)
            return False
        if self._down:
            self._down = False
            self.logger.info("%s: Redis is reachable again", self.what)
        return True
