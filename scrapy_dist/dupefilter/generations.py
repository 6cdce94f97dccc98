"""Fingerprints with an age (``DUPEFILTER_TTL``): the bloom filter's generations (no Redis I/O here).

Generation ``e`` covers ``[e*span, (e+1)*span)`` of the clock (``span = TTL / (G-1)``): lookups test the
last ``G``, inserts write the current one, and Redis expires a generation's keys whole when it stops being
live, so nothing rotates. Precision, memory and figures: docs/continuous.md, "Fingerprints that expire".
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
#: planned one, not by doubling, so a busy span costs some memory, not a cliff
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
