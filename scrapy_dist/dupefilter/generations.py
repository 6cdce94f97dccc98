"""Fingerprints with an age (``DUPEFILTER_TTL``): the bloom filter's generations (no Redis I/O here).

A bloom filter cannot delete one item, so with a TTL it is cut in time: ``G`` generations
(``BLOOMFILTER_GENERATIONS``), generation ``e`` covering ``[e*span, (e+1)*span)`` of the clock with
``span = TTL / (G-1)``. A lookup at time ``t`` tests generations ``cur-G+1 .. cur`` (``cur = floor(t/span)``),
an insert writes ``cur``, and Redis drops generation ``e``'s keys whole when it stops being live (they are
created with that expiry, see ``lua/dupe.lua``) -- no scan, no rotation step that two workers could both
run or both miss: the current generation is a function of the clock (the Redis server's, in the scripts).

Precision: a URL seen at time ``t`` (in generation ``e``) is new again at ``(e+G)*span``, between ``TTL``
and ``TTL * G/(G-1)`` after ``t``. Memory: each generation is a chain sized for the URLs first seen in
one span (``BLOOMFILTER_CAPACITY / (G-1)``: the capacity is the URLs remembered over one TTL) at error
rate ``BLOOMFILTER_ERROR_RATE / G`` (a lookup tests ``G`` generations, so their errors add up to the
setting), and ``G`` generations exist where ``G-1`` spans of URLs are remembered. Measured at error rate
0.001 (``python -m benchmarks --only continuous``): 4.24, 3.10 and 2.84 bytes per URL seen per TTL for
``G`` = 2, 4 and 8, against 1.94 without a TTL. More generations: a sharper expiry and less memory, but
more filters to test per lookup (Redis CPU).

Why generations of the whole chain and not a counting filter or per-fingerprint expiry: a counting
filter needs 4+ bits per cell and deletes by decrement, which a crash between two decrements corrupts; the
chain keeps the filter's 1.9-byte-per-URL cost and its atomic test-and-set, and costs one extra read per
live generation per lookup.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scrapy_dist.dupefilter.bloom import (
    HASHING,
    MAX_GENERATIONS,
    MIN_GENERATIONS,
    MIN_SPAN,
    BloomParameterError,
    BloomPlan,
)

#: a generation that receives more than its share of URLs grows by filters of this fraction of its last
#: planned one, not by doubling: a span 25% busier than planned then costs ~30% more memory for that
#: generation instead of ~3x (measured in ``python -m benchmarks --only continuous``)
OVERFLOW_STEP = 0.25


@dataclass(frozen=True)
class Generations:
    """``G`` generations of ``span = ttl / (G-1)`` seconds each."""

    ttl: float
    count: int

    def __post_init__(self) -> None:
        if not (isinstance(self.ttl, (int, float)) and math.isfinite(self.ttl) and self.ttl > 0):
            raise BloomParameterError(f"DUPEFILTER_TTL={self.ttl!r}: must be a number of seconds > 0")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or not (
            MIN_GENERATIONS <= self.count <= MAX_GENERATIONS
        ):
            raise BloomParameterError(
                f"BLOOMFILTER_GENERATIONS={self.count!r}: must be an integer in"
                f" {MIN_GENERATIONS} .. {MAX_GENERATIONS}"
            )
        if self.ttl / (self.count - 1) < MIN_SPAN:
            raise BloomParameterError(
                f"DUPEFILTER_TTL={self.ttl!r}: each of the {self.count} generations would span less than"
                f" {MIN_SPAN:g} s (a worker's clock a moment off the server's finds none of them); use at"
                f" least {MIN_SPAN * (self.count - 1):g}"
            )

    @property
    def span(self) -> float:
        """Seconds one generation covers."""
        return self.ttl / (self.count - 1)

    def current(self, now: float) -> int:
        """The generation inserts go to at ``now`` (unix seconds)."""
        return math.floor(now / self.span)

    def live(self, now: float) -> range:
        """The generations a lookup at ``now`` tests, oldest first."""
        cur = self.current(now)
        return range(cur - self.count + 1, cur + 1)

    def passed(self, now: float) -> range:
        """The generations a worker whose clock reads ``now`` passes to a script: the live ones and one
        more on either side, so a server clock up to one span off this machine's still finds them all."""
        live = self.live(now)
        return range(live.start - 1, live.stop + 1)

    def expiry_bounds(self) -> tuple[float, float]:
        """(earliest, latest) age at which a remembered URL is new again."""
        return self.ttl, self.ttl * self.count / (self.count - 1)

    def plan(self, capacity: int, error_rate: float, block_bits: int, scheme: int = HASHING) -> BloomPlan:
        """The chain of one generation, for a filter of ``capacity`` URLs remembered per TTL at
        ``error_rate`` over all the generations a lookup tests."""
        return BloomPlan(
            max(1, math.ceil(capacity / (self.count - 1))), error_rate / self.count, block_bits,
            overflow_step=OVERFLOW_STEP, scheme=scheme,
        )
