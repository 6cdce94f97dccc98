"""One worker's Redis side of the seeds key (``<spider>:start_urls``): :class:`SeedReader` takes seeds and
records them as in flight, waits for pushes, acknowledges, adopts the seeds of vanished workers and gives
seeds back -- one round trip per call (``lua/seeds_take.lua``, ``lua/seeds_adopt.lua``). What the seeds
become is :mod:`scrapy_dist.seeds.feed`."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scrapy_dist.redis import scripts
from scrapy_dist.redis.replies import text
from scrapy_dist.settings import defaults

if TYPE_CHECKING:
    from scrapy_dist.redis.keys import CrawlKeys

__all__ = [
    "ADOPT_BATCH", "BLOCK_SECONDS", "CONFIRM_POLL", "HELD_CAP", "POLL_SECONDS", "SeedReader", "TakeResult",
    "deadline_horizon", "held_cap", "held_most",
]

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
