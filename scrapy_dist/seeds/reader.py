"""One worker's Redis side of the seeds key (``<spider>:start_urls``): :class:`SeedReader` takes seeds and
records them as in flight, waits for pushes, acknowledges, adopts the seeds of vanished workers and gives
seeds back -- one round trip per call (``lua/seeds_take.lua``, ``lua/seeds_adopt.lua``). What the seeds
become is :mod:`scrapy_dist.seeds.feed`.

Seeds pushed to a key no crawl reads (``site:start_url``, ``Site:start_urls``, ``site:starturls`` while
the crawl reads ``site:start_urls``) wait for ever, so the tools say so: ``scrapy-dist status`` and
``push`` list such keys (:func:`find`), and a worker logs one WARNING at start (:func:`warn_at_start`).
A *near miss* is a LIST, SET or ZSET with entries whose name is close to the crawl's seeds key (same
length within :data:`LENGTH_SLACK`, a :class:`difflib.SequenceMatcher` ratio of at least
:data:`SIMILARITY`, case-insensitively) and is not some crawl's seeds key by the seeds key template
(``other:start_urls`` is the seeds key of a crawl named ``other``). Finding them costs a bounded ``SCAN``:
one call of ``COUNT`` :data:`SCAN_COUNT` at start, the tools at most :data:`TOOL_SCAN_CALLS`; then one
pipelined ``TYPE`` and one length per candidate (at most :data:`MAX_HINTS`). A Redis user whose ACL lacks
``SCAN`` gets no hint and no error.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scrapy_dist.redis import scripts
from scrapy_dist.redis.scripts import text
from scrapy_dist.settings import defaults

if TYPE_CHECKING:
    from scrapy_dist.redis.keys import CrawlKeys

__all__ = [
    "ADOPT_BATCH", "BLOCK_SECONDS", "CONFIRM_POLL", "HELD_CAP", "POLL_SECONDS", "NearMiss", "SeedReader",
    "TakeResult", "candidates", "deadline_horizon", "find", "find_async", "held_cap", "held_most",
    "warn_at_start",
]

logger = logging.getLogger(__name__)

#: How long one blocking wait for a LIST seed lasts (seconds). A push wakes it at once; the timeout only
#: bounds how late the spider notices it should close, and renews the processing lease that often.
BLOCK_SECONDS = 1.0
#: SET and ZSET seeds cannot be waited for atomically (no blocking pop that also records the seed), so
#: they are polled this often (seconds): ten cheap calls a second per idle worker.
POLL_SECONDS = 0.1
#: Workers whose lease ran out are reported and adopted this many at a time.
ADOPT_BATCH = 10
#: How often to look whether taken seeds have reached the frontier (seconds, local only).
CONFIRM_POLL = 0.01
#: Most processing-list entries one worker may hold (it holds at most ``SeedFeed.max_unconfirmed`` plus a
#: batch); entries past it are garbage someone wrote there and go back to the seeds key (``seeds_pass``).
HELD_CAP = 10_000


def held_most(batch_size: int) -> int:
    """Unacknowledged seeds a worker taking ``batch_size`` at a time may hold: enough to keep the
    frontier's flush batches full."""
    return max(4 * max(1, batch_size), 2000)


def held_cap(batch_size: int) -> int:
    """The ``held_cap`` of :class:`SeedReader` for workers taking ``batch_size`` seeds at a time."""
    return max(HELD_CAP, 4 * held_most(batch_size))


def deadline_horizon(lease_seconds: float) -> float:
    """How far ahead of now a worker's deadline in the workers ZSET may lie before it counts as garbage
    (``1e300``, ``inf``: a worker that never expires would keep its entries for ever): far past any lease
    a worker writes (``now + SCHEDULER_LEASE_SECONDS``)."""
    return max(100 * lease_seconds, 86_400.0)


@dataclass
class TakeResult:
    """What one :meth:`SeedReader.take` answers."""

    #: ``ok``, ``lost`` (another worker adopted this one's seeds) or ``wrongtype``
    status: str
    #: entries taken (the seed; ``<score> <seed>`` for a ZSET)
    entries: list[bytes]
    #: workers whose lease ran out (an id that is not UTF-8 -- garbage someone wrote -- stays ``bytes``, so
    #: that :meth:`SeedReader.adopt` can still remove it)
    expired: list[str | bytes]
    #: this worker's entries given back to the seeds key (``sweep``, ``leave``)
    returned: int
    #: the seeds key's type (``none`` if it does not exist)
    key_type: str = ""
    #: the processing list and/or workers ZSET, if they held another Redis type (moved aside)
    repaired: list[str] = dataclasses.field(default_factory=list)
    #: entries of no live worker (garbage in the processing list) given back to the seeds key too
    strays: int = 0



