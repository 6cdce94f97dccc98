"""The bloom filter's arithmetic, no Redis I/O (the bits are set by ``lua/dupe.lua``): a chain of filters of
equal bitmap blocks, an item's ``k`` bits in one window of ``WINDOW_BITS`` (docs/frontier.md, "The bloom
filter"), the ``{spider}:bloom`` record, :class:`Generations` for ``DUPEFILTER_TTL`` (docs/continuous.md)
and :class:`RecentFingerprints`, a worker's memory of the fingerprints it sent."""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import math
from collections.abc import Hashable
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.settings.table import MAX_CAPACITY, MAX_GENERATIONS, MAX_TTL, MIN_ERROR_RATE, MIN_GENERATIONS

_LN2_SQ = math.log(2) ** 2
_MASK46 = (1 << 46) - 1
PLANNED_GROWTH = 16
OVERFLOW_GROWTH = 2
RESERVE = 0.05
MIN_FIRST_CAPACITY = 1000
HASHING = 4  #: new filters' ``hashing``: 3 gives each filter its optimal hash count, 4 caps them (BloomPlan)
SCHEMES = (3, 4)
#: layout 4: the small filters use this many hashes fewer than the largest one (fewer SETBITs per insert)
SMALL_FILTER_HASH_CUT = 2
WINDOW_BITS = 4096  #: all the bits of one item in one filter lie in one window of this many bits (512 bytes)
STRING_OVERHEAD = 10  #: bytes a Redis string adds to its contents: the largest sds header (9) and a NUL
KEY_OVERHEAD = 80  #: approximate bytes of Redis bookkeeping per key (dict entry, key object and name)
#: most items a filter holds, in capacities: hostile counts cannot make a worker allocate or name more keys
MAX_OVERSHOOT = 8
#: shortest span of one generation of a DUPEFILTER_TTL filter: a worker passes the generations live by its
#: own clock, one span either side, so a span shorter than the clocks' difference finds none of them
MIN_SPAN = 0.25
MAX_BLOCK_BITS = 2**32  #: largest BLOOMFILTER_BLOCK_BITS: a Redis string holds at most 512 MB


class BloomParameterError(ScrapyDistError, ValueError):
    """A bloom filter setting or recorded field is out of range (one line naming it and the range)."""


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_parameters(capacity: Any, error_rate: Any, block_bits: Any, names: tuple[str, str, str] = (
    "BLOOMFILTER_CAPACITY", "BLOOMFILTER_ERROR_RATE", "BLOOMFILTER_BLOCK_BITS")) -> tuple[int, float, int]:
    """The three checked; :class:`BloomParameterError` names the bad one as ``names`` say."""
    if not _whole(capacity) or not 1 <= capacity <= MAX_CAPACITY:
        raise BloomParameterError(
            f"{names[0]}={_show(capacity)}: must be an integer in 1 .. {MAX_CAPACITY:.0e}")
    number = _whole(error_rate) or isinstance(error_rate, float)
    if not number or not (math.isfinite(error_rate) and MIN_ERROR_RATE <= error_rate < 1):
        raise BloomParameterError(
            f"{names[1]}={_show(error_rate)}: must be a number in [{MIN_ERROR_RATE}, 1)")
    if not _whole(block_bits) or block_bits % WINDOW_BITS or not WINDOW_BITS <= block_bits <= MAX_BLOCK_BITS:
        raise BloomParameterError(f"{names[2]}={_show(block_bits)}: must be a multiple of {WINDOW_BITS}"
                                  " up to 2**32")
    return capacity, float(error_rate), block_bits


