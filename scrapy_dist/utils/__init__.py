"""Small shared helpers: :class:`RateLimitedLog` for repetitive messages, and scrapy-redis's text helpers."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class _Window:
    start: float
    logged: int = 0
    suppressed: int = 0


class RateLimitedLog:
    """Log at most ``burst`` messages per ``period`` seconds per ``key`` (by default all share one), then
    only count; a summary line says how many were left out once the next period starts."""

    def __init__(self, logger: logging.Logger, period: float = 60.0, burst: int = 5) -> None:
        self.logger, self.period, self.burst = logger, period, burst
        self._windows: dict[str, _Window] = {}

    @classmethod
    def once(cls, logger: logging.Logger) -> RateLimitedLog:
        """A log that says each key once and then only counts (until :meth:`reset`)."""
        return cls(logger, period=math.inf, burst=1)

    def log(self, level: int, msg: str, *args: Any, key: str = "", now: float | None = None,
            exc_info: Any = None) -> bool:
        now = time.monotonic() if now is None else now
        window = self._windows.setdefault(key, _Window(now))
        if now - window.start >= self.period:
            if window.suppressed:
                self.logger.log(level, "%d similar messages were suppressed in the last %.0fs",
                                window.suppressed, now - window.start)
            window.start, window.logged, window.suppressed = now, 0, 0
        if window.logged < self.burst:
            window.logged += 1
            self.logger.log(level, msg, *args, exc_info=exc_info)
            return True
        window.suppressed += 1
        return False

    def suppressed(self, key: str = "") -> int:
        return self._windows[key].suppressed if key in self._windows else 0

    def reset(self, key: str = "") -> None:
        """Forget ``key``: its next message is logged (e.g. a failure again after a recovery)."""
        self._windows.pop(key, None)

    def seen(self, key: str = "") -> bool:
        """Whether a message of ``key`` was logged (or counted) since the last :meth:`reset`."""
        return key in self._windows


def inc_stat(stats: Any, name: str, count: int = 1) -> None:
    """``stats.inc_value(name, count)`` for a component that may have no stats collector."""
    if stats is not None:
        stats.inc_value(name, count)


def finite_float(text: str, low: float = -2.0**53, high: float = 2.0**53) -> float | None:
    """``text`` (read from Redis: anyone may have written it) as a float within [low, high], else None."""
    with contextlib.suppress(ValueError):
        if math.isfinite(value := float(text)) and low <= value <= high:
            return value
    return None


def bytes_to_str(s: Any, encoding: str = "utf-8") -> Any:
    return s.decode(encoding) if isinstance(s, (bytes, bytearray)) else s


def is_dict(string_content: Any) -> bool:
    """Whether ``string_content`` parses as JSON (any JSON value, as in scrapy-redis, not only an object)."""
    try:
        json.loads(string_content)
    except (ValueError, TypeError):
        return False
    return True


def convert_bytes_to_str(data: Any, encoding: str = "utf-8") -> Any:
    """``data`` with bytes decoded: a bytes value, or the keys and values of a dict (recursively)."""
    return ({convert_bytes_to_str(k, encoding): convert_bytes_to_str(v, encoding) for k, v in data.items()}
            if isinstance(data, dict) else bytes_to_str(data, encoding))
