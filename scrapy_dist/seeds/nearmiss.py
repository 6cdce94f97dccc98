"""Seeds pushed to a key no crawl reads: ``site:start_url`` (or ``Site:start_urls``, ``site:starturls``) while
the crawl reads ``site:start_urls``. Nothing fails -- the seeds just wait for ever -- so the tools say so:
``scrapy-dist status`` and ``push`` list such keys, and a worker logs one WARNING at start.

A *near miss* is a LIST, SET or ZSET with entries whose name is close to the crawl's seeds key (same length
within :data:`LENGTH_SLACK`, a :class:`difflib.SequenceMatcher` ratio of at least :data:`SIMILARITY`,
case-insensitively) and is not some crawl's seeds key by the seeds key template (``other:start_urls`` is
the seeds key of a crawl named ``other``; ``Site:start_urls`` is taken for a misspelling of ``site``'s).

Finding them costs a bounded ``SCAN``: the worker makes one call of ``COUNT`` :data:`SCAN_COUNT` at start
(the whole keyspace of a small Redis), the tools at most :data:`TOOL_SCAN_CALLS`; then one pipelined
``TYPE`` and one length per candidate (at most :data:`MAX_HINTS`). A Redis user whose ACL lacks ``SCAN``
gets no hint and no error.
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scrapy_dist.redis.keys import CrawlKeys

__all__ = ["NearMiss", "candidates", "find", "find_async", "warn_at_start"]

logger = logging.getLogger(__name__)

#: Keys a ``SCAN`` call looks at.
SCAN_COUNT = 1000
#: ``SCAN`` calls the command-line tools make at most (the worker makes one).
TOOL_SCAN_CALLS = 10
#: How alike a name must be to the seeds key (``site:start_url`` vs ``site:start_urls``: 0.97).
SIMILARITY = 0.85
#: How many characters longer or shorter than the seeds key a near miss may be.
LENGTH_SLACK = 3
#: Near misses reported at most.
MAX_HINTS = 5
_LENGTH = {"list": "llen", "set": "scard", "zset": "zcard"}


@dataclass(frozen=True)
class NearMiss:
    """A key holding seeds that no crawl reads, and the seeds key it was probably meant to be."""

    key: str
    type: str
    entries: int
    meant: str

    def hint(self) -> str:
        """``3 entries in 'site:start_url' (list) -- did you mean 'site:start_urls'?`` (names as ``repr``)."""
        plural = "entry" if self.entries == 1 else "entries"
        return f"{self.entries:,} {plural} in {self.key!r} ({self.type}) -- did you mean {self.meant!r}?"


def _template_pattern(keys: CrawlKeys) -> re.Pattern[str]:
    """A pattern matching the seeds key of any crawl (``%(name)s`` / ``%(spider)s`` as any text)."""
    parts = re.split(r"%\((?:name|spider)\)s", keys.start_urls_template)
    literal = [re.escape(p.replace("%%", "%")) for p in parts]
    return re.compile(re.escape(keys.prefix) + ".+".join(literal) + r"\Z", re.DOTALL)


def candidates(names: Iterable[bytes | str], keys: CrawlKeys, read: Iterable[str] = ()) -> list[str]:
    """The names among ``names`` that look like a misspelling of ``keys.start_urls``, most alike first;
    ``read`` names seeds keys known to be read (another spider's ``redis_key``)."""
    meant = keys.start_urls
    other_crawl = _template_pattern(keys)
    skip = {meant, *read}
    scored = []
    for raw in names:
        name = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        if abs(len(name) - len(meant)) > LENGTH_SLACK or name in skip:
            continue
        if other_crawl.match(name) and name.lower() != meant.lower():  # Site:start_urls is no other crawl
            continue
        ratio = difflib.SequenceMatcher(None, name.lower(), meant.lower()).ratio()
        if ratio >= SIMILARITY:
            scored.append((-ratio, name))
    return [name for _, name in sorted(set(scored))]


def _pipeline(client: Any, names: list[str]) -> Any:
    p = client.pipeline(transaction=False)
    for name in names:
        p.type(name)
    return p


def _misses(names: list[str], types: list[Any], lengths: list[Any], meant: str) -> list[NearMiss]:
    out = []
    for name, kind, n in zip(names, types, lengths, strict=True):
        if isinstance(n, int) and n > 0:
            out.append(NearMiss(name, kind, n, meant))
    return out


def _scanned(cursor: Any) -> bool:
    """Whether a ``SCAN`` is over: cursor 0, or a Redis Cluster's cursors by node (one call there: each
    node is scanned from its start, and a hint needs no more)."""
    return isinstance(cursor, dict) or not int(cursor)


def _types(replies: list[Any]) -> list[str]:
    return [r.decode() if isinstance(r, bytes) else str(r) for r in replies]


def find(client: Any, keys: CrawlKeys, read: Iterable[str] = (),
         calls: int = TOOL_SCAN_CALLS) -> list[NearMiss]:
    """Near misses of ``keys.start_urls`` in a synchronous client's database (``calls`` ``SCAN`` calls at
    most, then two pipelined round trips)."""
    cursor, seen = 0, []
    for _ in range(calls):
        cursor, batch = client.scan(cursor, count=SCAN_COUNT)
        seen += batch
        if _scanned(cursor):
            break
    names = candidates(seen, keys, read)[:MAX_HINTS]
    if not names:
        return []
    types = _types(_pipeline(client, names).execute(raise_on_error=False))
    p = client.pipeline(transaction=False)
    kept = [(n, t) for n, t in zip(names, types, strict=True) if t in _LENGTH]
    for name, kind in kept:
        getattr(p, _LENGTH[kind])(name)
    lengths = p.execute(raise_on_error=False) if kept else []
    return _misses([n for n, _ in kept], [t for _, t in kept], lengths, keys.start_urls)


async def find_async(client: Any, keys: CrawlKeys, calls: int = 1) -> list[NearMiss]:
    """:func:`find` for a ``redis.asyncio`` client (a worker: one ``SCAN`` call)."""
    cursor, seen = 0, []
    for _ in range(calls):
        cursor, batch = await client.scan(cursor, count=SCAN_COUNT)
        seen += batch
        if _scanned(cursor):
            break
    names = candidates(seen, keys)[:MAX_HINTS]
    if not names:
        return []
    types = _types(await _pipeline(client, names).execute(raise_on_error=False))
    p = client.pipeline(transaction=False)
    kept = [(n, t) for n, t in zip(names, types, strict=True) if t in _LENGTH]
    for name, kind in kept:
        getattr(p, _LENGTH[kind])(name)
    lengths = await p.execute(raise_on_error=False) if kept else []
    return _misses([n for n, _ in kept], [t for _, t in kept], lengths, keys.start_urls)


async def warn_at_start(client: Any, keys: CrawlKeys) -> None:
    """Log one WARNING per near miss of the seeds key (a worker, once at start; an error is only logged
    at DEBUG: the hint is not worth a failed start)."""
    try:
        misses = await find_async(client, keys)
    except Exception:
        logger.debug("Looking for misspelt seeds keys failed", exc_info=True)
        return
    for miss in misses:
        logger.warning("%s This spider reads %r; seeds elsewhere are never crawled.", miss.hint(), miss.meant)
