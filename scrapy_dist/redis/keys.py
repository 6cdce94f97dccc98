"""The one place that makes Redis key names (the list: docs/frontier.md, "Keys"). Every per-crawl key starts
with the hash tag ``<prefix>{<spider>}:`` (``{<spider>#<i>...}`` for shard ``i >= 1``), so a Lua script may
touch several keys of a crawl on Redis Cluster; seeds keep the plain ``<prefix><spider>:start_urls``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache
from typing import Any

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from scrapy_dist.settings import DistSettings

GARBAGE = ":garbage"  #: suffix of a key moved aside for holding another type (lua/foreign.lua)

#: Names of the keys each shard of a sharded frontier has (the rest are crawl-wide, on shard 0).
SHARD_KEY_NAMES = ("queue", "queue_tails", "queue_rejected", "leases", "lease_meta", "seq", "delayed",
                   "delayed_meta", "bloom", "fingerprints", "fingerprints_ttl", "forgotten", "domains",
                   "domain_info", "spent")


@cache
def shard_suffix(spider: str, index: int, shards: int) -> str:
    """What follows the spider name in the hash tag of shard ``index`` (``""`` for 0): ``#<index>``, or
    ``#<index>.<k>`` for the smallest ``k`` whose slot falls in this shard's share of the 16384 slots (shard
    0 has the share ``{<spider>}`` falls in, shards 1.. the others in ascending order)."""
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


#: The keys the frontier owns (deleted by SCHEDULER_FLUSH_ON_START and when a non-persistent crawl ends).
FRONTIER_KEY_NAMES = (*(name for name in SHARD_KEY_NAMES if name != "queue_rejected"), "workers", "stats",
                      "control", "errors", "error_examples", "history")


CRAWL_KEY_NAMES = {  #: fixed-name per-crawl keys: CrawlKeys attribute -> name after the tag (type, content)
    "queue": "queue",  # ZSET of queued requests (6-byte sequence + encoded request), score -priority
    "queue_tails": "queue:tails",  # HASH score -> the queue chunk of that score still open for appends
    "queue_rejected": "queue:rejected",  # LIST of JSON records of queue entries that failed to decode
    "leases": "leases",  # ZSET of lease keys (member + tag of queue score and holder) by deadline
    "lease_meta": "leases:meta",  # HASH member -> "<queue score> <worker id>" of a lease without a tag
    "seq": "seq",  # STRING counter: the FIFO sequence number of every enqueued entry
    "delayed": "delayed",  # ZSET of delayed (retry) members by not-before time
    "delayed_meta": "delayed:meta",  # HASH member -> queue score of a delayed member
    "spent": "spent",  # ZSET nonce of a signed entry handed out -> when (a copy put back is replayed)
    "domains": "domains",  # ZSET domain -> when it may next be leased from (crawl-wide politeness)
    "domain_info": "domains:info",  # HASH s:<domain> -> "backlog slots next limits" (lua/polite.lua)
    "deadletter": "deadletter",  # LIST of JSON dead-letter records
    "bloom": "bloom",  # HASH of the bloom filter's parameters and insert count
    "fingerprints": "fingerprints",  # SET of raw 20-byte request fingerprints (SetDupeFilter)
    "fingerprints_ttl": "fingerprints:ttl",  # ZSET raw fingerprint -> expiry (DUPEFILTER_TTL)
    "forgotten": "forgotten",  # SET of "<h1>:<h2>" bloom hashes made new again, each admitted once
    "workers": "workers",  # ZSET worker id -> last heartbeat (unix seconds)
    "stats": "stats",  # HASH of crawl-wide merged Scrapy stats
    "control": "control",  # HASH of control flags (paused, ...), the crawl's layout and forget token
    "errors": "errors",  # HASH of error counters per time bucket (the error monitor's window)
    "error_examples": "errors:examples",  # LIST of recent JSON error records quoted by alerts
    "cookies": "cookies",  # HASH cookiejar name -> last write: the index of the shared cookie jars
    "history": "history"}  # STREAM of the workers' periodic samples over the last hour (dashboard)


@dataclass(frozen=True)
class CrawlKeys:
    """Key names of one crawl (one spider name) under an optional key prefix."""

    spider: str
    prefix: str = ""
    start_urls_template: str = "%(name)s:start_urls"  #: ``%(name)s`` / ``%(spider)s``: the spider name
    items_template: str = "%(spider)s:items"  #: ``REDIS_ITEMS_KEY``, scrapy-redis compatible
    shard_suffix: str = ""  #: ``""`` for the crawl (= shard 0); ``#<i>...`` for shard i of a sharded frontier

    @property
    def tag(self) -> str:
        """The ``<prefix>{<spider>}`` stem every per-crawl key starts with (``{<spider>#<i>}``: shard i)."""
        return f"{self.prefix}{{{self.spider}{self.shard_suffix}}}"

    def shard(self, index: int, shards: int) -> CrawlKeys:
        """The keys of shard ``index`` of ``shards`` (shard 0 is the crawl itself)."""
        suffix = shard_suffix(self.spider, index, shards)
        return self if suffix == self.shard_suffix else dataclasses.replace(self, shard_suffix=suffix)

    def shards(self, shards: int) -> list[CrawlKeys]:
        """The keys of every shard, shard 0 (the crawl's own keys) first."""
        return [self.shard(i, shards) for i in range(shards)]

    def __getattr__(self, attribute: str) -> str:
        """The fixed-name keys of :data:`CRAWL_KEY_NAMES` (``keys.queue`` is ``<tag>:queue``)."""
        try:
            return f"{self.tag}:{CRAWL_KEY_NAMES[attribute]}"
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no key {attribute!r}") from None

    def bloom_block(self, filter_index: int, block_index: int) -> str:
        """STRING bitmap: block ``block_index`` of filter ``filter_index`` of the scalable bloom chain."""
        return f"{self.tag}:bloom:{filter_index}:{block_index}"

    def bloom_generation(self, generation: int, *filter_and_block: int) -> str:
        """HASH with the item count of bloom generation ``generation`` (``DUPEFILTER_TTL``); with
        ``filter_index, block_index``: that STRING bitmap block of the generation."""
        return ":".join([f"{self.tag}:bloom:g{generation}", *map(str, filter_and_block)])

    def worker(self, worker_id: str) -> str:
        """HASH with one worker's heartbeat details."""
        return f"{self.tag}:worker:{worker_id}"

    def cookie_jar(self, name: str) -> str:
        """HASH of one shared cookie jar: JSON ``[domain, path, name]`` -> JSON cookie record."""
        return f"{self.tag}:cookies:{name}"

    def cookie_changes(self, name: str) -> str:
        """ZSET of one shared cookie jar's changes: HASH field -> version of its last change."""
        return f"{self.tag}:cookie_changes:{name}"

    @property
    def start_urls(self) -> str:
        """The seeds key (LIST by default; SET or ZSET if configured)."""
        return self.prefix + self.start_urls_template % {"name": self.spider, "spider": self.spider}

    @property
    def start_urls_rejected(self) -> str:
        """LIST of JSON records for rejected seeds."""
        return f"{self.start_urls}:rejected"

    @property
    def _start_urls_stem(self) -> str:
        """Stem of keys in the seeds key's hash slot: the seeds key if it holds a hash tag, else it as one."""
        s = self.start_urls
        return s if (open_at := s.find("{")) >= 0 and s.find("}", open_at + 2) > 0 else f"{{{s}}}"

    @property
    def start_urls_processing(self) -> str:
        """LIST of seeds popped but not yet turned into frontier entries, each ``<worker id>\\n<seed>``."""
        return f"{self._start_urls_stem}:processing"

    @property
    def start_urls_workers(self) -> str:
        """ZSET worker id -> lease deadline (unix seconds) of the workers reading seeds."""
        return f"{self._start_urls_stem}:workers"

    @property
    def items(self) -> str:
        """The items LIST or STREAM (``REDIS_ITEMS_KEY``)."""
        return self.prefix + self.items_template % {"spider": self.spider, "name": self.spider}

    def frontier_keys(self) -> list[str]:
        """Every fixed-name key the frontier owns (not bloom blocks); on a shard > 0, the per-shard ones."""
        names = [n for n in FRONTIER_KEY_NAMES if not self.shard_suffix or n in SHARD_KEY_NAMES]
        return [getattr(self, name) for name in names if name != "bloom"] + [self.bloom]


def crawl_keys(ds: DistSettings, spider_name: str) -> CrawlKeys:
    """:class:`CrawlKeys` of the typed settings (prefix, seeds and items key templates)."""
    return CrawlKeys(spider=spider_name, prefix=ds.connection.key_prefix,
                     start_urls_template=ds.seeds.key_template, items_template=ds.items.key_template)


def spider_name(crawler: Any) -> str:
    """The name every key of a crawl is built from: the running spider's ``name`` (also one set in
    ``__init__``), else its class's; one function, so no two components split a crawl over two key sets."""
    name = getattr(getattr(crawler, "spider", None), "name", None) or getattr(crawler.spidercls, "name", None)
    if not name or not isinstance(name, str):
        raise ValueError(f"{crawler.spidercls.__name__} has no name: scrapy-dist builds its keys from it")
    return name


def crawler_keys(crawler: Any) -> CrawlKeys:
    """:class:`CrawlKeys` of ``crawler``'s crawl (its settings and :func:`spider_name`)."""
    return crawl_keys(DistSettings.for_crawler(crawler), spider_name(crawler))
