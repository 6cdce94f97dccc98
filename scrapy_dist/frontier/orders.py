"""Which request goes when: queue orders, leased requests best first, crawl-wide politeness, retry timing,
and dead letters (anyone with access to Redis can write that list: its parsers refuse anything malformed)."""

from __future__ import annotations

import base64
import binascii
import fnmatch
import heapq
import itertools
import json
import math
import random
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from datetime import timezone
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any, Protocol, cast

import msgpack
from scrapy.utils.httpobj import urlparse_cached

from scrapy_dist.exceptions import RejectedEntry, UnserializableRequest
from scrapy_dist.redis import scripts
from scrapy_dist.settings.reader import QUEUE_ALIASES
from scrapy_dist.utils import finite_float
from scrapy_dist.wire import codec
from scrapy_dist.wire.codec import EntryPolicy
from scrapy_dist.wire.entrypolicy import DEAD, FRONTIER, SIGNED_HEAD, TAG_BYTES, VERSION, as_scheduled

if TYPE_CHECKING:
    from scrapy import Request, Spider

    from scrapy_dist.frontier.layout import ShardRouter
    from scrapy_dist.frontier.ledger import Ledger
    from scrapy_dist.settings import DistSettings

START_REQUEST_OFFSET = 0.5  #: added to a start request's score: others of its priority go first (Scrapy 2.13)
START_NOW = -1e15  #: the score of a start request Scrapy's engine would send at once: ahead of every priority
NOT_SET = object()  #: what :meth:`RevisitRules.for_url` answers when no rule matches
DOMAIN_SCAN_LIMIT = 20_000  #: most fields of the domain info hash :func:`busiest_domains` reads (a scan)
JITTER = 0.5  #: upward jitter of a backoff delay: the n-th retry waits nominal to (1 + JITTER) x nominal
RETRY_AFTER_STATUSES = frozenset({429, 503})  #: statuses whose ``Retry-After`` sets the delay (RFC 9110)
DETAIL_LIMIT = 300  #: longest exception message kept in a record
MAX_RECORD_BYTES = 2 * 1024 * 1024  #: largest record ``scrapy-dist dead`` accepts (1 MiB in base64, the rest)
MAX_AT = 1e11  #: latest ``at`` a record may carry (year 5138): later is garbage


class QueueOrder(Protocol):
    """What the frontier asks of a queue class."""

    sequence: str  #: ``"asc"``: sequence numbers grow (FIFO within a score); ``"desc"``: they shrink (LIFO)

    def score(self, request: Request) -> float: ...


def _start_offset(request: Request) -> float:
    return START_REQUEST_OFFSET if request.meta.get("is_start_request") else 0.0


class PriorityQueue:
    """Higher ``request.priority`` first; FIFO within a priority."""

    sequence = "asc"

    def score(self, request: Request) -> float:
        return -request.priority + _start_offset(request)


class FifoQueue:
    """First in, first out; priorities ignored."""

    sequence = "asc"

    def score(self, request: Request) -> float:
        return _start_offset(request)


class LifoQueue(FifoQueue):
    """Last in, first out; priorities ignored."""

    sequence = "desc"


SpiderQueue, SpiderStack, SpiderPriorityQueue = FifoQueue, LifoQueue, PriorityQueue  #: scrapy-redis's names

#: scrapy-redis paths, for ``SCHEDULER_QUEUE_CLASS`` values copied from a scrapy-redis project
ALIASES = {alias: globals()[name] for alias, name in QUEUE_ALIASES.items()}

Lease = tuple[int, bytes]  #: A leased member and the shard it was leased from (always 0 with one shard).


@dataclass(eq=False)
class LeasedBuffer:
    """Leased requests waiting for the engine: a heap on the queue score, ties in the order leased."""

    _heap: list[tuple[float, int, Request, Lease]] = field(default_factory=list)
    _count: Iterator[int] = field(default_factory=itertools.count)

    def push(self, score: float, request: Request, lease: Lease) -> None:
        heapq.heappush(self._heap, (score, next(self._count), request, lease))

    def pop(self) -> tuple[Request, Lease]:
        return heapq.heappop(self._heap)[2:]

    def pop_least_loaded(self, load: Callable[[Request], int]) -> tuple[Request, Lease]:
        """The best request of the least busy download slot (Scrapy's ``DownloaderAwarePriorityQueue``)."""
        heap = self._heap
        entry = heap.pop(min(range(len(heap)), key=lambda i: (load(heap[i][2]), heap[i][0], heap[i][1])))
        heapq.heapify(heap)
        return entry[2:]

    def best_score(self) -> float:
        return self._heap[0][0] if self._heap else math.inf

    def leases(self) -> list[Lease]:
        return [e[-1] for e in self._heap]

    def clear(self) -> None:
        self._heap.clear()

    def __len__(self) -> int:
        return len(self._heap)


