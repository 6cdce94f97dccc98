"""Sizing and hashing of the Redis scalable bloom filter (no Redis I/O here; see ``lua/dupe.lua``).

The filter is a chain of classic bloom filters, each a set of bitmap *blocks* (Redis strings of
``BLOOMFILTER_BLOCK_BITS`` bits, far below the 512 MB string limit). Items go into the newest filter
until it holds its capacity, then the next one starts; a lookup tests every filter.

How the chain is planned, and why:

* **Up to the declared capacity** the chain has ``L + 1`` filters whose capacities grow 8x
  (``c_0 ... c_L``, ``sum = capacity``, ``c_0`` of about 1,000 to 8,000 items), so a small crawl only ever
  allocates the small first filters. The error budget is shared in proportion to capacity
  (``e_i = 0.95 * E * c_i / capacity``): the tiny early filters get tighter error rates (the chain's
  error "tightens" going back), which is the allocation that minimises total bits for a fixed sum of
  errors. At the declared capacity this costs about 1.9 bytes per item at ``E = 0.001`` (a single
  optimal filter needs 1.8), where the classic 2x/0.5x scalable chain would need about 2.6.
* **Past the declared capacity** the chain keeps growing like a classic scalable bloom filter: each new
  filter has twice the capacity of the one before and half the error, paid from the 5% reserve, so the
  compound false-positive rate stays below ``E`` however far the crawl overshoots (a warning is logged
  once, since memory per item rises).

Bit positions come from a 92-bit BLAKE2b digest of the request fingerprint: two independent 46-bit
numbers ``h1, h2`` (``h2`` odd). Bit ``j`` of a filter of ``m`` bits is ``(a + j*b + j*j*c) mod m`` with
``a, b = h1, h2 mod m`` and ``c`` a third hash mixed from the full ``h1`` and ``h2`` (see ``dupe.lua``).
Plain double hashing (``a + j*b``) has a false-positive floor of about ``n / m**2``: two items that agree
on ``(h1 mod m, h2 mod m)`` share all their bits. That floor is far above the tiny error rates the small
first filters of the chain are given, and it showed (a few false positives per million inserts where the
design allows 0.01); the quadratic term lowers it to ``n / m**3``. ``HASHING`` is recorded in the
filter's hash, so a filter written with other positions is never read with these.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import cached_property

_LN2_SQ = math.log(2) ** 2
_MASK46 = (1 << 46) - 1
PLANNED_GROWTH = 8
OVERFLOW_GROWTH = 2
RESERVE = 0.05
MIN_FIRST_CAPACITY = 1000
#: version of the bit-position scheme, stored in ``{spider}:bloom`` as ``hashing``
HASHING = 2


@dataclass(frozen=True)
class FilterSpec:
    """One filter of the chain."""

    index: int
    capacity: int
    error_rate: float
    bits: int
    hashes: int
    cumulative: int  # capacity of filters 0..index together
    blocks: int


def _spec(index: int, capacity: int, error: float, cumulative: int, block_bits: int) -> FilterSpec:
    bits = max(64, math.ceil(capacity * math.log(1 / error) / _LN2_SQ))
    hashes = max(1, min(40, round(math.log(2) * bits / capacity)))
    return FilterSpec(index, capacity, error, bits, hashes, cumulative, math.ceil(bits / block_bits))


class BloomPlan:
    """The chain of filters for a declared ``capacity`` and compound ``error_rate``."""

    def __init__(self, capacity: int, error_rate: float, block_bits: int = 2**31) -> None:
        if capacity < 1 or not 0 < error_rate < 1:
            raise ValueError("BLOOMFILTER_CAPACITY must be >= 1 and 0 < BLOOMFILTER_ERROR_RATE < 1")
        self.capacity = int(capacity)
        self.error_rate = float(error_rate)
        self.block_bits = int(block_bits)
        self._specs: list[FilterSpec] = []
        planned = self._planned_capacities()
        budget = (1 - RESERVE) * self.error_rate
        cum = 0
        for i, c in enumerate(planned):
            cum += c
            self._specs.append(_spec(i, c, budget * c / self.capacity, cum, self.block_bits))

    def _planned_capacities(self) -> list[int]:
        c, g = self.capacity, PLANNED_GROWTH
        levels = 1
        while c * (g - 1) / (g ** (levels + 1) - 1) >= MIN_FIRST_CAPACITY:
            levels += 1
        first = c * (g - 1) / (g**levels - 1)
        caps = [max(1, round(first * g**i)) for i in range(levels)]
        caps[-1] += c - sum(caps)  # the rounding remainder goes to the largest filter
        return caps

    @property
    def planned(self) -> int:
        """Number of filters up to the declared capacity."""
        return sum(1 for s in self._specs if s.cumulative <= self.capacity)

    def spec(self, index: int) -> FilterSpec:
        """Filter ``index`` (created on demand past the declared capacity)."""
        while len(self._specs) <= index:
            last = self._specs[-1]
            j = len(self._specs) - self.planned + 1
            cap = last.capacity * OVERFLOW_GROWTH
            err = RESERVE * self.error_rate * 0.5**j
            self._specs.append(_spec(len(self._specs), cap, err, last.cumulative + cap, self.block_bits))
        return self._specs[index]

    def filters_for(self, items: int) -> list[FilterSpec]:
        """Every filter a chain holding up to ``items`` items uses (at least the first)."""
        out = [self.spec(0)]
        while out[-1].cumulative <= items:
            out.append(self.spec(len(out)))
        return out

    def script_params(self, items: int) -> list[int]:
        """The flat ARGV parameters of ``dupe.lua`` for a chain that may grow to ``items`` items."""
        specs = self.filters_for(items)
        params = [len(specs), self.block_bits]
        for s in specs:
            params += [s.bits, s.hashes, s.cumulative, s.blocks]
        return params

    def block_coords(self, items: int) -> list[tuple[int, int]]:
        """(filter, block) of every bitmap block, in the order ``dupe.lua`` expects them in KEYS."""
        return [(s.index, b) for s in self.filters_for(items) for b in range(s.blocks)]

    def false_positive_rate(self, items: int) -> float:
        """Estimated compound false-positive rate with ``items`` items inserted."""
        total, left = 0.0, items
        for s in self.filters_for(items):
            n = min(left, s.capacity)
            if n <= 0:
                break
            total += (1 - math.exp(-s.hashes * n / s.bits)) ** s.hashes
            left -= n
        return total

    def memory_bytes(self, items: int) -> int:
        """Bytes of bitmap the chain allocates once it holds ``items`` items."""
        specs = self.filters_for(items)
        return sum(math.ceil(s.bits / 8) for s in specs if s.cumulative - s.capacity < items)

    @cached_property
    def bytes_per_item_at_capacity(self) -> float:
        return self.memory_bytes(self.capacity) / self.capacity


def fingerprint_hashes(fingerprint: bytes) -> tuple[int, int]:
    """Two independent 46-bit hashes of a request fingerprint (``h2`` odd) for double hashing."""
    x = int.from_bytes(hashlib.blake2b(fingerprint, digest_size=12).digest(), "big")
    return x >> 50, ((x >> 4) & _MASK46) | 1
