"""Records for untrusted input that was refused (queue entries, seeds), and rate-limited logging of them.

A record is JSON: ``{"reason": ..., "detail": ..., "raw": ..., "raw_encoding": "utf-8"|"base64",
"at": <unix time>, "worker": <worker id>}`` where ``raw`` is the first 1 KiB of the refused bytes (as text
when they are UTF-8, else base64).
"""

from __future__ import annotations

import base64
import json
import logging
import time
from typing import Any

RAW_LIMIT = 1024


def rejection_record(reason: str, raw: bytes, worker: str, detail: str = "", now: float | None = None) -> str:
    """The JSON record pushed to a ``:rejected`` key."""
    head = raw[:RAW_LIMIT]
    try:
        text, enc = head.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        text, enc = base64.b64encode(head).decode("ascii"), "base64"
    return json.dumps(
        {
            "reason": reason,
            "detail": detail[:500],
            "raw": text,
            "raw_encoding": enc,
            "raw_bytes": len(raw),
            "at": time.time() if now is None else now,
            "worker": worker,
        }
    )


class RateLimitedLog:
    """Log at most ``burst`` messages per ``period`` seconds; count and summarise the rest."""

    def __init__(self, logger: logging.Logger, period: float = 60.0, burst: int = 5) -> None:
        self.logger = logger
        self.period = period
        self.burst = burst
        self._window_start = 0.0
        self._in_window = 0
        self._suppressed = 0

    def log(self, level: int, msg: str, *args: Any, now: float | None = None, **kwargs: Any) -> bool:
        """Log unless over the limit; returns whether it logged."""
        now = time.monotonic() if now is None else now
        if now - self._window_start >= self.period:
            if self._suppressed:
                self.logger.log(level, "%d similar messages were suppressed in the last %.0fs",
                                self._suppressed, self.period)
            self._window_start, self._in_window, self._suppressed = now, 0, 0
        if self._in_window < self.burst:
            self._in_window += 1
            self.logger.log(level, msg, *args, **kwargs)
            return True
        self._suppressed += 1
        return False