@dataclass(frozen=True)
class DomainLimit:
    delay: float
    concurrency: int
    jitter: float

    def encode(self) -> str:  # as stored in Redis
        return f"{self.delay!r} {self.concurrency} {self.jitter!r}"


def specificity(pattern: str) -> tuple[int, int]:
    wild = sum(pattern.count(c) for c in "*?[")
    return (0 if wild else 1, len(pattern) - wild)


class DomainLimits:
    """A domain's ``(delay, concurrency, jitter)``: Scrapy's per-domain settings, overridden by the most
    specific ``DOMAIN_LIMITS`` glob. Jitter only lengthens a delay; ``concurrency: 0`` means no cap."""

    def __init__(self, default: DomainLimit, rules: dict[str, dict[str, Any]] | None = None) -> None:
        self.default = default
        self.rules = sorted((rules or {}).items(), key=lambda kv: specificity(kv[0].lower()), reverse=True)
        self._cache: dict[str, DomainLimit] = {}

    @classmethod
    def from_dist(cls, ds: DistSettings) -> DomainLimits:
        s = ds.scheduler
        return cls(DomainLimit(s.download_delay, s.concurrent_requests_per_domain, s.download_delay_jitter),
                   {k: dict(v) for k, v in s.domain_limits.items()})

    def bound(self) -> str:
        """``"<delay> <jitter>"``, the largest here: the frontier clamps limits read from Redis to it."""
        rules = [self.default.delay, *(float(r.get("delay", self.default.delay)) for _, r in self.rules)]
        jitters = [self.default.jitter, *(float(r.get("jitter", self.default.jitter)) for _, r in self.rules)]
        return f"{max(rules)!r} {max(jitters)!r}"

    def for_domain(self, domain: str) -> DomainLimit:
        if (hit := self._cache.get(domain)) is not None:
            return hit
        limit = d = self.default
        for pattern, rule in self.rules:
            if fnmatch.fnmatchcase(domain, pattern.lower()):
                delay, jitter = float(rule.get("delay", d.delay)), float(rule.get("jitter", d.jitter))
                limit = DomainLimit(delay, int(rule.get("concurrency", d.concurrency)), jitter)
                break
        if len(self._cache) > 100_000:
            self._cache.clear()
        self._cache[domain] = limit
        return limit


class RevisitRules:
    """``REVISIT_AFTER`` rules: a glob with a ``/`` matches the URL, any other the host (case-insensitive).
    URL rules are tried first; within each kind the most specific wins."""

    def __init__(self, rules: Mapping[str, float | None] | None = None) -> None:
        lowered = [(p.lower(), "/" in p, s) for p, s in (rules or {}).items()]
        self.rules = sorted(lowered, key=lambda r: (r[1], *specificity(r[0])), reverse=True)

    def __bool__(self) -> bool:
        return bool(self.rules)

    def for_url(self, url: str, host: str) -> Any:
        """The delay of the most specific matching rule (None: no revisit), or ``NOT_SET``."""
        low_url, low_host = url.lower(), host.lower()
        for pattern, on_url, seconds in self.rules:
            if fnmatch.fnmatchcase(low_url if on_url else low_host, pattern):
                return seconds
        return NOT_SET


@dataclass(eq=False)
class DomainPenalties:
    """After a 429 or 503 no worker leases a request of that domain for a while (:func:`penalty_seconds`)."""

    limits: DomainLimits | None
    ledger: Ledger
    router: ShardRouter
    stats: Any

    def penalize(self, domain: str, seconds: float) -> None:
        self.ledger.penalize(domain, seconds, time.monotonic(), self.router.domain(domain))

    def response_received(self, response: Any, request: Request, spider: Any = None) -> None:
        domain = (urlparse_cached(request).hostname or "").lower()
        limit = self.limits.for_domain(domain) if self.limits else None
        seconds = penalty_seconds(response.status, response.headers.get(b"Retry-After"), limit, time.time())
        if seconds is not None:
            self.stats.inc_value(f"scheduler/politeness/penalized/{response.status}")
            self.penalize(domain, seconds)


