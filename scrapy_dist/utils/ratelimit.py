"""One rate-limited logger for every repetitive message: a rejected seed, a skipped cookie record, an error a
background loop keeps hitting. Each kind of message (a *key*) is logged at most ``burst`` times per
``period`` seconds and then only counted; a summary line says how many were left out once the next period
starts. ``RateLimitedLog.once(logger)`` logs each key once, then only counts (``reset(key)`` re-arms it).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

__all__ = ["RateLimitedLog"]


class _Window:
    __slots__ = ("start", "logged", "suppressed")

    def __init__(self, start: float) -> None:
        self.start = start
        self.logged = 0
        self.suppressed = 0


class RateLimitedLog:
    """Log at most ``burst`` messages per ``period`` seconds per key; count and summarise the rest.

    ``now`` (monotonic seconds) may be passed for tests; ``key`` separates kinds of messages (by default
    all share one budget).
    """

    def __init__(self, logger: logging.Logger, period: float = 60.0, burst: int = 5) -> None:
        self.logger = logger
        self.period = period
        self.burst = burst
        self._windows: dict[str, _Window] = {}

    @classmethod
    def once(cls, logger: logging.Logger) -> RateLimitedLog:
        """A log that says each key once and then only counts (until :meth:`reset`)."""
        return cls(logger, period=math.inf, burst=1)

    def log(
        self, level: int, msg: str, *args: Any, key: str = "", now: float | None = None, exc_info: Any = None
    ) -> bool:
        """Log unless over the limit; returns whether it logged."""
        now = time.monotonic() if now is None else now
        window = self._windows.get(key)
        if window is None:
            window = self._windows[key] = _Window(now)
        elif now - window.start >= self.period:
            if window.suppressed:
                self.logger.log(
                    level, "%d similar messages were suppressed in the last %.0fs", window.suppressed,
                    now - window.start,
                )
            window.start, window.logged, window.suppressed = now, 0, 0
        if window.logged < self.burst:
            window.logged += 1
            self.logger.log(level, msg, *args, exc_info=exc_info)
            return True
        window.suppressed += 1
        return False

    def suppressed(self, key: str = "") -> int:
        """How many messages of ``key`` were left out in the current period."""
        window = self._windows.get(key)
        return window.suppressed if window is not None else 0

    def reset(self, key: str = "") -> None:
        """Forget ``key``: its next message is logged (e.g. a failure again after a recovery)."""
        self._windows.pop(key, None)

    def seen(self, key: str = "") -> bool:
        """Whether a message of ``key`` was logged (or counted) since the last :meth:`reset`."""
        return key in self._windows
