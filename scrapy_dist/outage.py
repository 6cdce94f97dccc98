"""Interim outage policy (replaced by the outage branch's module at merge)."""

from __future__ import annotations

import logging
import time

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from scrapy_dist import connection

logger = logging.getLogger(__name__)

OUTAGE_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError, RedisTimeoutError, *connection.OUTAGE_ERRORS,
)


class Backoff:
    def __init__(self, first: float = 0.5, cap: float = 10.0) -> None:
        self.first, self.cap, self._next = first, cap, first

    def next(self) -> float:
        delay, self._next = self._next, min(self._next * 2, self.cap)
        return delay

    def reset(self) -> None:
        self._next = self.first


class Outage:
    def __init__(self) -> None:
        self.since: float | None = None

    def is_outage(self, exc: BaseException) -> bool:
        return isinstance(exc, OUTAGE_ERRORS)

    def failed(self, exc: BaseException, component: str) -> None:
        if self.since is None:
            self.since = time.monotonic()
            logger.warning("Redis is unreachable (%s: %s): retrying", type(exc).__name__, exc)

    def succeeded(self, component: str) -> None:
        if self.since is not None:
            logger.warning(
                "Redis is reachable again after %.1fs; the crawl continues", time.monotonic() - self.since
            )
            self.since = None
