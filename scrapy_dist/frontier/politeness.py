"""Crawl-wide politeness (``SCHEDULER_POLITENESS = "cluster"``): which limits apply to which domain
(docs/politeness.md).

The frontier enforces the limits (``lua/polite.lua``: a domain that may not be fetched yet is simply not
leased); this module only answers a domain's ``(delay, concurrency, jitter)``: Scrapy's
``DOWNLOAD_DELAY``, ``CONCURRENT_REQUESTS_PER_DOMAIN`` and ``DOWNLOAD_DELAY_JITTER`` held crawl-wide,
overridden by the most specific ``DOMAIN_LIMITS`` glob. The jitter only lengthens a delay, so a delay is a
guaranteed minimum gap across all workers; ``concurrency: 0`` means no crawl-wide cap.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scrapy_dist.settings import DistSettings


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
        from scrapy_dist.frontier.retrytiming import parse_retry_after

        parsed = parse_retry_after(retry_after, now=now)
        if parsed is not None:
            seconds = parsed
    return min(seconds, 3600.0)
