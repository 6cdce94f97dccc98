"""The single place where scrapy-dist makes Redis key names.

Every per-crawl key starts with ``<prefix>{<spider>}:`` -- the braces are a Redis Cluster *hash tag*, so
all keys of one crawl live in one hash slot and a Lua script may touch several of them. Seeds are the
exception: they keep the plain ``<prefix><spider>:start_urls`` name (configurable with
``REDIS_START_URLS_KEY``) that users type into ``redis-cli``; keys derived from a seeds key use the seeds
key itself as hash tag (``{<seeds key>}:...``) so they share its slot.

Nothing else in the package (and nothing inside Lua) builds a key name.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def tag(self) -> str:
        """The ``<prefix>{<spider>}`` stem every per-crawl key starts with."""
        return f"{self.prefix}{{{self.spider}}}"

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
    def sweep_lock(self) -> str:
        """STRING lock (SET NX PX) held by the one process moving due work."""
        return self._k("lock:sweep")

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
        """Every fixed-name key the frontier owns (bloom blocks are listed by the dupefilter)."""
        out = [getattr(self, name) for name in FRONTIER_KEY_NAMES if name != "bloom"]
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
