"""The crawl-wide control flags in ``{spider}:control`` (a HASH), read and written by the scheduler, the
monitors and ``scrapy-dist pause|resume``.

Fields:

* ``paused`` -- ``"1"`` while the crawl is paused: every worker's frontier sync sees it and stops leasing
  and handing out requests (``paused_by`` = ``cli`` or ``errormonitor``, ``paused_at`` = server time);
* ``close`` / ``close_at`` -- a crawl-wide decision to close every worker with reason ``close``
  (``finished`` from the :class:`~scrapy_dist.extensions.IdleMonitor`, ``error_threshold`` from the
  :class:`~scrapy_dist.extensions.ErrorMonitor`). A worker honours it only if it was set after the worker
  started (server time), so workers started later for a new run of the crawl are not closed by an old
  decision;
* ``errors_tripped_at`` -- when the error monitor last passed its threshold (one action per window).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class ControlState:
    """The control flags as read from Redis."""

    paused: bool = False
    paused_by: str = ""
    close: str = ""
    close_at: float | None = None

    @classmethod
    def from_hash(cls, raw: dict[Any, Any]) -> ControlState:
        """Build from an ``HGETALL`` reply (bytes or str keys and values)."""
        d = {_text(k): _text(v) for k, v in (raw or {}).items()}
        close_at = d.get("close_at")
        try:
            at = float(close_at) if close_at else None
        except ValueError:
            at = None
        return cls(d.get("paused") == "1", d.get("paused_by", ""), d.get("close", ""), at)

    def close_reason(self, started_at: float) -> str:
        """The close reason this worker (started at ``started_at``, server time) must act on, or ``""``."""
        if self.close and self.close_at is not None and self.close_at >= started_at:
            return self.close
        return ""


def pause_crawl(client: Any, control_key: str, by: str = "cli") -> None:
    """Pause the crawl: every worker stops taking new requests at its next sync (one round trip)."""
    client.hset(control_key, mapping={"paused": "1", "paused_by": by, "paused_at": repr(time.time())})


def resume_crawl(client: Any, control_key: str, errors_key: str) -> None:
    """Resume a paused crawl and give it a fresh start: the pause and any close decision are lifted and the
    error window is emptied (else the errors that caused an automatic pause would trip it again at once).
    One round trip."""
    pipe = client.pipeline(transaction=False)
    pipe.hset(control_key, "paused", "0")
    pipe.hdel(control_key, "paused_by", "paused_at", "close", "close_at", "errors_tripped_at")
    pipe.delete(errors_key)
    pipe.execute()


async def server_time(redis: Any) -> float:
    """Redis server time (unix seconds): the one clock every worker and the CLI agree on."""
    sec, usec = await redis.time()
    return int(sec) + int(usec) / 1e6
