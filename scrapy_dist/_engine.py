"""The two things the scheduler needs from Scrapy's engine that Scrapy does not expose publicly.

Kept in one module so a Scrapy upgrade that moves them is a one-file fix:

* which requests the engine is still working on (downloaded, callback and item pipelines running):
  ``engine._slot.inprogress``; a request leaves it only after its callback's output has been handed to
  the scheduler, which is when the frontier may acknowledge it;
* a way to make the engine ask for requests *now* (``engine._slot.nextcall.schedule()``) instead of at
  its next 5-second heartbeat, when prefetched requests arrive or the crawl turns idle.
"""

from __future__ import annotations

from typing import Any


def inprogress(crawler: Any) -> Any:
    """The engine's set of requests in progress, or ``None`` if it cannot be found."""
    slot = getattr(getattr(crawler, "engine", None), "_slot", None)
    return getattr(slot, "inprogress", None)


def wake(crawler: Any) -> None:
    """Ask the engine to call ``next_request`` soon."""
    slot = getattr(getattr(crawler, "engine", None), "_slot", None)
    nextcall = getattr(slot, "nextcall", None)
    if nextcall is not None:
        nextcall.schedule()
