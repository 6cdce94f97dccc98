"""The worker registry: who is crawling, and whether they are still alive.

Two keys per crawl:

* ``{spider}:workers`` -- ZSET worker id -> last seen (Redis server time). The scheduler's frontier sync
  refreshes it several times a second; :class:`~scrapy_dist.extensions.ClusterStats` refreshes it with
  every heartbeat (so it works with any scheduler).
* ``{spider}:worker:<id>`` -- HASH with the worker's details, rewritten every ``CLUSTERSTATS_INTERVAL``
  seconds by its heartbeat (see :func:`heartbeat_fields`) and expiring a week after the last one.

A worker is *lost* when it has not been seen for :data:`LOST_AFTER_INTERVALS` heartbeat intervals, unless it
said it closed; the leases a lost worker held are the ones the frontier requeues when they run out.
"""

from __future__ import annotations

import os
import socket
from collections import deque
from typing import TYPE_CHECKING, Any

from scrapy_dist.scheduler import get_scheduler, make_worker_id

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

#: A worker unseen for this many of its heartbeat intervals is shown as lost.
LOST_AFTER_INTERVALS = 3
#: Seconds a worker's details stay in Redis after its last heartbeat.
WORKER_TTL = 7 * 24 * 3600

RUNNING = "running"
LOST = "lost"
CLOSED = "closed"


def engine_of(crawler: Crawler) -> Any:
    """``crawler.engine``, or None before the crawl starts (Scrapy raises RuntimeError then)."""
    try:
        return crawler.engine
    except (AttributeError, RuntimeError):
        return None


def scheduler_of(crawler: Crawler) -> Any:
    """The running scrapy-dist scheduler of ``crawler``, or None (another scheduler, or not started)."""
    return get_scheduler(crawler) if engine_of(crawler) is not None else None


def worker_id(crawler: Crawler) -> str:
    """This process's worker id: the scrapy-dist scheduler's, else one made once per crawler."""
    sched = scheduler_of(crawler)
    if sched is not None:
        return sched.worker_id
    wid = getattr(crawler, "_scrapy_dist_worker_id", None)
    if wid is None:
        wid = make_worker_id()
        crawler._scrapy_dist_worker_id = wid  # type: ignore[attr-defined]
    return wid


class RateMeter:
    """Rate of a growing counter over the last ``span`` seconds, from samples taken at each heartbeat."""

    def __init__(self, span: float = 60.0) -> None:
        self.span = span
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, value: float, now: float) -> None:
        """Record the counter's ``value`` at monotonic time ``now``."""
        self._samples.append((now, value))
        # keep one sample at or before the span's start, so the rate covers the whole span
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.span:
            self._samples.popleft()

    def per_minute(self) -> float:
        """Counter increase per minute over the samples kept (0 until two samples a second apart)."""
        if len(self._samples) < 2:
            return 0.0
        (t0, v0), (t1, v1) = self._samples[0], self._samples[-1]
        if t1 - t0 < 1.0:
            return 0.0
        return max(0.0, (v1 - v0) * 60.0 / (t1 - t0))


def error_count(stats: dict[str, Any]) -> int:
    """Errors in a worker's Scrapy stats: spider exceptions, download exceptions and 5xx/429 responses."""
    n = int(stats.get("spider_exceptions/count", 0) or 0)
    n += int(stats.get("downloader/exception_count", 0) or 0)
    prefix = "downloader/response_status_count/"
    for name, value in stats.items():
        if name.startswith(prefix):
            code = name[len(prefix):]
            if code.startswith("5") or code == "429":
                n += int(value or 0)
    return n


def heartbeat_fields(
    *,
    worker: str,
    spider: str,
    started: float,
    stats: dict[str, Any],
    inflight: int | None,
    pages_per_min: float,
    interval: float,
    state: str = RUNNING,
    finish_reason: str = "",
    host: str | None = None,
    pid: int | None = None,
) -> dict[str, str]:
    """The fields of a worker's heartbeat HASH (``last_seen`` is added by Redis, in server time)."""
    fields = {
        "id": worker,
        "host": host if host is not None else socket.gethostname(),
        "pid": str(pid if pid is not None else os.getpid()),
        "spider": spider,
        "started": f"{started:.3f}",
        "pages": str(int(stats.get("response_received_count", 0) or 0)),
        "items": str(int(stats.get("item_scraped_count", 0) or 0)),
        "errors": str(error_count(stats)),
        "inflight": "" if inflight is None else str(inflight),
        "pages_per_min": f"{pages_per_min:.1f}",
        "interval": repr(float(interval)),
        "state": state,
    }
    if finish_reason:
        fields["finish_reason"] = finish_reason
    return fields


def worker_state(info: dict[str, str], last_seen: float, now: float, default_interval: float) -> str:
    """``closed`` if the worker said so, ``lost`` if unseen for :data:`LOST_AFTER_INTERVALS` of its
    heartbeat intervals (``default_interval`` if it never sent one), else ``running``."""
    if info.get("state") == CLOSED:
        return CLOSED
    try:
        interval = float(info.get("interval") or default_interval)
    except ValueError:
        interval = default_interval
    if now - last_seen > LOST_AFTER_INTERVALS * interval:
        return LOST
    return RUNNING
