"""Every scrapy-dist setting's default, in one place.

Components read ``settings.get(NAME, defaults.NAME)``; the README's settings table lists the same names.
scrapy-redis names are honoured where the meaning is the same (``REDIS_URL``, ``REDIS_HOST``,
``REDIS_PORT``, ``REDIS_PARAMS``, ``SCHEDULER_PERSIST``, ``SCHEDULER_FLUSH_ON_START``,
``SCHEDULER_QUEUE_CLASS``, ``SCHEDULER_IDLE_BEFORE_CLOSE``, ``REDIS_START_URLS_KEY``,
``REDIS_START_URLS_AS_SET``, ``REDIS_START_URLS_AS_ZSET``, ``REDIS_ITEMS_KEY``).
"""

from __future__ import annotations

# -- connection --------------------------------------------------------------------------------
#: ``redis://``, ``rediss://`` or ``unix://`` URL. ``None`` (and no REDIS_HOST/PORT) = embedded Redis.
REDIS_URL: str | None = None
REDIS_HOST: str | None = None
REDIS_PORT: int | None = None
#: Extra keyword arguments for the redis-py client (timeouts, TLS files, ...).
REDIS_PARAMS: dict = {}
#: Force (True/False) or auto-detect (None) a Redis Cluster behind REDIS_URL.
REDIS_CLUSTER: bool | None = None
REDIS_SENTINELS: list[str] = []
REDIS_SENTINEL_MASTER: str = "mymaster"
#: Prepended to every key, so several projects can share one Redis.
REDIS_KEY_PREFIX: str = ""
#: Where the embedded Redis keeps its data (relative to the project's ``.scrapy`` dir).
REDIS_EMBEDDED_DIR: str | None = None

# -- scheduler / frontier ----------------------------------------------------------------------
SCHEDULER_QUEUE_CLASS: str = "scrapy_dist.queue.PriorityQueue"
SCHEDULER_PERSIST: bool = True
SCHEDULER_FLUSH_ON_START: bool = False
SCHEDULER_IDLE_BEFORE_CLOSE: float = 0.0
SCHEDULER_LEASE_SECONDS: float = 60.0
#: Requests leased ahead of demand per worker (0 = 2 x CONCURRENT_REQUESTS, at least 16).
SCHEDULER_PREFETCH: int = 0
#: Discovered requests are sent at the latest this long after they were found (seconds) ...
SCHEDULER_FLUSH_INTERVAL: float = 0.05
#: ... or as soon as this many are waiting.
SCHEDULER_FLUSH_BATCH: int = 500
#: How often a worker with nothing to do asks the frontier for work (seconds).
SCHEDULER_IDLE_POLL: float = 0.25
#: URL schemes a queue entry may have; anything else written to the queue is rejected.
SCHEDULER_ALLOWED_SCHEMES: list[str] = ["http", "https"]
#: Largest encoded request accepted from the queue (bytes).
SCHEDULER_MAX_ENTRY_BYTES: int = 1024 * 1024
#: Newest rejection records kept in ``{spider}:queue:rejected`` (LTRIM by the sync script; 0 = no cap).
SCHEDULER_REJECTED_MAXLEN: int = 100_000
#: Newest dead letters kept in ``{spider}:deadletter`` (LTRIM by the sync script; 0 = no cap).
DEADLETTER_MAXLEN: int = 1_000_000
SCHEDULER_SHARDS: int = 1
#: Secret keying the tag of the queue entries workers write (or env SCRAPY_DIST_SECRET); None = every queue
#: entry counts as the crawl's own (see docs/security.md). Never stored in Redis.
SCHEDULER_ENTRY_SECRET: str | None = None
#: Networks (CIDR) no request may reach (checked on the resolved address): loopback, private, link-local
#: (cloud metadata), CGNAT, unspecified, multicast; [] to crawl local sites.
SCHEDULER_DENY_NETWORKS: list[str] = [
    "127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16", "100.64.0.0/10",
    "0.0.0.0/8", "224.0.0.0/4", "240.0.0.0/4", "::1/128", "::/128", "fc00::/7", "fe80::/10", "ff00::/8",
]
#: "process": Scrapy's per-process DOWNLOAD_DELAY / CONCURRENT_REQUESTS_PER_DOMAIN; "cluster": crawl-wide
SCHEDULER_POLITENESS: str = "process"
#: {"*.example.com": {"delay": 1.0, "concurrency": 2, "jitter": 0.5}} -- glob rules, most specific wins
DOMAIN_LIMITS: dict = {}


