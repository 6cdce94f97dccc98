"""Reading a running crawl from outside: ``status`` with the filter's figures (``status``), the Prometheus
exporter (``metrics``) and the dashboard (``dashboard``, with its static files in ``dashboard_static/``).

Here, what a monitoring answer may hold, whatever Redis holds: ids and texts cut to a length, numbers kept
only when finite and in range, lists and label sets capped (the rest summed as ``other`` or counted). All
three read values anyone with write access to Redis may have set; these functions keep their answers small
and well-formed.

May import: ``settings``, ``redis``, ``wire``, ``dupefilter``, ``frontier``, ``utils``; nothing imports it
but ``cli``.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from scrapy_dist.redis.scripts import text

__all__ = [
    "ID_LIMIT", "MAX_VALUE", "REASON_LIMIT", "STAT_LIMIT", "TEXT_LIMIT", "bounded_id", "bounded_text",
    "decode_hash", "decode_stats", "finite", "top_counts",
]

#: Longest worker id (or other label) an answer carries; longer ones are cut and made unique by a digest.
ID_LIMIT = 120
#: Longest free text (a host, a reason, a stat's text value) an answer carries.
TEXT_LIMIT = 200
#: Largest magnitude a number read from Redis may have (Redis's own integers stop there); anything beyond,
#: and anything not finite, is skipped and counted.
MAX_VALUE = float(2**63)
#: Stats fields an answer carries at most (Scrapy's own stats are a few hundred).
STAT_LIMIT = 1000
#: Reasons (errors, dead letters) listed per answer; the rarer ones are summed as ``other``.
REASON_LIMIT = 20
#: Stats kept before any other when the stats hash is over :data:`STAT_LIMIT`.
ESSENTIAL_STATS = frozenset({
    "response_received_count", "item_scraped_count", "item_dropped_count", "scheduler/enqueued",
    "downloader/response_bytes", "log_count/ERROR", "start_time", "finish_time", "finish_reason",
})


def bounded_text(value: Any, limit: int = TEXT_LIMIT) -> str:
    """``value`` as text, cut to ``limit`` characters (ending in ``…`` when cut)."""
    s = text(value)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def bounded_id(value: Any, limit: int = ID_LIMIT) -> str:
    """An id as text of at most ``limit`` characters; a longer one keeps its head and ends in ``…`` and
    8 hex digits of its digest, so two long ids stay two labels."""
    s = text(value)
    if len(s) <= limit:
        return s
    digest = hashlib.blake2b(s.encode("utf-8", "surrogatepass"), digest_size=4).hexdigest()
    return f"{s[: limit - 9]}…{digest}"


def finite(value: Any) -> float | None:
    """``value`` as a float if it is a finite number within :data:`MAX_VALUE`, else ``None``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) and abs(number) <= MAX_VALUE else None


def _number(text: str) -> int | float | str | None:
    """A stat's text as a number, the text itself (cut) if it is no number, ``None`` if it is a number
    out of range (not finite, or beyond :data:`MAX_VALUE`)."""
    if len(text) <= 40:
        try:
            whole = int(text)
        except ValueError:
            pass
        else:
            return whole if abs(whole) <= MAX_VALUE else None
        try:
            value = float(text)
        except ValueError:
            pass
        else:
            return value if finite(value) is not None else None
    return bounded_text(text)


def decode_hash(raw: Mapping[Any, Any] | None) -> dict[str, str]:
    """An ``HGETALL`` reply as ``str -> str``."""
    return {text(k): text(v) for k, v in (raw or {}).items()}


def decode_stats(raw: Mapping[Any, Any] | None, limit: int = STAT_LIMIT) -> tuple[dict[str, Any], int]:
    """The crawl-wide stats hash with numbers as numbers, sorted by name, and how many fields were skipped:
    numbers not finite or beyond :data:`MAX_VALUE`, names over :data:`TEXT_LIMIT` characters, and the
    fields beyond ``limit`` (:data:`ESSENTIAL_STATS` are kept first)."""
    fields = decode_hash(raw)
    names = sorted(k for k in fields if len(k) <= TEXT_LIMIT)
    skipped = len(fields) - len(names)
    if len(names) > limit:
        first = [k for k in names if k in ESSENTIAL_STATS]
        rest = [k for k in names if k not in ESSENTIAL_STATS][: limit - len(first)]
        skipped += len(names) - len(first) - len(rest)
        names = sorted(first + rest)
    out: dict[str, Any] = {}
    for name in names:
        value = _number(fields[name])
        if value is None:
            skipped += 1
        else:
            out[name] = value
    return out, skipped


def top_counts(counts: Mapping[str, int] | Iterable[tuple[str, int]], limit: int = REASON_LIMIT,
               text_limit: int = 100) -> list[tuple[str, int]]:
    """The ``limit`` largest counts (names cut to ``text_limit``), the rest summed as ``other``."""
    merged: Counter[str] = Counter()
    for name, n in counts.items() if isinstance(counts, Mapping) else counts:
        merged[bounded_text(name, text_limit)] += n
    top = dict(merged.most_common(limit))
    rest = sum(merged.values()) - sum(top.values())
    if rest:
        top["other"] = top.get("other", 0) + rest
    return list(top.items())