@dataclass(frozen=True)
class BloomRecord:
    """The parameters recorded in a crawl's ``{spider}:bloom`` HASH."""

    capacity: int
    error_rate: float
    block_bits: int
    n: int
    hashing: int
    #: DUPEFILTER_TTL the crawl was created with (0: remembered forever) and its BLOOMFILTER_GENERATIONS
    ttl: float = 0.0
    generations: int = 4
    #: the recorded ``n`` when it was not a count within the bound (``n`` is then 0; the scripts recount)
    n_garbage: str | None = None
    #: the recorded ``ttl`` / ``generations`` when no worker could have written them (then 0 and 4)
    schedule_garbage: str | None = None


def parse_bloom_record(fields: dict[Any, Any], key: str = "{spider}:bloom") -> BloomRecord:
    """Validate the fields of a ``{spider}:bloom`` HASH (untrusted): raises only :class:`BloomParameterError`
    naming ``key`` and the field; a bad ``n`` or schedule is read as the default, named in ``*_garbage``."""
    raw = {k.decode("utf-8", "replace") if isinstance(k, bytes) else k: v for k, v in fields.items()}

    def integer(name: str, default: str | None = None) -> int:
        value = raw.get(name, default)
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
        if not isinstance(text, str) or not text.isascii() or not text.isdigit() or len(text) > 19:
            raise BloomParameterError(f"{key} field {name}={_show(value)}: not a non-negative integer")
        return int(text)

    def number(name: str, default: str | None = None) -> float:
        value: Any = raw.get(name, default)
        with contextlib.suppress(TypeError, ValueError):  # float() reads ASCII bytes as it reads text
            if len(value) <= 40:
                return float(value)
        raise BloomParameterError(f"{key} field {name}={_show(value)}: not a number")
    err = number("error_rate")  # parsed first: its error wins
    capacity, error_rate, block_bits = check_parameters(
        integer("capacity"), err, integer("block_bits"),
        names=(f"{key} field capacity", f"{key} field error_rate", f"{key} field block_bits"))
    n_garbage = schedule_garbage = None
    try:
        n = integer("n", "0")
    except BloomParameterError:
        n, n_garbage = 0, _show(raw.get("n"))
    if n > capacity * MAX_OVERSHOOT:
        n, n_garbage = 0, str(n)
    try:
        ttl, generations = number("ttl", "0"), integer("generations", "4")
    except BloomParameterError:
        ttl, generations = math.nan, 0
    ok = math.isfinite(ttl) and 0 <= ttl <= MAX_TTL and MIN_GENERATIONS <= generations <= MAX_GENERATIONS
    if not ok or (ttl != 0 and ttl / (generations - 1) < MIN_SPAN):
        schedule_garbage = f"ttl={_show(raw.get('ttl'))} generations={_show(raw.get('generations'))}"
        ttl, generations = 0.0, 4
    return BloomRecord(capacity, error_rate, block_bits, n, integer("hashing"), ttl, generations, n_garbage,
                       schedule_garbage)


@dataclass(frozen=True)
class FilterSpec:
    """One filter of the chain."""

    index: int
    capacity: int
    error_rate: float
    bits: int
    hashes: int
    cumulative: int  # capacity of filters 0..index together
    blocks: int  # Redis strings of the bitmap
    block_windows: int  # windows per block (every block has the same size)


def window_fpr(items: float, bits: int, hashes: int) -> float:
    """False-positive rate of a filter of ``bits`` bits holding ``items`` items, each setting ``hashes``
    distinct bits in one random window of ``WINDOW_BITS`` bits: the number of items sharing the probed
    window is Poisson, and a window holding ``j`` items has each bit still clear with ``(1 - k/W)**j``."""
    if items <= 0:
        return 0.0
    w, lam = WINDOW_BITS, items * WINDOW_BITS / bits
    clear = math.log1p(-min(hashes, w - 1) / w)
    spread = 12 * math.sqrt(lam) + 12
    total = 0.0
    for j in range(max(0, int(lam - spread)), int(lam + spread) + 1):
        p = math.exp(j * math.log(lam) - lam - math.lgamma(j + 1))
        total += p * (1 - math.exp(j * clear)) ** hashes
    return total


