"""Which request goes when: queue orders, leased requests best first, crawl-wide politeness, retry timing.

**Queue orders** (``SCHEDULER_QUEUE_CLASS``). Every queue is the same sorted set (``{spider}:queue``), and
every member starts with a 6-byte big-endian sequence number from ``{spider}:seq``; a queue class only
decides the score and the order of that prefix: :class:`PriorityQueue` (default; ``-priority``, FIFO
within a priority, across all workers), :class:`FifoQueue` (one score) and :class:`LifoQueue` (one score,
inverted sequence numbers). Start requests follow Scrapy's order: after the other requests of their
priority (:data:`START_REQUEST_OFFSET`), except one the engine would send at once (:data:`START_NOW`).

**Crawl-wide politeness** (``SCHEDULER_POLITENESS = "cluster"``, docs/politeness.md). The frontier enforces
the limits (``lua/polite.lua``: a domain that may not be fetched yet is not leased); :class:`DomainLimits`
answers a domain's ``(delay, concurrency, jitter)``: Scrapy's ``DOWNLOAD_DELAY``,
``CONCURRENT_REQUESTS_PER_DOMAIN`` and ``DOWNLOAD_DELAY_JITTER`` held crawl-wide, overridden by the most
specific ``DOMAIN_LIMITS`` glob. The jitter only lengthens a delay; ``concurrency: 0`` means no cap.

**Leased requests** wait for the engine in a :class:`LeasedBuffer`, best first.

**Retry timing**: pure functions of the attempt number, the settings and the server's ``Retry-After``
(used by the retry middleware and by politeness penalties).
"""
from __future__ import annotations

import fnmatch
import heapq
import itertools
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timezone
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any, Protocol

from scrapy.utils.httpobj import urlparse_cached

from scrapy_dist.settings.reader import QUEUE_ALIASES

if TYPE_CHECKING:
    from scrapy import Request

    from scrapy_dist.frontier.layout import ShardRouter
    from scrapy_dist.frontier.ledger import Ledger
    from scrapy_dist.frontier.syncloop import SyncLoop
    from scrapy_dist.settings import DistSettings


class QueueOrder(Protocol):
    """What the frontier asks of a queue class."""

    #: ``"asc"``: sequence numbers grow (FIFO within a score); ``"desc"``: they shrink (LIFO).
    sequence: str

    def score(self, request: Request) -> float: ...


def _start_offset(request: Request) -> float:
    """Start requests yield to callback requests of equal priority, as in Scrapy >= 2.13 (whose
    scheduler keeps them in separate start queues served after the others of the same priority):
    half a priority step later, still before any lower priority."""
    return START_REQUEST_OFFSET if request.meta.get("is_start_request") else 0.0


#: added to the score of a start request (``meta["is_start_request"]``, set by Scrapy)
START_REQUEST_OFFSET = 0.5
#: the score of a start request Scrapy's engine would send at once (the worker has room and holds nothing
#: better): ahead of every priority, as the engine takes it before any request enqueued after it
START_NOW = -1e15


def sends_now(request: Request, ledger: Ledger, loop: SyncLoop | None, concurrency: int) -> bool:
    """Whether ``request`` is a start request Scrapy's engine would send at once (score it
    :data:`START_NOW`): the crawl is not paused, nothing is queued crawl-wide as far as this worker knows,
    and the worker has room for it (:meth:`~scrapy_dist.frontier.ledger.Ledger.starts_now`)."""
    if not request.meta.get("is_start_request") or loop is None or loop.paused or loop.local_pause:
        return False
    queued = loop.state.queued if loop.state is not None else loop.backlog
    return not queued and ledger.starts_now(concurrency)


class PriorityQueue:
    """Higher ``request.priority`` first; FIFO within a priority; start requests after the others of
    their priority."""

    sequence = "asc"

    def score(self, request: Request) -> float:
        return -request.priority + _start_offset(request)


class FifoQueue:
    """First in, first out; priorities ignored; start requests after the others."""

    sequence = "asc"

    def score(self, request: Request) -> float:
        return _start_offset(request)


class LifoQueue:
    """Last in, first out; priorities ignored; start requests after the others."""

    sequence = "desc"

    def score(self, request: Request) -> float:
        return _start_offset(request)


#: scrapy-redis's other names of its three queues: a project switched by replacing ``scrapy_redis`` with
#: ``scrapy_dist`` (``scrapy_dist.queue.SpiderQueue``, as in scrapy-redis's example settings) keeps its order
SpiderQueue = FifoQueue
SpiderStack = LifoQueue
SpiderPriorityQueue = PriorityQueue

#: scrapy-redis names, for ``SCHEDULER_QUEUE_CLASS`` values copied from a scrapy-redis project
ALIASES = {alias: globals()[name] for alias, name in QUEUE_ALIASES.items()}


# -- leased requests, best first ---------------------------------------------------------------------
#: A leased member and the shard it was leased from (always 0 with one shard).
Lease = tuple[int, bytes]


