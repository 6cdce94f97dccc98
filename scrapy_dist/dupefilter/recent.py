"""A worker's short memory of the fingerprints it sent to the frontier (no Redis I/O here).

A link every page carries (a menu, a footer) would otherwise travel to Redis with every page, so the
scheduler skips a fingerprint this process sent a moment ago. The memory never hides a URL that
``DUPEFILTER_TTL``, ``scrapy-dist forget`` or ``DEADLETTER_FORGET`` made new again: a forget clears it at
the worker's next sync (the control hash's ``forgets`` token, answered by the sync script), and otherwise it
is bounded in time: two generations of a set, the older dropped every ``max_age / 2`` seconds.
"""

from __future__ import annotations

from collections.abc import Hashable

__all__ = ["RECENT_LIMIT", "RECENT_MAX_AGE", "RecentFingerprints"]

#: most fingerprints remembered per generation (the memory is cleared when one is full)
RECENT_LIMIT = 500_000
#: seconds a sent fingerprint is trusted when the filter remembers forever: long, since a shorter memory
#: makes a worker send its menus' links again and again (docs/continuous.md)
RECENT_MAX_AGE = 600.0


class RecentFingerprints:
    """Fingerprint tokens this process sent, each trusted for at most ``max_age`` seconds (``0``: none
    is kept). Methods take ``now`` (``time.monotonic()``), so tests need no sleeps."""

    def __init__(self, max_age: float = RECENT_MAX_AGE, limit: int = RECENT_LIMIT) -> None:
        self.max_age = max_age
        self.limit = limit
        self._current: set[Hashable] = set()
        self._previous: set[Hashable] = set()
        self._since: float | None = None

    def _rotate(self, now: float) -> None:
        if self._since is None:
            self._since = now
            return
        age = now - self._since
        if age >= self.max_age:  # both generations are too old
            self.clear()
            self._since = now
        elif age >= self.max_age / 2:
            self._previous, self._current = self._current, set()
            self._since = now

    def seen(self, token: Hashable, now: float) -> bool:
        """Whether ``token`` was sent recently enough to be certainly known crawl-wide; remembers it if not
        (the caller sends it)."""
        if self.max_age <= 0:
            return False
        self._rotate(now)
        if token in self._current or token in self._previous:
            return True
        self.add(token, now)
        return False

    def add(self, token: Hashable, now: float) -> None:
        """Remember ``token`` as sent at ``now``."""
        if self.max_age <= 0:
            return
        self._rotate(now)
        if len(self._current) >= self.limit:
            self.clear()
            self._since = now
        self._current.add(token)

    def discard(self, token: Hashable) -> None:
        """Forget ``token`` (its URL was made new again by this worker)."""
        self._current.discard(token)
        self._previous.discard(token)

    def clear(self) -> None:
        """Forget everything (after an outage: what was sent may not have arrived)."""
        self._current.clear()
        self._previous.clear()

    def __len__(self) -> int:
        return len(self._current) + len(self._previous)