@lru_cache(maxsize=1024)
def _size(capacity: int, error: float, max_hashes: int = 40) -> tuple[int, int]:
    """The fewest windows, and hashes (at most ``max_hashes``), keeping ``window_fpr`` within ``error``."""
    plain = capacity * math.log(1 / error) / _LN2_SQ  # an unblocked filter's optimum, a lower bound
    k0 = max(1, round(math.log2(1 / error)))
    best: tuple[int, int] | None = None
    for k in range(max(1, min(k0 - 2, max_hashes)), min(40, k0 + 3, max_hashes) + 1):
        lo, hi = max(1, math.floor(plain / WINDOW_BITS)), max(2, math.ceil(2 * plain / WINDOW_BITS) + 1)
        while window_fpr(capacity, hi * WINDOW_BITS, k) > error and hi < 64 * (lo + 1):
            hi *= 2  # fewer hashes than the optimum need more bits
        if window_fpr(capacity, hi * WINDOW_BITS, k) > error:
            continue
        lo += bisect.bisect_left(range(lo, hi), True,  # the smallest window count meeting the error
                                 key=lambda w: window_fpr(capacity, w * WINDOW_BITS, k) <= error)
        if best is None or lo < best[0]:
            best = (lo, k)
    if best is None:  # pragma: no cover - the doubled unblocked size always suffices
        raise ValueError(f"cannot size a filter for capacity={capacity} error={error}")
    return best


