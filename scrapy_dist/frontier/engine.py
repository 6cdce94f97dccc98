"""Everything scrapy-dist needs from Scrapy's engine that Scrapy does not expose publicly: the one module
that reads ``engine._slot``, so a Scrapy upgrade that moves it is a one-file fix.

This is the one module that reads ``engine._slot``, so a Scrapy upgrade that moves it is a one-file fix:

* which requests the engine is still working on (downloaded, callback and item pipelines running):
  ``engine._slot.inprogress``; a request leaves it only after its callback's output has been handed to
  the scheduler, which is when the frontier may acknowledge it;
* a way to make the engine ask for requests *now* (``engine._slot.nextcall.schedule()``) instead of at
  its next 5-second heartbeat, when prefetched requests arrive or the crawl turns idle;
* the running scheduler (``engine._slot.scheduler``) and whether the engine is already closing;
* the running downloader's middleware chain (``middleware.methods``), where the scheduler puts a
  middleware the project's settings lack (the two-line setup without the add-on);
* the requests waiting in the downloader's slot queues (``slot.queue``), taken out once the engine
  closes: with a download delay they would otherwise be fetched one by one before it may close.

The scheduler does not take a crawler: it takes an :class:`Engine` -- :class:`EngineView` of a real
crawler, or :class:`DetachedEngine` for a scheduler driven without a running engine (tests, tools).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

from twisted.python.failure import Failure

from scrapy_dist.exceptions import ReleasedAtClose

logger = logging.getLogger(__name__)


def _slot(crawler: Any) -> Any:
    try:
        engine = crawler.engine
    except (AttributeError, RuntimeError):  # Crawler.engine raises until the crawl starts
        return None
    return getattr(engine, "_slot", None)


def inprogress(crawler: Any) -> Any:
    """The engine's set of requests in progress, or ``None`` if it cannot be found."""
    return getattr(_slot(crawler), "inprogress", None)


def wake(crawler: Any) -> None:
    """Ask the engine to call ``next_request`` soon."""
    nextcall = getattr(_slot(crawler), "nextcall", None)
    if nextcall is not None:
        nextcall.schedule()


def scheduler(crawler: Any) -> Any:
    """The engine's scheduler object, or ``None`` before the crawl starts."""
    return getattr(_slot(crawler), "scheduler", None)


def is_closing(crawler: Any) -> bool:
    """Whether the engine has started closing the spider."""
    slot = _slot(crawler)
    return slot is not None and getattr(slot, "closing", None) is not None


def take_unstarted(crawler: Any, which: Callable[[Any], bool]) -> list[Any]:
    """Once the engine is closing: the requests ``which`` accepts that wait in the downloader's slot queues
    (not started), taken out and failed with :class:`ReleasedAtClose`, so the engine stops waiting for
    them; ``[]`` before."""
    if not is_closing(crawler):
        return []
    slots = getattr(getattr(crawler.engine, "downloader", None), "slots", None) or {}
    taken = []
    for slot in list(slots.values()):
        queue = getattr(slot, "queue", None)
        if not queue:
            continue
        kept = []
        while queue:
            request, dfd = queue.popleft()
            if which(request):
                taken.append((request, dfd))
            else:
                kept.append((request, dfd))
        queue.extend(kept)
    for request, dfd in taken:
        dfd.errback(Failure(ReleasedAtClose(f"given back to the queue at close: {request.url}")))
    return [request for request, _ in taken]


def add_first_downloader_middleware(crawler: Any, mw: Any) -> bool:
    """Put ``mw`` first in the running downloader's middleware chain (its ``process_request`` before every
    other one's, its ``process_response`` / ``process_exception`` last); False if the chain cannot be
    found (nothing was changed)."""
    try:
        engine = crawler.engine
    except (AttributeError, RuntimeError):  # Crawler.engine raises until the crawl starts
        return False
    manager = getattr(getattr(engine, "downloader", None), "middleware", None)
    methods = getattr(manager, "methods", None)
    if manager is None or not isinstance(methods, dict):
        return False
    for name, first in (("process_request", True), ("process_response", False),
                        ("process_exception", False)):
        method = getattr(mw, name, None)
        if method is None:
            continue
        if name not in methods:
            return False
        if first:
            methods[name].appendleft(method)
        else:
            methods[name].append(method)
    manager.middlewares = (mw, *manager.middlewares)
    return True


def locally_idle(crawler: Any) -> bool:
    """Whether the engine's own scheduler has nothing pending and its downloader nothing active."""
    slot = _slot(crawler)
    if slot is None:
        return True
    return not slot.scheduler.has_pending_requests() and not crawler.engine.downloader.active


class Engine(Protocol):
    """What the scheduler needs of the engine."""

    def inprogress(self) -> Any:
        """Requests the engine still works on (a container), or ``None`` when that cannot be known."""

    def wake(self) -> None:
        """Make the engine ask for requests soon."""

    def close(self, reason: str) -> None:
        """Close the spider (the scheduler cannot go on)."""

    def slot_load(self, request: Any) -> int:
        """Requests the downloader is fetching in the download slot ``request`` would use."""

    def take_unstarted(self, which: Callable[[Any], bool]) -> list[Any]:
        """Once the engine closes, the requests ``which`` accepts that have not started downloading, taken
        back (the engine no longer waits for them); ``[]`` before."""


class EngineView:
    """:class:`Engine` of a real crawler."""

    def __init__(self, crawler: Any) -> None:
        self.crawler = crawler

    def inprogress(self) -> Any:
        return inprogress(self.crawler)

    def wake(self) -> None:
        wake(self.crawler)

    def close(self, reason: str) -> None:
        engine = getattr(self.crawler, "engine", None)
        if engine is None or engine.spider is None or is_closing(self.crawler):
            return
        task = asyncio.get_running_loop().create_task(engine.close_spider_async(reason=reason))
        # keep a reference: the loop holds tasks weakly
        self._closing_task = task

    def slot_load(self, request: Any) -> int:
        # Downloader.get_slot_key and Downloader.slots are public
        try:
            downloader = self.crawler.engine.downloader
        except (AttributeError, RuntimeError):  # Crawler.engine raises until the crawl starts
            return 0
        if downloader is None:
            return 0
        slot = downloader.slots.get(downloader.get_slot_key(request))
        return len(slot.active) if slot is not None else 0

    def take_unstarted(self, which: Callable[[Any], bool]) -> list[Any]:
        return take_unstarted(self.crawler, which)


class DetachedEngine:
    """:class:`Engine` for a scheduler driven without Scrapy's engine: nothing is ever in progress (a
    request handed out is finished at the next round), waking is a no-op, ``close`` is recorded."""

    def __init__(self) -> None:
        self.closed: str | None = None

    def inprogress(self) -> Any:
        return ()

    def wake(self) -> None:
        pass

    def close(self, reason: str) -> None:
        self.closed = reason

    def slot_load(self, request: Any) -> int:
        return 0

    def take_unstarted(self, which: Callable[[Any], bool]) -> list[Any]:
        return []
