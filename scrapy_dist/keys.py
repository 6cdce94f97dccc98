"""The single place where scrapy-dist makes Redis key names.

Every per-crawl key starts with ``<prefix>{<spider>}:`` -- the braces are a Redis Cluster *hash tag*, so
all keys of one crawl live in one hash slot and a Lua script may touch several of them. Seeds are the
exception: they keep the plain ``<prefix><spider>:start_urls`` name (configurable with
``REDIS_START_URLS_KEY``) that users type into ``redis-cli``; keys derived from a seeds key use the seeds
key itself as hash tag (``{<seeds key>}:...``) so they share its slot.

Sharded frontier (``SCHEDULER_SHARDS = N``): shard 0 is the crawl itself and keeps every name above.
Shard ``i`` (1 <= i < N) has its own hash tag ``<prefix>{<spider>#<i>}`` -- or ``{<spider>#<i>.<k>}``
with the smallest ``k >= 1`` that moves it to the right part of the slot space (see :func:`shard_suffix`):
the 16384 slots are cut into N equal ranges, shard 0 sits wherever ``{<spider>}`` hashes, and the
other shards take the remaining ranges in order. On a cluster whose slots are split evenly over N
masters (what ``redis-cli --cluster create`` does) the N shards of any spider name therefore land on N
different masters; with another split they land on different slots, usually on different masters. The
suffix depends on N, so tools read the crawl's N (``{<spider>}:control`` field ``shards``) before
naming shard keys. A spider name containing ``#`` could in theory collide with another spider's shard;
do not name two spiders ``books`` and ``books#1``.

Nothing else in the package (and nothing inside Lua) builds a key name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

#: Names of the per-shard keys: each shard of a sharded frontier has its own (the rest is crawl-wide and
#: lives with shard 0 only).
SHARD_KEY_NAMES = (
    "queue", "queue_tails", "queue_rejected", "leases", "lease_meta", "seq", "delayed", "delayed_meta",
    "bloom", "fingerprints",
)


@cache
def shard_suffix(spider: str, index: int, shards: int) -> str:
    """What follows the spider name inside the hash tag of shard ``index`` of ``shards`` (``""`` for 0).

    ``#<index>``, or ``#<index>.<k>`` for the smallest ``k`` whose slot falls in the slot range this
    shard is given: range ``r`` is ``[r * 16384 / shards, (r + 1) * 16384 / shards)``; shard 0 has the
    range ``{<spider>}`` falls in, shards 1.. take the other ranges in ascending order. Stable: the same
    in every process (CRC16, no randomness).
    """
    if index == 0:
        return ""
    home = key_slot(spider.encode()) * shards // REDIS_CLUSTER_HASH_SLOTS
    ranges = [r for r in range(shards) if r != home]
    target = ranges[(index - 1) % len(ranges)]
    for k in range(100_000):
        suffix = f"#{index}" if k == 0 else f"#{index}.{k}"
        if key_slot(f"{spider}{suffix}".encode()) * shards // REDIS_CLUSTER_HASH_SLOTS == target:
            return suffix
    return f"#{index}"  # pragma: no cover -- CRC16 reaches every range long before

#: Names of the per-crawl keys that the frontier owns (deleted by SCHEDULER_FLUSH_ON_START and by a
#: non-persistent crawl once it has finished).
FRONTIER_KEY_NAMES = (
    "queue",
    "queue_tails",
    "leases",
    "lease_meta",
    "seq",
    "delayed",
    "delayed_meta",
    "bloom",
    "fingerprints",
    "workers",
    "stats",
    "control",
    "errors",
    "error_examples",
)


@dataclass(frozen=True)
class CrawlKeys:
    """Key names of one crawl (one spider name) under an optional key prefix.

    >>> k = CrawlKeys("books")
    >>> k.queue
    '{books}:queue'
    >>> CrawlKeys("books", prefix="shop:").start_urls
    'shop:books:start_urls'
    """

    spider: str
    prefix: str = ""
    #: Seeds key template; ``%(name)s`` / ``%(spider)s`` are replaced by the spider name.
    start_urls_template: str = "%(name)s:start_urls"
    #: Items key template (``REDIS_ITEMS_KEY``), scrapy-redis compatible.
    items_template: str = "%(spider)s:items"
    #: ``""`` for the crawl (= shard 0); ``#<i>...`` for shard i of a sharded frontier (see :meth:`shard`)
    shard_suffix: str = ""

    @property
    def tag(self) -> str:
        """The ``<prefix>{<spider>}`` stem every per-crawl key starts with (``{<spider>#<i>}``: shard i)."""
        return f"{self.prefix}{{{self.spider}{self.shard_suffix}}}"

    def shard(self, index: int, shards: int) -> CrawlKeys:
        """The keys of shard ``index`` of a frontier of ``shards`` shards; shard 0 is the crawl itself.

        >>> CrawlKeys("books").shard(0, 3).queue
        '{books}:queue'
        >>> CrawlKeys("books").shard(1, 3).queue
        '{books#1}:queue'

        Only the names in :data:`SHARD_KEY_NAMES` are meaningful on a shard > 0; crawl-wide keys (control,
        dead letters, workers, stats, ...) are read and written through shard 0's keys.
        """
        if not 0 <= index < shards:
            raise ValueError(f"shard {index} of {shards}")
        base = self if not self.shard_suffix else dataclasses.replace(self, shard_suffix="")
        if index == 0:
            return base
        return dataclasses.replace(base, shard_suffix=shard_suffix(self.spider, index, shards))

    def shards(self, shards: int) -> list[CrawlKeys]:
        """The keys of every shard, shard 0 (the crawl's own keys) first."""
        return [self.shard(i, shards) for i in range(shards)]

    def _k(self, name: str) -> str:
        return f"{self.tag}:{name}"

    # -- frontier -------------------------------------------------------------------------------
    @property
    def queue(self) -> str:
        """ZSET of queued requests: member = 6-byte sequence + encoded request, score = -priority."""
        return self._k("queue")

    @property
    def queue_tails(self) -> str:
        """HASH score -> the queue chunk of that score still open for appends."""
        return self._k("queue:tails")

    @property
    def queue_rejected(self) -> str:
        """LIST of JSON records for queue entries that failed to decode."""
        return self._k("queue:rejected")

    @property
    def leases(self) -> str:
        """ZSET of leased (in-flight) members scored by lease deadline (unix seconds)."""
        return self._k("leases")

    @property
    def lease_meta(self) -> str:
        """HASH member -> ``"<queue score> <worker id>"`` for leased members (requeue with priority)."""
        return self._k("leases:meta")

    @property
    def seq(self) -> str:
        """STRING counter giving every enqueued entry its FIFO sequence number."""
        return self._k("seq")

    @property
    def delayed(self) -> str:
        """ZSET of delayed (retry) members scored by their not-before time."""
        return self._k("delayed")

    @property
    def delayed_meta(self) -> str:
        """HASH member -> queue score for delayed members."""
        return self._k("delayed:meta")

    @property
    def domains(self) -> str:
        """ZSET domain -> when it may next be leased from (crawl-wide politeness)."""
        return self._k("domains")

    @property
    def domain_info(self) -> str:
        """HASH ``b:/i:/n:/l:<domain>`` -> backlog, slots in use, next allowed time, limits."""
        return self._k("domains:info")

    @property
    def deadletter(self) -> str:
        """LIST of JSON dead-letter records."""
        return self._k("deadletter")

    # -- dupefilter -----------------------------------------------------------------------------
    @property
    def bloom(self) -> str:
        """HASH with the bloom filter's parameters and insert count."""
        return self._k("bloom")

    def bloom_block(self, filter_index: int, block_index: int) -> str:
        """STRING bitmap: block ``block_index`` of filter ``filter_index`` of the scalable bloom chain."""
        return self._k(f"bloom:{filter_index}:{block_index}")

    @property
    def fingerprints(self) -> str:
        """SET of raw 20-byte request fingerprints (exact ``SetDupeFilter``)."""
        return self._k("fingerprints")

    # -- monitoring / control -------------------------------------------------------------------
    @property
    def workers(self) -> str:
        """ZSET worker id -> last heartbeat (unix seconds)."""
        return self._k("workers")

    def worker(self, worker_id: str) -> str:
        """HASH with one worker's heartbeat details."""
        return self._k(f"worker:{worker_id}")

    @property
    def stats(self) -> str:
        """HASH of crawl-wide merged Scrapy stats."""
        return self._k("stats")

    @property
    def control(self) -> str:
        """HASH of crawl-wide control flags (``paused``, ...)."""
        return self._k("control")

    @property
    def errors(self) -> str:
        """HASH of error counters per time bucket: the error monitor's crawl-wide sliding window."""
        return self._k("errors")

    @property
    def error_examples(self) -> str:
        """LIST of recent JSON error records (kind, reason, url) quoted by the error monitor's alerts."""
        return self._k("errors:examples")

    @property
    def cookies(self) -> str:
        """HASH cookiejar name -> last write (unix seconds): the index of the shared cookie jars."""
        return self._k("cookies")

    def cookie_jar(self, name: str) -> str:
        """HASH of one shared cookie jar: JSON ``[domain, path, name]`` -> JSON cookie record."""
        return self._k(f"cookies:{name}")

    # -- seeds and items (plain names users type) -----------------------------------------------
    @property
    def start_urls(self) -> str:
        """The seeds key (LIST by default; SET or ZSET if configured)."""
        name = self.start_urls_template % {"name": self.spider, "spider": self.spider}
        return f"{self.prefix}{name}"

    @property
    def start_urls_rejected(self) -> str:
        """LIST of JSON records for rejected seeds."""
        return f"{self.start_urls}:rejected"

    @property
    def _start_urls_stem(self) -> str:
        """Stem of keys that must share the seeds key's hash slot: the seeds key itself when it already
        holds a hash tag (``{books}:start_urls``), else the seeds key as the tag."""
        s = self.start_urls
        open_at = s.find("{")
        if open_at >= 0 and s.find("}", open_at + 2) > 0:
            return s
        return f"{{{s}}}"

    @property
    def start_urls_processing(self) -> str:
        """LIST of seeds popped but not yet turned into frontier entries, each as ``<worker id>\\n<seed>``
        (same slot as the seeds key; ``LLEN`` = seeds in flight crawl-wide)."""
        return f"{self._start_urls_stem}:processing"

    @property
    def start_urls_workers(self) -> str:
        """ZSET worker id -> lease deadline (unix seconds) of the workers reading seeds: a worker whose
        lease ran out has its processing entries given back to the seeds key (same slot as the seeds key)."""
        return f"{self._start_urls_stem}:workers"

    @property
    def items(self) -> str:
        """The items LIST or STREAM (``REDIS_ITEMS_KEY``)."""
        name = self.items_template % {"spider": self.spider, "name": self.spider}
        return f"{self.prefix}{name}"

    def frontier_keys(self) -> list[str]:
        """Every fixed-name key the frontier owns (bloom blocks are listed by the dupefilter); on a shard
        > 0, only the per-shard ones (:data:`SHARD_KEY_NAMES`; rejected entries are kept, as on shard 0)."""
        names = [n for n in FRONTIER_KEY_NAMES if not self.shard_suffix or n in SHARD_KEY_NAMES]
        out = [getattr(self, name) for name in names if name != "bloom"]
        out.append(self.bloom)
        return out


def crawl_keys(settings: object, spider_name: str) -> CrawlKeys:
    """Build :class:`CrawlKeys` from Scrapy settings (``REDIS_KEY_PREFIX``, ``REDIS_START_URLS_KEY``,
    ``REDIS_ITEMS_KEY``); ``settings`` is anything with ``.get`` (a Scrapy ``Settings`` or a dict)."""
    from scrapy_dist import defaults

    get = settings.get  # type: ignore[attr-defined]
    return CrawlKeys(
        spider=spider_name,
        prefix=get("REDIS_KEY_PREFIX", defaults.REDIS_KEY_PREFIX) or "",
        start_urls_template=get("REDIS_START_URLS_KEY", defaults.REDIS_START_URLS_KEY),
        items_template=get("REDIS_ITEMS_KEY", defaults.REDIS_ITEMS_KEY),
    )