def alloc_size(size: int) -> int:
    """Bytes jemalloc (Redis's allocator) takes for ``size`` bytes: four size classes per doubling."""
    if size <= 64:
        return max(8, -(-size // 16) * 16)
    step = (1 << ((size - 1).bit_length() - 1)) // 4
    return -(-size // step) * step


def _layout(windows: int, block_bits: int) -> tuple[int, int]:
    """(blocks, windows per block) for at least ``windows`` windows: the equal blocks (at most
    ``block_bits`` each) whose jemalloc size classes waste least, widened to fill their class."""
    window_bytes, max_per_block = WINDOW_BITS // 8, block_bits // WINDOW_BITS
    least = -(-windows // max_per_block)
    best: tuple[int, int, int] | None = None  # (bytes, blocks, windows per block)
    for blocks in range(least, min(windows, least + 63) + 1):
        per = -(-windows // blocks)
        size = alloc_size(per * window_bytes + STRING_OVERHEAD)
        per = min(max_per_block, (size - STRING_OVERHEAD) // window_bytes)
        cost = blocks * (size + KEY_OVERHEAD)
        if best is None or cost < best[0]:
            best = (cost, blocks, per)
    assert best is not None
    return best[1], best[2]


class BloomPlan:
    """The chain of filters for a declared ``capacity`` and compound ``error_rate``."""

    def __init__(self, capacity: int, error_rate: float, block_bits: int = 2**31,
                 overflow_step: float | None = None, scheme: int = HASHING) -> None:
        self.capacity, self.error_rate, self.block_bits = check_parameters(capacity, error_rate, block_bits)
        if scheme not in SCHEMES:
            raise BloomParameterError(f"bloom filter layout {scheme!r}: this scrapy-dist reads {SCHEMES}")
        self.scheme = scheme
        #: past the capacity, each filter holds twice the last (None) or this fraction of the last planned
        self.overflow_step = overflow_step
        self.max_items = self.capacity * MAX_OVERSHOOT  #: the most items the filter may ever hold
        self._specs: list[FilterSpec] = []
        # PLANNED_GROWTH times larger each, as many as keep the first at least MIN_FIRST_CAPACITY
        c, g, levels = self.capacity, PLANNED_GROWTH, 1
        while c * (g - 1) / (g ** (levels + 1) - 1) >= MIN_FIRST_CAPACITY:
            levels += 1
        planned = [max(1, round(c * (g - 1) / (g**levels - 1) * g**i)) for i in range(levels)]
        planned[-1] += c - sum(planned)  # the rounding remainder goes to the largest filter
        self.planned = levels  #: number of filters up to the declared capacity
        # the error budget, shared in proportion to capacity (the fewest bits for a fixed sum of errors)
        errors = [(1 - RESERVE) * self.error_rate * c / self.capacity for c in planned]
        # each hash is one SETBIT: layout 4 gives the small filters fewer hashes and more bits
        self.max_hashes = 40 if scheme == 3 else _size(planned[-1], errors[-1])[1]
        small = 40 if scheme == 3 else max(1, self.max_hashes - SMALL_FILTER_HASH_CUT)
        for i, (cap, err) in enumerate(zip(planned, errors, strict=True)):
            self._add(cap, err, self.max_hashes if i == levels - 1 else small)

    def _add(self, capacity: int, error: float, max_hashes: int) -> None:
        windows, hashes = _size(capacity, error, max_hashes)
        blocks, per = _layout(windows, self.block_bits)
        cumulative = capacity + (self._specs[-1].cumulative if self._specs else 0)
        self._specs.append(FilterSpec(len(self._specs), capacity, error, blocks * per * WINDOW_BITS, hashes,
                                      cumulative, blocks, per))

    def check_items(self, items: int, key: str = "{spider}:bloom") -> None:
        """:class:`BloomParameterError` if ``items`` is past :attr:`max_items` (before anything is sized)."""
        if items > self.max_items:
            raise BloomParameterError(
                f"{key}: {items} items would pass {MAX_OVERSHOOT}x the filter's capacity {self.capacity}"
                " (field n was changed, or the crawl outgrew BLOOMFILTER_CAPACITY: raise it for a new crawl)")

    def spec(self, index: int) -> FilterSpec:
        """Filter ``index`` (created on demand past the declared capacity)."""
        while len(self._specs) <= index:
            j = len(self._specs) - self.planned + 1
            if self.overflow_step is None:
                self._add(self._specs[-1].capacity * OVERFLOW_GROWTH, RESERVE * self.error_rate * 0.5**j,
                          self.max_hashes)
            else:  # many small steps: errors shrinking as 1/j^2 (sum 6/pi^2 of the reserve) stay sizable
                self._add(max(1, round(self._specs[self.planned - 1].capacity * self.overflow_step)),
                          RESERVE * self.error_rate * 6 / (math.pi**2 * j**2), self.max_hashes)
        return self._specs[index]

    def filters_for(self, items: int) -> list[FilterSpec]:
        """Every filter a chain holding up to ``items`` items uses (at least the first)."""
        out = [self.spec(0)]
        while out[-1].cumulative <= items:
            out.append(self.spec(len(out)))
        return out

    def script_params(self, items: int) -> list[int]:
        """The flat ARGV parameters of ``dupe.lua`` for a chain that may grow to ``items`` items: the
        filters it may use, then 1 (a probe key follows their blocks, see :meth:`block_coords`)."""
        self.check_items(items)
        specs = self.filters_for(items)
        filters = [x for s in specs for x in (s.bits, s.hashes, s.cumulative, s.blocks, s.block_windows)]
        return [len(specs), WINDOW_BITS, self.max_items, *filters, 1]

    def block_coords(self, items: int) -> list[tuple[int, int]]:
        """(filter, block) of every bitmap block, in ``dupe.lua``'s KEYS order; then the probe, the first
        block of the next filter, which tells the script the chain went past its recorded count."""
        self.check_items(items)
        specs = self.filters_for(items)
        return [*((s.index, b) for s in specs for b in range(s.blocks)), (len(specs), 0)]

    def false_positive_rate(self, items: int) -> float:
        """Estimated compound false-positive rate with ``items`` items inserted."""
        total, left = 0.0, items
        for s in self.filters_for(items):
            if (n := min(left, s.capacity)) <= 0:
                break
            total += window_fpr(n, s.bits, s.hashes)
            left -= n
        return total

    def memory_bytes(self, items: int) -> int:
        """Bytes of bitmap the chain allocates once it holds ``items`` items."""
        return sum(s.bits // 8 for s in self.filters_for(items) if s.cumulative - s.capacity < items)

    @cached_property
    def bytes_per_item_at_capacity(self) -> float:
        return self.memory_bytes(self.capacity) / self.capacity


def fingerprint_hashes(fingerprint: bytes) -> tuple[int, int]:
    """Two 46-bit hashes of a fingerprint: ``h1`` picks the window, ``h2`` (odd) its bits (``dupe.lua``)."""
    x = int.from_bytes(hashlib.blake2b(fingerprint, digest_size=12).digest(), "big")
    return x >> 50, ((x >> 4) & _MASK46) | 1


#: a generation past its share grows by filters of this fraction of its last planned one, not by doubling
OVERFLOW_STEP = 0.25


@dataclass(frozen=True)
class Generations:
    """``G`` generations of ``span = ttl / (G-1)`` seconds each."""

    ttl: float
    count: int

    def __post_init__(self) -> None:
        if not (isinstance(self.ttl, (int, float)) and math.isfinite(self.ttl) and self.ttl > 0):
            raise BloomParameterError(f"DUPEFILTER_TTL={self.ttl!r}: must be a number of seconds > 0")
        if not _whole(self.count) or not MIN_GENERATIONS <= self.count <= MAX_GENERATIONS:
            raise BloomParameterError(f"BLOOMFILTER_GENERATIONS={self.count!r}: must be an integer in"
                                      f" {MIN_GENERATIONS} .. {MAX_GENERATIONS}")
        if self.ttl / (self.count - 1) < MIN_SPAN:
            raise BloomParameterError(
                f"DUPEFILTER_TTL={self.ttl!r}: each of the {self.count} generations would span less than"
                f" {MIN_SPAN:g} s (a worker's clock a moment off the server's finds none of them); use at"
                f" least {MIN_SPAN * (self.count - 1):g}")

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
        cur = self.current(now)
        return range(cur - self.count, cur + 2)

    def expiry_bounds(self) -> tuple[float, float]:
        """(earliest, latest) age at which a remembered URL is new again."""
        return self.ttl, self.ttl * self.count / (self.count - 1)

    def plan(self, capacity: int, error_rate: float, block_bits: int, scheme: int = HASHING) -> BloomPlan:
        """One generation's chain, for ``capacity`` URLs per TTL at ``error_rate`` over all it tests."""
        return BloomPlan(max(1, math.ceil(capacity / (self.count - 1))), error_rate / self.count, block_bits,
                         overflow_step=OVERFLOW_STEP, scheme=scheme)


RECENT_LIMIT = 500_000  #: most fingerprints remembered per generation (the memory is cleared when one fills)
RECENT_MAX_AGE = 600.0  #: seconds a sent fingerprint is trusted (filter never forgetting; docs/continuous.md)


class RecentFingerprints:
    """Fingerprint tokens this process sent, each trusted for at most ``max_age`` seconds (``0``: none
    is kept), in two generations. Methods take ``now`` (``time.monotonic()``)."""

    def __init__(self, max_age: float = RECENT_MAX_AGE, limit: int = RECENT_LIMIT) -> None:
        self.max_age, self.limit = max_age, limit
        self._current: set[Hashable] = set()
        self._previous: set[Hashable] = set()
        self._since: float | None = None

    def _rotate(self, now: float) -> None:
        age = 0.0 if self._since is None else now - self._since
        if age >= self.max_age:  # both generations are too old
            self.clear()
        elif age >= self.max_age / 2:
            self._previous, self._current = self._current, set()
        if self._since is None or age >= self.max_age / 2:
            self._since = now

    def seen(self, token: Hashable, now: float) -> bool:
        """Whether ``token`` was sent recently; remembers it if not (the caller sends it)."""
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