def busiest_domains(client: Any, keys: Any, now: float, limit: int = 10) -> list[dict[str, Any]]:
    """The domains with the largest backlog, their limits and slots in use (for ``status``)."""
    def numbers(text: str, width: int) -> list[float]:  # [] unless ``width`` numbers, none of them garbage
        out = [finite_float(part) for part in text.split(" ")]
        return [] if None in out or len(out) != width else cast("list[float]", out)
    info: dict[str, dict[str, str]] = {}
    for name, value in itertools.islice(client.hscan_iter(keys.domain_info, count=1000), DOMAIN_SCAN_LIMIT):
        kind, _, domain = scripts.text(name).partition(":")
        parts = scripts.text(value).split(" ")
        if kind == "p" and len(parts) in (2, 5):  # "<slots> <next>[ <delay> <concurrency> <jitter>]"
            info.setdefault(domain, {}).update(i=parts[0], n=parts[1], l=" ".join(parts[2:]))
        elif kind == "s" and len(parts) == 6:  # the layout before: "<backlog> <slots> <next> <limits>"
            info[domain] = {"i": parts[1], "n": parts[2], "l": " ".join(parts[3:]), **info.get(domain, {})}
        elif kind in ("i", "n", "l") and domain:  # the four fields of the layout before it
            info.setdefault(domain, {}).setdefault(kind, scripts.text(value))
    for name, _ in itertools.islice(client.zscan_iter(keys.domains, count=1000), DOMAIN_SCAN_LIMIT):
        info.setdefault(scripts.text(name), {})
    pipe = client.pipeline(transaction=False)
    for domain in info:
        pipe.zlexcount(keys.queue, f"[{domain}\0".encode(), f"({domain}\1".encode())
    backlogs = pipe.execute() if info else []
    default = numbers(scripts.text(client.hget(keys.control, "limits") or b""), 3) or [0.0, 0.0, 0.0]
    rows = []
    for (domain, d), backlog in zip(info.items(), backlogs, strict=True):
        limits = numbers(d["l"], 3) if d.get("l") else default
        if not limits or not (slots_next := numbers(f"{d.get('i', 0)} {d.get('n', 0)}", 2)):
            continue  # garbage hides its own row; the next sync call on the domain repairs it (polite.lua)
        (delay, conc, jitter), (slots, at) = limits, slots_next
        rows.append({"domain": domain, "backlog": int(backlog), "in_flight": int(slots), "delay": delay,
                     "concurrency": int(conc), "jitter": jitter, "next_in": max(0.0, round(at - now, 3))})
    rows.sort(key=lambda r: (r["backlog"], r["in_flight"]), reverse=True)
    return rows[:limit]


def penalty_seconds(status: int, retry_after: bytes | None, limit: DomainLimit | None,
                    now: float) -> float | None:
    """How long the crawl stays off a domain after a 429 or 503 (``None``: no penalty): ``Retry-After``
    if given, else twice the domain's delay (at least a second); at most an hour."""
    if status not in RETRY_AFTER_STATUSES:
        return None
    if (seconds := parse_retry_after(retry_after, now=now)) is None:
        seconds = max(1.0, 2 * limit.delay) if limit else 1.0
    return min(seconds, 3600.0)


def backoff_delay(retry_times: int, base: float, cap: float,
                  rng: Callable[[], float] = random.random) -> float:
    """Seconds before retry ``retry_times`` (1: the first): doubling from ``base``, jittered up, capped."""
    if base <= 0 or cap <= 0:
        return 0.0
    exponent = max(0, retry_times - 1)
    nominal = cap if exponent >= 1000 else base * 2.0**exponent  # 2**1024 overflows a float
    return min(cap, nominal * (1.0 + JITTER * rng()))


def parse_retry_after(value: bytes | str | None, now: float | None = None) -> float | None:
    """Seconds to wait according to a ``Retry-After`` value (delay-seconds, leniently ``"1.5"``, or an HTTP
    date compared with ``now``, unix time; a past date gives 0.0), or ``None`` if absent or invalid."""
    text = (value.decode("latin-1") if isinstance(value, bytes) else value or "").strip()
    if not text:
        return None
    if text.isascii() and text.replace(".", "", 1).isdigit():
        seconds = float(text)
        return seconds if math.isfinite(seconds) else None
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # RFC 9110 dates are GMT
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def retry_delay(retry_times: int, base: float, cap: float, *, status: int | None = None,
                now: float | None = None, retry_after: bytes | str | None = None,
                rng: Callable[[], float] = random.random) -> float:
    """``Retry-After`` (on 429/503, capped by ``cap``) if given and valid, else :func:`backoff_delay`."""
    if status in RETRY_AFTER_STATUSES and (hinted := parse_retry_after(retry_after, now=now)) is not None:
        return min(cap, hinted) if cap > 0 else hinted
    return backoff_delay(retry_times, base, cap, rng)


def dead_letter_record(request: Request, *, reason: str, worker: str, spider: Spider | None = None,
                       status: int | None = None, detail: str = "", attempts: int | None = None,
                       now: float | None = None, policy: EntryPolicy | None = None) -> str:
    """The JSON record of ``request`` as scheduled (without credential headers a middleware added), signed
    by ``policy``; ``"request": null`` if it cannot be encoded."""
    try:
        encoded = codec.encode_request(as_scheduled(request), spider, policy)
        payload: str | None = base64.b64encode(encoded).decode("ascii")
    except UnserializableRequest:
        payload = None
    record: dict[str, Any] = {
        "request": payload, "url": request.url, "reason": reason,
        "attempts": _int(request.meta.get("retry_times"), 0) + 1 if attempts is None else attempts,
        "worker": worker, "at": time.time() if now is None else now}
    if status is not None:
        record["status"] = status
    if detail:
        record["detail"] = detail[:DETAIL_LIMIT]
    return json.dumps(record)


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


