"""Which shard a request belongs to, how many requests to lease from each, and when the crawl is empty
(docs/frontier.md, "Sharded frontier"). I/O-free.

A request goes to the shard of its fingerprint (:func:`~scrapy_dist.frontier.shard.shard_of`), or with
crawl-wide politeness of its host (:func:`~scrapy_dist.frontier.shard.domain_shard`); leases are split by
the shards' last reported queue lengths; "the crawl is empty" needs proof from two rounds, since the
shards answer at slightly different moments.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scrapy.utils.httpobj import urlparse_cached

from scrapy_dist.frontier.shard import domain_shard, shard_of

if TYPE_CHECKING:
    from scrapy import Request

    from scrapy_dist.frontier.shard import SyncResult


def crawl_fingerprinter(crawler: Any) -> Any:
    """The crawl's request fingerprinter; Scrapy's default one where the crawler has none yet (a scheduler
    opened outside a crawl, as Scrapy's own scheduler tests do)."""
    try:
        return crawler.request_fingerprinter
    except (AttributeError, RuntimeError):
        from scrapy.utils.request import RequestFingerprinter

        return RequestFingerprinter(crawler)


@dataclass(frozen=True)
class ShardState:
    """One shard's last answer: counts crawl-wide and its sequence counter."""

    queued: int
    inflight: int
    delayed: int
    seq: int


@dataclass(frozen=True)
class FrontierState:
    """The crawl-wide frontier after a round that reached every shard."""

    queued: int
    inflight: int
    delayed: int
    #: every shard was seen empty at one instant (with shards: twice, nothing created in between)
    empty_confirmed: bool

    def as_dict(self) -> dict[str, int]:
        return {"queued": self.queued, "inflight": self.inflight, "delayed": self.delayed}


#: seconds after a sync call repaired a key that holds requests (moved a queue, leases or delayed key of
#: another Redis type aside) during which an empty frontier is not taken as drained: the repair itself
#: empties that key, and whoever swapped it in may put the crawl's real one back a moment later (an empty
#: reading then ended the crawl with hundreds of requests still queued: seen in the hostile-writer run
#: with crawl-wide politeness). Other repairs (counters, bloom blocks, ...) hide no work: a crawl they
#: hit every second still finishes.
REPAIR_GRACE = 10.0


class ShardRouter:
    """Routing and the crawl-wide view over ``shards`` shards (1 = unsharded)."""

    def __init__(self, shards: int = 1, fingerprinter: Any = None, by_domain: bool = False) -> None:
        if shards < 1:
            raise ValueError(f"SCHEDULER_SHARDS must be >= 1, not {shards!r}")
        self.shards = shards
        self.fingerprinter = fingerprinter
        #: route by the request's host, not its fingerprint (crawl-wide politeness with shards: a domain's
        #: queue, limits and fingerprints live on one shard)
        self.by_domain = by_domain
        self.states: list[ShardState | None] = [None] * shards
        self._last_snapshot: tuple[ShardState | None, ...] | None = None
        #: when (monotonic) a call last moved a key holding work aside: empty counts REPAIR_GRACE later
        self._repaired_at: float | None = None

    def shard(self, request: Request, fingerprint: bytes | None = None) -> int:
        """The shard a new request (or a delayed retry) goes to: that of its fingerprint (pass it when
        already computed), or of its host when routing by domain."""
        if self.shards == 1:
            return 0
        if self.by_domain:
            return domain_shard((urlparse_cached(request).hostname or "").lower(), self.shards)
        if fingerprint is None:
            fingerprint = bytes(self.fingerprinter.fingerprint(request))
        return shard_of(fingerprint, self.shards)

    def domain(self, domain: str) -> int:
        """The shard of a domain's politeness state (shard 0 unless routing by domain)."""
        return domain_shard(domain, self.shards) if self.by_domain else 0

    def lease_split(self, want: int) -> list[int]:
        """How many of ``want`` requests to lease from each shard: in proportion to each shard's last
        reported queue length, at least 1 from any non-empty shard; evenly (at least 1 each) while no
        shard is known to hold anything, so that new work anywhere is found in one round."""
        n = self.shards
        if n == 1 or want <= 0:
            return [want] + [0] * (n - 1)
        queued = [st.queued if st is not None else 0 for st in self.states]
        total = sum(queued)
        if total == 0:
            base, extra = divmod(want, n)
            return [max(1, base + (i < extra)) for i in range(n)]
        return [max(1, want * q // total) if q else 0 for q in queued]

    def observe(self, shard: int, result: SyncResult, now: float | None = None) -> None:
        """Record a shard's answer (``now``: :func:`time.monotonic`, for tests)."""
        self.states[shard] = ShardState(result.queued, result.inflight, result.delayed, result.seq)
        if result.work_repaired:
            self._repaired_at = time.monotonic() if now is None else now

    def forget_snapshot(self) -> None:
        """A round failed somewhere: an earlier empty reading proves nothing any more."""
        self._last_snapshot = None

    def settle(self, now: float | None = None) -> FrontierState:
        """The crawl-wide state after a round that reached every shard (``now``: :func:`time.monotonic`).
        Empty is confirmed only once :data:`REPAIR_GRACE` has passed since the last repair."""
        states = self.states
        queued, inflight, delayed = (
            sum(getattr(st, name) for st in states if st is not None)
            for name in ("queued", "inflight", "delayed")
        )
        empty = not (queued or inflight or delayed)
        snapshot = tuple(states)
        # With shards, a request could move from one shard to another between two answers. Empty twice
        # with no entry created anywhere in between (the sequence counters did not move) proves an
        # instant when every shard was empty.
        confirmed = empty if self.shards == 1 else empty and snapshot == self._last_snapshot
        self._last_snapshot = snapshot if empty else None
        if confirmed and self._repaired_at is not None:
            confirmed = (time.monotonic() if now is None else now) - self._repaired_at >= REPAIR_GRACE
        return FrontierState(queued, inflight, delayed, confirmed)
