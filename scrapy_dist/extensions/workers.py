"""The worker registry: who is crawling, and whether they are still alive (docs/monitoring.md, "Worker
heartbeats"): ``{spider}:workers`` (id -> last seen) and one ``{spider}:worker:<id>`` HASH per worker,
written by its heartbeat and read back through :func:`parse_worker_hash`. A worker unseen for
:data:`LOST_AFTER_INTERVALS` heartbeat intervals, and that did not say it closed, is lost.
"""

from __future__ import annotations

import math
import os
import socket
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scrapy_dist.frontier.scheduler import get_scheduler, make_worker_id
from scrapy_dist.redis.replies import hash_fields

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
    prefetched: int | None = None,
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
        "prefetched": "" if prefetched is None else str(prefetched),
        "pages_per_min": f"{pages_per_min:.1f}",
        "interval": repr(float(interval)),
        "state": state,
    }
    if finish_reason:
        fields["finish_reason"] = finish_reason
    return fields


#: Largest count a worker hash may report (anything above is garbage, shown as unknown).
MAX_COUNT = 10**15
#: Longest text field kept from a worker hash.
MAX_TEXT = 200


def _count(text: str) -> int | None:
    if text.isascii() and text.isdigit() and len(text) <= 16 and int(text) <= MAX_COUNT:
        return int(text)
    return None


def _finite(text: str, low: float, high: float) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and low <= value <= high else None


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's heartbeat HASH (``{spider}:worker:<id>``) as parsed by :func:`parse_worker_hash`:
    every field typed and in range, ``None`` where the hash held nothing usable."""

    host: str = ""
    pid: int | None = None
    started: float | None = None
    pages: int | None = None
    items: int | None = None
    errors: int | None = None
    inflight: int | None = None
    #: leased ahead of demand, not handed to the engine yet
    prefetched: int | None = None
    pages_per_min: float | None = None
    interval: float | None = None
    state: str = ""
    finish_reason: str = ""
    #: names of fields that held garbage
    garbage: tuple[str, ...] = ()


def parse_worker_hash(raw: Any) -> WorkerInfo:
    """The one parser of a worker's heartbeat HASH (an ``HGETALL`` reply). Raises :class:`RejectedEntry`
    (reason ``not_a_hash``) only if ``raw`` is not a mapping; a garbage field becomes ``None``/empty and
    is named in ``garbage``. Texts are cut to :data:`MAX_TEXT` characters (they are not made printable:
    that is the printing side's job)."""
    d = hash_fields(raw, "worker")
    garbage: list[str] = []

    def count(name: str) -> int | None:
        text = d.get(name, "")
        value = _count(text)
        if text and value is None:
            garbage.append(name)
        return value

    def number(name: str, low: float, high: float) -> float | None:
        text = d.get(name, "")
        value = _finite(text, low, high) if text else None
        if text and value is None:
            garbage.append(name)
        return value

    state = d.get("state", "")
    if state not in ("", RUNNING, CLOSED, "closing"):
        garbage.append("state")
        state = ""
    pid = count("pid")
    return WorkerInfo(
        host=d.get("host", "")[:MAX_TEXT],
        pid=pid if pid is None or pid < 2**32 else None,
        started=number("started", 0.0, 1e11),
        pages=count("pages"),
        items=count("items"),
        errors=count("errors"),
        inflight=count("inflight"),
        prefetched=count("prefetched"),
        pages_per_min=number("pages_per_min", 0.0, 1e12),
        interval=number("interval", 0.001, 86400.0),
        state=state,
        finish_reason=d.get("finish_reason", "")[:MAX_TEXT],
        garbage=tuple(garbage),
    )


def worker_state(info: dict[str, str], last_seen: float, now: float, default_interval: float) -> str:
    """``closed`` if the worker said so, ``lost`` if unseen for :data:`LOST_AFTER_INTERVALS` of its
    heartbeat intervals (``default_interval`` if it never sent one), else ``running``."""
    if info.get("state") == CLOSED:
        return CLOSED
    interval = _finite(str(info.get("interval") or ""), 0.001, 86400.0) or default_interval
    if not now - last_seen <= LOST_AFTER_INTERVALS * interval:  # a NaN last_seen is lost, not running
        return LOST
    return RUNNING