class LeasedBuffer:
    """Leased requests waiting for the engine: a heap on the queue score, ties in the order leased; the
    worker starts the best one it holds first, whatever round or shard it came from."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Request, Lease]] = []
        self._count = itertools.count()

    def push(self, score: float, request: Request, lease: Lease) -> None:
        heapq.heappush(self._heap, (score, next(self._count), request, lease))

    def pop(self) -> tuple[Request, Lease]:
        _, _, request, lease = heapq.heappop(self._heap)
        return request, lease

    def pop_least_loaded(self, load: Callable[[Request], int]) -> tuple[Request, Lease]:
        """The best request of the download slot with the fewest active downloads (Scrapy's
        ``DownloaderAwarePriorityQueue``): a scan of the buffer, which holds at most a prefetch."""
        heap = self._heap
        best = min(range(len(heap)), key=lambda i: (load(heap[i][2]), heap[i][0], heap[i][1]))
        entry = heap[best]
        heap[best] = heap[-1]
        heap.pop()
        heapq.heapify(heap)
        return entry[2], entry[3]

    def best_score(self) -> float:
        """The score of the request :meth:`pop` returns next (``inf`` when empty)."""
        return self._heap[0][0] if self._heap else math.inf

    def leases(self) -> list[Lease]:
        """Every lease in the buffer (for releasing them at close)."""
        return [e[-1] for e in self._heap]

    def clear(self) -> None:
        self._heap.clear()

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)


# -- crawl-wide politeness ------------------------------------------------------------------------
@dataclass(frozen=True)
class DomainLimit:
    delay: float
    concurrency: int
    jitter: float

    def encode(self) -> str:
        """The ``"delay concurrency jitter"`` form stored in Redis."""
        return f"{self.delay!r} {self.concurrency} {self.jitter!r}"


def _specificity(pattern: str) -> tuple[int, int]:
    wild = sum(pattern.count(c) for c in "*?[")
    return (0 if wild else 1, len(pattern) - wild)


class DomainLimits:
    """Limits per domain from settings (see the module docstring); answers are cached per domain."""

    def __init__(self, default: DomainLimit, rules: dict[str, dict[str, Any]] | None = None) -> None:
        self.default = default
        self.rules = sorted((rules or {}).items(), key=lambda kv: _specificity(kv[0].lower()), reverse=True)
        self._cache: dict[str, DomainLimit] = {}

    @classmethod
    def from_dist(cls, ds: DistSettings) -> DomainLimits:
        """The limits of a crawl's typed settings (``DOMAIN_LIMITS`` over Scrapy's per-domain ones)."""
        s = ds.scheduler
        default = DomainLimit(
            delay=s.download_delay,
            concurrency=s.concurrent_requests_per_domain,
            jitter=s.download_delay_jitter,
        )
        return cls(default, {k: dict(v) for k, v in s.domain_limits.items()})

    def bound(self) -> str:
        """``"<delay> <jitter>"``: the longest delay and the largest jitter any domain has here. The
        frontier clamps a domain's limits read from Redis to it (garbage someone wrote there, ``86400 1
        10``, would hold each request of the domain back for days)."""
        rules = [self.default.delay, *(float(r.get("delay", self.default.delay)) for _, r in self.rules)]
        jitters = [self.default.jitter, *(float(r.get("jitter", self.default.jitter)) for _, r in self.rules)]
        return f"{max(rules)!r} {max(jitters)!r}"

    def for_domain(self, domain: str) -> DomainLimit:
        hit = self._cache.get(domain)
        if hit is not None:
            return hit
        limit = self.default
        for pattern, rule in self.rules:
            if fnmatch.fnmatchcase(domain, pattern.lower()):
                limit = DomainLimit(
                    delay=float(rule.get("delay", self.default.delay)),
                    concurrency=int(rule.get("concurrency", self.default.concurrency)),
                    jitter=float(rule.get("jitter", self.default.jitter)),
                )
                break
        if len(self._cache) > 100_000:
            self._cache.clear()
        self._cache[domain] = limit
        return limit


class DomainPenalties:
    """Crawl-wide politeness as responses come: after a 429 or 503 (:func:`penalty_seconds`) no worker
    leases a request of that domain for a while; written through the ledger in the next round."""

    def __init__(self, limits: DomainLimits | None, ledger: Ledger, router: ShardRouter, stats: Any) -> None:
        self.limits = limits
        self.ledger = ledger
        self.router = router
        self.stats = stats

    def penalize(self, domain: str, seconds: float) -> None:
        """No request of ``domain`` is leased for ``seconds`` (on the shard holding its politeness state)."""
        self.ledger.penalize(domain, seconds, time.monotonic(), self.router.domain(domain))

    def response_received(self, response: Any, request: Request, spider: Any = None) -> None:
        """Signal handler: 429 and 503 slow the whole crawl down on that domain."""
        domain = (urlparse_cached(request).hostname or "").lower()
        limit = self.limits.for_domain(domain) if self.limits else None
        seconds = penalty_seconds(response.status, response.headers.get(b"Retry-After"), limit, time.time())
        if seconds is None:
            return
        self.stats.inc_value(f"scheduler/politeness/penalized/{response.status}")
        self.penalize(domain, seconds)


#: fields of the domain info hash read by :func:`busiest_domains` at most (it is a scan)
DOMAIN_SCAN_LIMIT = 20_000


def busiest_domains(client: Any, keys: Any, now: float, limit: int = 10) -> list[dict[str, Any]]:
    """The domains with the largest backlog, with their limits and slots in use (for ``status``), from at
    most :data:`DOMAIN_SCAN_LIMIT` fields of ``{spider}:domains:info`` (HSCAN: a sample on a larger crawl).
    """
    info: dict[str, dict[str, str]] = {}
    for n, (field, value) in enumerate(client.hscan_iter(keys.domain_info, count=1000)):
        if n >= DOMAIN_SCAN_LIMIT:
            break
        f = field.decode(errors="replace") if isinstance(field, bytes) else str(field)
        v = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
        kind, _, domain = f.partition(":")
        info.setdefault(domain, {})[kind] = v
    rows = []
    for domain, d in info.items():
        delay, conc, jitter = (d.get("l") or "0 0 0").split(" ")
        rows.append({
            "domain": domain,
            "backlog": int(float(d.get("b", 0))),
            "in_flight": int(float(d.get("i", 0))),
            "delay": float(delay),
            "concurrency": int(conc),
            "jitter": float(jitter),
            "next_in": max(0.0, round(float(d.get("n", 0)) - now, 3)),
        })
    rows.sort(key=lambda r: (r["backlog"], r["in_flight"]), reverse=True)
    return rows[:limit]


def penalty_seconds(
    status: int, retry_after: bytes | None, limit: DomainLimit | None, now: float
) -> float | None:
    """How long the whole crawl stays off a domain after a response of ``status`` (``None``: no penalty):
    for 429 and 503, ``Retry-After`` when the server gives one, else twice the domain's delay (at least a
    second); never more than an hour."""
    if status not in (429, 503):
        return None
    seconds = max(1.0, 2 * limit.delay) if limit else 1.0
    if retry_after:
        parsed = parse_retry_after(retry_after, now=now)
        if parsed is not None:
            seconds = parsed
    return min(seconds, 3600.0)


# -- retry timing --------------------------------------------------------------------------------
#: upward jitter of a backoff delay: the n-th retry waits between nominal and (1 + JITTER) x nominal
JITTER = 0.5
#: statuses whose ``Retry-After`` header sets the retry delay (RFC 9110 section 10.2.3)
RETRY_AFTER_STATUSES = frozenset({429, 503})


def backoff_delay(
    retry_times: int, base: float, cap: float, rng: Callable[[], float] = random.random
) -> float:
    """Seconds to wait before retry number ``retry_times`` (1 for the first retry).

    Exponential with upward jitter: ``base * 2 ** (retry_times - 1)`` times a random factor in
    ``[1, 1 + JITTER)``, never more than ``cap``. The jitter only adds, so ``base * 2 ** (n - 1)`` (or
    ``cap``) is a guaranteed minimum gap, while retries of requests that failed together spread out.
    """
    if base <= 0 or cap <= 0:
        return 0.0
    exponent = max(0, retry_times - 1)
    # 2**1024 overflows a float; anything that large is over any sensible cap anyway
    nominal = cap if exponent >= 1000 else base * 2.0**exponent
    return min(cap, nominal * (1.0 + JITTER * rng()))


def parse_retry_after(value: bytes | str | None, now: float | None = None) -> float | None:
    """Seconds to wait according to a ``Retry-After`` header value, or ``None`` if it is absent or invalid.

    Accepts delay-seconds (``"120"``, leniently ``"1.5"``) and an HTTP date (``"Wed, 21 Oct 2015 07:28:00
    GMT"``, compared with ``now``, unix time). A date in the past gives ``0.0``.
    """
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("latin-1")
        except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
            return None
    text = value.strip()
    if not text:
        return None
    if text.isascii() and text.replace(".", "", 1).isdigit():
        seconds = float(text)
        return seconds if math.isfinite(seconds) else None
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None:  # pragma: no cover - older Pythons returned None for garbage
        return None
    if when.tzinfo is None:  # RFC 9110 dates are GMT; a date without zone is read as such
        when = when.replace(tzinfo=timezone.utc)
    now = time.time() if now is None else now
    return max(0.0, when.timestamp() - now)


def retry_delay(
    retry_times: int,
    base: float,
    cap: float,
    *,
    status: int | None = None,
    retry_after: bytes | str | None = None,
    now: float | None = None,
    rng: Callable[[], float] = random.random,
) -> float:
    """The delay of a retry: ``Retry-After`` (on 429/503, capped by ``cap``) if given and valid, else
    :func:`backoff_delay`."""
    if status in RETRY_AFTER_STATUSES:
        hinted = parse_retry_after(retry_after, now=now)
        if hinted is not None:
            return min(cap, hinted) if cap > 0 else hinted
    return backoff_delay(retry_times, base, cap, rng)