def _worker_id(value: Any) -> str | bytes:
    """A worker id read from the workers ZSET: text, or the raw bytes of one that is not UTF-8 (anyone
    who can write the ZSET can add such a member; decoding it must not fail every take)."""
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return value
    return str(value)


class SeedReader:
    """One worker's Redis side of the seeds key: take seeds (recording them as in flight), wait for them,
    acknowledge them, adopt the seeds of vanished workers, give seeds back. One round trip per call.

    ``kind`` is the seeds key's type: ``list`` (default), ``set`` (``REDIS_START_URLS_AS_SET``) or
    ``zset`` (``REDIS_START_URLS_AS_ZSET``; the score is the priority). Keys: ``keys.start_urls``,
    ``keys.start_urls_processing``, ``keys.start_urls_workers``, ``keys.start_urls_rejected``.
    """

    def __init__(
        self,
        redis: Any,
        keys: CrawlKeys,
        worker_id: str,
        kind: str = "list",
        lease_seconds: float = 60.0,
        rejected_maxlen: int = defaults.REDIS_START_URLS_REJECTED_MAXLEN,
        held_cap: int = HELD_CAP,
    ) -> None:
        if kind not in ("list", "set", "zset"):
            raise ValueError(f"kind must be list, set or zset, not {kind!r}")
        if "\n" in worker_id:
            raise ValueError("a worker id cannot hold a newline (it prefixes processing entries)")
        self.redis = redis
        self.keys = keys
        self.worker_id = worker_id
        self.kind = kind
        self.lease_seconds = lease_seconds
        self.rejected_maxlen = rejected_maxlen
        self.held_cap = held_cap
        self._bounds = [repr(deadline_horizon(lease_seconds)), held_cap]
        self.registered = False
        self._keys = [keys.start_urls, keys.start_urls_processing, keys.start_urls_workers]
        self._take = scripts.register(redis, "seeds_take")
        self._adopt = scripts.register(redis, "seeds_adopt")

    async def take(
        self, count: int, acks: Sequence[bytes] = (), mode: str = "take", now: float | None = None
    ) -> TakeResult:
        """Acknowledge ``acks``, renew the lease, take up to ``count`` seeds: one EVALSHA of
        ``seeds_take.lua`` (which documents ``mode``: ``take``, ``sweep``, ``leave``)."""
        raw = await self._take(
            keys=self._keys,
            args=[
                "" if now is None else repr(now), self.worker_id, repr(self.lease_seconds), self.kind, count,
                mode, "1" if self.registered else "0", ADOPT_BATCH, *self._bounds, *acks,
            ],
        )
        self.registered = mode != "leave"
        return TakeResult(
            text(raw[0]), list(raw[1]), [_worker_id(w) for w in raw[2]], int(raw[3]), text(raw[4]),
            [text(k) for k in raw[5]], int(raw[6]),
        )

    async def wait(self, timeout: float = BLOCK_SECONDS) -> bool:
        """Block until the seeds key (a LIST) holds a seed or ``timeout`` passes; True if it does.

        ``BLMOVE key key RIGHT LEFT`` rotates the list onto itself, the only blocking list command that
        leaves the seed in Redis whatever happens to this worker (the last seed moves to the head); the
        next :meth:`take` pops and records it atomically. Every waiting worker wakes and tries a take.
        """
        k = self.keys.start_urls
        return await self.redis.blmove(k, k, timeout, "RIGHT", "LEFT") is not None

    async def adopt(
        self, workers: Iterable[str | bytes], now: float | None = None
    ) -> tuple[int, int, int]:
        """Give the seeds of ``workers`` (whose lease ran out) back to the seeds key, and any garbage of no
        live worker's found on the way: ``(workers adopted, their entries given back, garbage given
        back)``, one EVALSHA of ``seeds_adopt.lua`` (one pass over the processing list, whatever the
        number of workers)."""
        workers = list(workers)
        if not workers:
            return 0, 0, 0
        raw = await self._adopt(
            keys=self._keys, args=["" if now is None else repr(now), self.kind, *self._bounds, *workers]
        )
        return int(raw[0]), int(raw[1]), int(raw[2])

    async def record_rejections(self, records: Sequence[str]) -> None:
        """Append rejection records to ``<seeds key>:rejected``, keeping the newest
        ``rejected_maxlen`` (one pipelined round trip)."""
        if not records:
            return
        pipe = self.redis.pipeline(transaction=False)
        pipe.rpush(self.keys.start_urls_rejected, *records)
        if self.rejected_maxlen > 0:
            pipe.ltrim(self.keys.start_urls_rejected, -self.rejected_maxlen, -1)
        await pipe.execute()

    async def close(self) -> None:
        await self.redis.aclose()


# -- seeds pushed to a near-miss key -----------------------------------------------------------------------
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