@dataclass(frozen=True)
class DeadLetter:
    """A dead-letter record read back; ``raw`` is the exact list element (for ``LREM``)."""

    raw: bytes
    url: str
    reason: str
    attempts: int
    worker: str
    at: float
    status: int | None
    detail: str
    payload: bytes | None

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("raw", "payload")}
        d["request"] = base64.b64encode(self.payload).decode("ascii") if self.payload is not None else None
        return d


def parse_record(raw: bytes, max_bytes: int = MAX_RECORD_BYTES) -> DeadLetter:
    """The one parser of a dead-letter record. Raises only :class:`RejectedEntry` (``bad_deadletter``), for
    anything but a JSON object whose fields have their documented types and ranges."""
    if not isinstance(raw, (bytes, bytearray)):
        raise RejectedEntry("bad_deadletter", f"record of type {type(raw).__name__}")
    if len(raw := bytes(raw)) > max_bytes:
        raise RejectedEntry("bad_deadletter", f"record of {len(raw)} bytes")
    try:
        d = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RejectedEntry("bad_deadletter", f"not JSON: {exc}"[:200]) from None
    except RecursionError:
        raise RejectedEntry("bad_deadletter", "not JSON: nested too deep") from None
    if not isinstance(d, dict):
        raise RejectedEntry("bad_deadletter", f"record is a {type(d).__name__}")

    def field(name: str, types: type | tuple[type, ...], default: Any) -> Any:
        value = d.get(name, default)
        if value is not default and (not isinstance(value, types) or isinstance(value, bool)):
            raise RejectedEntry("bad_deadletter", f"{name} has type {type(value).__name__}")
        return value
    url = field("url", str, "")
    encoded = field("request", str, None)
    payload = None
    if encoded is not None:
        try:
            payload = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise RejectedEntry("bad_deadletter", "request is not base64") from None
    status, attempts = field("status", int, None), field("attempts", int, 0)
    for name, value, top in (("status", status, 999), ("attempts", attempts, 10**9)):
        if value is not None and not 0 <= value <= top:
            raise RejectedEntry("bad_deadletter", f"{name} out of range")
    try:
        at = float(field("at", (int, float), 0.0))
    except OverflowError:  # an integer too big for a float
        at = math.inf
    if not (math.isfinite(at) and 0 <= at <= MAX_AT):
        raise RejectedEntry("bad_deadletter", "at is not a time")
    return DeadLetter(raw=raw, url=url, reason=str(field("reason", str, "")), attempts=attempts, at=at,
                      status=status, worker=field("worker", str, ""), detail=field("detail", str, ""),
                      payload=payload)


def requeue_payload(
    payload: bytes, allowed_schemes: tuple[str, ...] = ("http", "https"), max_bytes: int = 1024 * 1024,
    policy: EntryPolicy = codec.DEFAULT_POLICY) -> tuple[bytes, int]:
    """``(payload, priority)`` of a dead letter to enqueue again (retry counter removed, URL checked).
    With a secret, a signed record must verify as this crawl's dead letter and is signed again as a queue
    entry with the same nonce (requeued twice, fetched once); an unsigned one stays unsigned."""
    d = codec.load_payload(payload, max_bytes)
    codec.check_url(d.get("u"), allowed_schemes)
    signed = policy.secret is not None and codec.split_payload(payload, max_bytes)[0] != VERSION
    if signed and not policy.bound(kind=DEAD).verify(payload):
        raise RejectedEntry("bad_tag", "its tag does not verify as a dead letter of this crawl"
                                       " (another crawl or secret)")
    if isinstance(meta := d.get("M"), dict):
        meta.pop("retry_times", None)
        if not meta:
            del d["M"]
    priority = _int(d.get("p"), 0)
    body = msgpack.packb(d, use_bin_type=True)
    if signed:
        return policy.bound(kind=FRONTIER).seal(body, payload[1 + TAG_BYTES : SIGNED_HEAD]), priority
    return codec.DEFAULT_POLICY.seal(body), priority


def reason_matches(reason: str, wanted: str) -> bool:
    """Whether a record's ``reason`` is ``wanted``, case-insensitively: the exact reason, or the last dotted
    part of an exception name (``DownloadTimeoutError`` for ``scrapy.exceptions.DownloadTimeoutError``)."""
    r, w = reason.lower(), wanted.lower()
    return r == w or r.rsplit(".", 1)[-1] == w