# -- dupefilter --------------------------------------------------------------------------------
BLOOMFILTER_CAPACITY: int = 100_000_000
BLOOMFILTER_ERROR_RATE: float = 0.001
#: Bits per bitmap block (each block is one Redis string, well below the 512 MB limit).
BLOOMFILTER_BLOCK_BITS: int = 2**31

# -- seeds -------------------------------------------------------------------------------------
REDIS_START_URLS_KEY: str = "%(name)s:start_urls"
REDIS_START_URLS_AS_SET: bool = False
REDIS_START_URLS_AS_ZSET: bool = False
REDIS_START_URLS_BATCH_SIZE: int = 0  # 0 = CONCURRENT_REQUESTS
REDIS_START_URLS_MAX_BYTES: int = 64 * 1024
#: Newest rejection records kept in ``<seeds key>:rejected`` (hostile input cannot fill Redis).
REDIS_START_URLS_REJECTED_MAXLEN: int = 100_000
#: Meta keys (fnmatch patterns) a seed or an unauthenticated queue entry may set; the routing/credential/
#: safety keys of codec.DANGEROUS_META (proxy, cookiejar, dont_*, _*, ...) only if named exactly.
SEEDS_META_ALLOWED: list[str] = ["*"]
#: Credential headers (Authorization, Cookie) a seed or an unauthenticated queue entry may set.
SEEDS_HEADERS_ALLOWED: list[str] = []

# -- retries / dead letters --------------------------------------------------------------------
RETRY_BACKOFF_BASE: float = 1.0
RETRY_BACKOFF_MAX: float = 300.0
DEADLETTER_IGNORED: bool = False
HTTPERROR_DEAD_LETTER: bool = False

# -- monitoring --------------------------------------------------------------------------------
#: Seconds between two flushes of a worker's stats, heartbeat and error counts (a worker silent for 3
#: intervals is shown as lost).
CLUSTERSTATS_INTERVAL: float = 5.0
#: Extra stat names (fnmatch patterns) merged crawl-wide as the maximum / minimum instead of the sum.
CLUSTERSTATS_MAX_STATS: list[str] = []
CLUSTERSTATS_MIN_STATS: list[str] = []
#: Highest share of failed attempts (0..1) in the window before ERRORMONITOR_ACTION; None = no limit.
ERRORMONITOR_MAX_ERROR_RATE: float | None = None
#: Most errors crawl-wide in the window before ERRORMONITOR_ACTION; None = no limit.
ERRORMONITOR_MAX_ERRORS: int | None = None
#: Length of the sliding window (seconds).
ERRORMONITOR_WINDOW: float = 60.0
#: "log" (an alert), "pause" (every worker stops taking requests until `scrapy-dist resume`) or "close".
ERRORMONITOR_ACTION: str = "log"
#: The error rate is judged only once the window holds this many attempts (a first failure is not 100%).
ERRORMONITOR_MIN_ATTEMPTS: int = 20
#: Response statuses counted as HTTP errors: numbers, or "4xx"/"5xx" for a whole class.
ERRORMONITOR_HTTP_ERRORS: list = ["5xx", 429]

# -- items / cookies ---------------------------------------------------------------------------
REDIS_ITEMS_KEY: str = "%(spider)s:items"
#: Write items to a Redis STREAM (XADD, consumer groups) instead of a LIST (RPUSH, scrapy-redis compatible).
REDIS_ITEMS_STREAM: bool = False
#: Approximate stream length cap (XADD MAXLEN ~); None = unbounded.
REDIS_ITEMS_MAXLEN: int | None = None
#: A batch is written at the latest this long after its first item (seconds) ...
REDIS_ITEMS_FLUSH_INTERVAL: float = 1.0
#: ... or as soon as it holds this many items.
REDIS_ITEMS_BATCH_SIZE: int = 100
#: Import path of a function item -> str/bytes replacing the JSON encoder (scrapy-redis setting).
REDIS_ITEMS_SERIALIZER: str | None = None
#: SharedCookiesMiddleware: a worker re-reads a jar from Redis when its copy is older than this (seconds).
REDIS_COOKIES_CACHE_SECONDS: float = 1.0
#: SharedCookiesMiddleware: cookie changes are written at the latest this long after they happen (seconds).
REDIS_COOKIES_FLUSH_INTERVAL: float = 0.05
