"""The table of every scrapy-dist setting (:data:`TABLE`) and every stat (:data:`STATS`): the one place a
setting is declared (default, type, range, doc line, status relative to scrapy-redis). ``defaults`` and
``docs/settings.md`` are made from it; a new setting is one line here plus its field in ``DistSettings``."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any

MAX_CAPACITY = 10**12  # BLOOMFILTER_CAPACITY: more is a typo
MIN_ERROR_RATE = 1e-12  # BLOOMFILTER_ERROR_RATE: tighter rates need more hashes than a window holds
MAX_TTL = 100 * 365 * 86400  # DUPEFILTER_TTL: 100 years
MIN_GENERATIONS, MAX_GENERATIONS = 2, 64  # BLOOMFILTER_GENERATIONS

OURS, HONOURED, CHANGED, IGNORED = "new", "honoured", "changed", "ignored"  #: relative to scrapy-redis
STATUS_TEXT = {OURS: "new in scrapy-dist", HONOURED: "honoured as in scrapy-redis",
               CHANGED: "scrapy-redis name, changed", IGNORED: "scrapy-redis name, not applied (WARNING)"}


@dataclass(frozen=True)
class Setting:
    """One setting. ``kind``: ``str``, ``int``, ``float``, ``bool``, ``dict``, ``list``, ``url``, ``size``,
    ``secret``, ``auto_bool`` (None = detect) or ``choice``; ``optional``: None is a valid value."""

    name: str
    default: Any
    kind: str
    doc: str
    section: str
    status: str = OURS
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # the range excludes ``low``
    choices: tuple[str, ...] = ()
    optional: bool = False
    note: str = ""
    multiple_of: int | None = None  # an int setting must be a multiple of this

    @property
    def range_words(self) -> str:
        """The accepted range in words (``from 1 up to 65,535``, ``above 0``), or ""."""
        lo, hi = self.low, self.high
        if lo is None:
            return f"up to {_num(hi)}" if hi is not None else ""
        start = f"{'above' if self.low_open else 'from' if hi is not None else 'of at least'} {_num(lo)}"
        words = f"{start} up to {_num(hi)}" if hi is not None else start
        return f"{words}, a multiple of {_num(self.multiple_of)}" if self.multiple_of else words

    @property
    def type_name(self) -> str:
        base = {"auto_bool": "bool or None", "url": "str (URL)", "choice": "str", "size": "int or str (size)",
                "secret": "str"}.get(self.kind, self.kind)
        return f"{base} or None" if self.optional and "None" not in base else base


def _num(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


_s = Setting  # a row of TABLE
C, S, D, SE, R, M, I_ = "connection", "scheduler", "dupefilter", "seeds", "retries", "monitoring", "items"
TABLE: tuple[Setting, ...] = (
    _s("REDIS_URL", None, "url", "redis://, rediss:// or unix:// URL of the Redis to use; unset: the"
       " REDIS_URL environment variable, else the embedded Redis.", C, status=HONOURED, optional=True),
    _s("REDIS_HOST", None, "str", "Redis host (if REDIS_URL is not set).", C, status=HONOURED, optional=True),
    _s("REDIS_PORT", None, "int", "Redis port (if REDIS_URL is not set).", C, status=HONOURED,
       optional=True, low=1, high=65535),
    _s("REDIS_DB", None, "int", "Database number (when REDIS_URL names none); wins over REDIS_PARAMS['db'].",
       C, status=HONOURED, optional=True, low=0),
    _s("REDIS_PARAMS", {}, "dict", "Extra keyword arguments for the redis-py client (timeouts, TLS files,"
       " ...); a dict or a JSON object. Its host, port and db apply as in scrapy-redis (REDIS_HOST,"
       " REDIS_PORT, REDIS_DB and a REDIS_URL win). A keyword no redis-py client takes, or a timeout that"
       " is not a number, is refused at start (so are such options in a REDIS_URL's query).", C,
       status=CHANGED, note="redis_cls is ignored: scrapy-dist builds its clients"),
    _s("REDIS_CLUSTER", None, "auto_bool", "Force (True/False) or auto-detect (None) a Redis Cluster.", C),
    _s("REDIS_SENTINELS", [], "list", "Sentinel addresses host:port; the master's credentials and db come"
       " from REDIS_URL.", C),
    _s("REDIS_SENTINEL_MASTER", "mymaster", "str", "Name of the master the Sentinels watch.", C),
    _s("REDIS_KEY_PREFIX", "", "str", "Prepended to every key, so several projects can share one Redis.", C),
    _s("REDIS_EMBEDDED_DIR", None, "str", "Where the embedded Redis keeps its data (relative to the"
       " project's .scrapy dir).", C, optional=True),
    _s("REDIS_EMBEDDED_MAXMEMORY", None, "size", "maxmemory of the embedded Redis: bytes or a size like"
       ' "2gb" (0: no limit); None: a quarter of the RAM, at most 2 GB.', C, optional=True),
    _s("SCHEDULER_QUEUE_CLASS", "scrapy_dist.queue.PriorityQueue", "str", "Order of the shared queue:"
       " PriorityQueue, FifoQueue or LifoQueue (scrapy-redis paths are accepted).", S, status=HONOURED),
    _s("SCHEDULER_PERSIST", True, "bool", "Keep the frontier and the filter when the crawl ends.", S,
       status=CHANGED, note="default True (scrapy-redis: False)"),
    _s("SCHEDULER_FLUSH_ON_START", False, "bool", "Clear frontier and filter at start.", S, status=HONOURED),
    _s("SCHEDULER_IDLE_BEFORE_CLOSE", 0.0, "float", "Close a worker after this many seconds with no work"
       " crawl-wide (0: a crawl waiting for seeds never closes, other spiders close once the frontier is"
       " empty; None: never close, a long-running crawl); alias MAX_IDLE_TIME_BEFORE_CLOSE.", S,
       status=CHANGED, low=0, optional=True, note="seconds of crawl-wide idleness, not a blocking pop"
       " timeout; a RedisSpider project switched with the two settings (no add-on) that sets it > 0 gets"
       " one WARNING (MAX_IDLE_TIME_BEFORE_CLOSE: none)"),
    _s("SCHEDULER_LEASE_SECONDS", 60.0, "float", "A leased request returns to the queue if not acknowledged"
       " within this many seconds.", S, low=0, low_open=True),
    _s("SCHEDULER_PREFETCH", 0, "int", "Requests leased ahead of demand per worker (0: 2 x"
       " CONCURRENT_REQUESTS, at least 16).", S, low=0),
    _s("SCHEDULER_FLUSH_INTERVAL", 0.05, "float", "Discovered requests are sent at the latest this many"
       " seconds after they were found ...", S, low=0, low_open=True),
    _s("SCHEDULER_FLUSH_BATCH", 500, "int", "... or as soon as this many are waiting.", S, low=1),
    _s("SCHEDULER_IDLE_POLL", 0.25, "float", "Seconds between idle workers' polls.", S, low=0, low_open=True),
    _s("SCHEDULER_SHUTDOWN_GRACE", 30.0, "float", "Seconds a closing worker (SIGTERM, the crawl's end)"
       " keeps trying to give back its leases and send what it owes (items too) while Redis is away, at"
       " most SCHEDULER_LEASE_SECONDS; then it stops (one ERROR line), and what is left comes back when its"
       " leases expire.", S, low=0),
    _s("SCHEDULER_ALLOWED_SCHEMES", ["http", "https"], "list", "URL schemes an entry or a seed may have.", S),
    _s("SCHEDULER_MAX_ENTRY_BYTES", 1024 * 1024, "int", "Largest queue entry accepted (bytes).", S, low=64),
    _s("SCHEDULER_REJECTED_MAXLEN", 100_000, "int", "Newest records kept in {spider}:queue:rejected (0: no"
       " cap).", S, low=0),
    _s("SCHEDULER_REPLAY_MEMORY", 250_000, "int", "Signed queue entries each shard remembers having handed"
       " out (about 104 bytes each in Redis), so that a copy put back is not fetched again; a copy older"
       " than that many leases is fetched once more (0: off).", S, low=0),
    _s("DEADLETTER_MAXLEN", 1_000_000, "int", "Cap of {spider}:deadletter, newest kept (0: none).", S, low=0),
    _s("SCHEDULER_ENTRY_SECRET", None, "secret", "Key of the tag workers put on the queue entries they"
       " write (else env SCRAPY_DIST_SECRET); with it, untagged entries obey the seed rules. Never stored"
       " in Redis.", S, optional=True),
    _s("SCHEDULER_DENY_NETWORKS", [
        "127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16", "100.64.0.0/10",
        "0.0.0.0/8", "224.0.0.0/4", "240.0.0.0/4", "::1/128", "::/128", "fc00::/7", "fe80::/10", "ff00::/8",
    ], "list", "Networks (CIDR) no request may resolve into: loopback, private, link-local (cloud metadata),"
       " CGNAT, multicast...; [] to crawl local sites.", S),
    _s("SCHEDULER_SHARDS", 1, "int", "Shards (hash slots) the frontier is spread over.", S, low=1, high=1024),
    _s("SCHEDULER_POLITENESS", "process", "choice", "process: Scrapy's per-process DOWNLOAD_DELAY /"
       " CONCURRENT_REQUESTS_PER_DOMAIN; cluster: enforced crawl-wide.", S, choices=("process", "cluster")),
    _s("DOMAIN_LIMITS", {}, "dict", 'Per-domain rules {"*.example.com": {"delay": 1.0, "concurrency": 2,'
       ' "jitter": 0.5}}, most specific glob wins.', S),
    _s("REVISIT_AFTER", {}, "dict", 'Revisit rules {"*.example.com": 3600, "https://example.com/item/*":'
       ' 2592000, "*/login*": None}: fetch again this many seconds after a successful fetch (a glob with a'
       " / matches the URL, else the host; URL rules first, then the most specific; meta['revisit_after']"
       " wins).", S),
    _s("REVISIT_CONDITIONAL", False, "bool", "Revisits send If-None-Match / If-Modified-Since from the last"
       " ETag / Last-Modified; a 304 does not call the callback (see docs/continuous.md).", S),
    _s("REVISIT_MIN_INTERVAL", 300.0, "float", "No revisit is due sooner than this many seconds after its"
       " fetch: a smaller meta['revisit_after'] is raised to it, a smaller REVISIT_AFTER rule is refused.", S,
       low=0),
    _s("SCHEDULER_IDLE_POLL_MAX", 5.0, "float", "With SCHEDULER_IDLE_BEFORE_CLOSE = None (never close): an"
       " idle worker's polls slow down to one per this many seconds (seeds it reads are sent at once).", S,
       low=0, low_open=True),
    _s("BLOOMFILTER_CAPACITY", 100_000_000, "int", "Fingerprints the filter holds at"
       " BLOOMFILTER_ERROR_RATE.", D, low=1, high=MAX_CAPACITY),
    _s("BLOOMFILTER_ERROR_RATE", 0.001, "float", "False-positive rate at capacity.", D, low=MIN_ERROR_RATE,
       high=0.5),
    _s("BLOOMFILTER_BLOCK_BITS", 2**31, "int", "Bits per bitmap block (one Redis string each), a multiple"
       " of 4096.", D, low=2**13, high=2**32, multiple_of=4096),
    _s("DUPEFILTER_TTL", None, "float", "Seconds a fingerprint is remembered: a URL seen longer ago is new"
       " again (None: forever). Bloom filter: forgotten between TTL and TTL*G/(G-1) after it was seen (G ="
       " BLOOMFILTER_GENERATIONS, and TTL/(G-1) at least 0.25 s); SetDupeFilter: exactly TTL.", D,
       optional=True, low=0, low_open=True, high=MAX_TTL),
    _s("BLOOMFILTER_GENERATIONS", 4, "int", "With DUPEFILTER_TTL: the bloom filter is this many"
       " generations, each covering TTL/(G-1) seconds; the oldest expires whole.", D, low=MIN_GENERATIONS,
       high=MAX_GENERATIONS),
    _s("DEADLETTER_FORGET", False, "bool", "A request that ends as a dead letter is forgotten by the"
       " dupefilter (in the same call), so the next run or a seed pushed again fetches it.", D),
    _s("REDIS_START_URLS_KEY", "%(name)s:start_urls", "str", "Key seeds are read from (%(name)s: the"
       " spider).", SE, status=HONOURED),
    _s("REDIS_START_URLS_AS_SET", False, "bool", "The seeds key is a SET.", SE, status=HONOURED),
    _s("REDIS_START_URLS_AS_ZSET", False, "bool", "The seeds key is a ZSET (highest score first).", SE,
       status=HONOURED),
    _s("REDIS_START_URLS_BATCH_SIZE", 0, "int", "Seeds taken per round (0: CONCURRENT_REQUESTS).", SE,
       status=HONOURED, low=0),
    _s("REDIS_START_URLS_DEDUPE", False, "bool", "Seeds go through the dupefilter (a URL pushed again is"
       " skipped). Off: every push is fetched, as in scrapy-redis; a seed's own dont_filter wins.", SE),
    _s("SEEDS_RECORD_FINGERPRINT", False, "bool", "A start request or seed that skips the dupefilter"
       " (dont_filter) still records its fingerprint, so a page linking to it is not fetched again. Off: as"
       " in Scrapy and scrapy-redis, a dont_filter request neither consults nor records the filter.", SE),
    _s("REDIS_START_URLS_MAX_BYTES", 64 * 1024, "int", "Largest seed accepted (bytes).", SE, low=16),
    _s("REDIS_START_URLS_REJECTED_MAXLEN", 100_000, "int", "Newest rejection records kept in <seeds"
       " key>:rejected.", SE, low=0),
    _s("SEEDS_META_ALLOWED", ["*"], "list", "Meta keys (fnmatch) a seed or an untagged queue entry may set;"
       " proxy, cookiejar, dont_*, _* and the other routing keys only if named exactly.", SE),
    _s("SEEDS_HEADERS_ALLOWED", [], "list", "Credential headers (Authorization, Cookie) a seed or an"
       " untagged queue entry may set (Cookie also allows its cookies field).", SE),
    _s("RETRY_BACKOFF_BASE", 1.0, "float", "First retry delay (seconds); doubles per attempt.", R, low=0),
    _s("RETRY_BACKOFF_MAX", 300.0, "float", "Longest retry delay (seconds).", R, low=0),
    _s("DEADLETTER_IGNORED", False, "bool", "Also dead-letter requests dropped by IgnoreRequest.", R),
    _s("HTTPERROR_DEAD_LETTER", False, "bool", "Dead-letter responses HttpErrorMiddleware drops.", R),
    _s("CLUSTERSTATS_INTERVAL", 5.0, "float", "Seconds between two flushes of a worker's stats and"
       " heartbeat (0: ClusterStats off).", M, low=0),
    _s("CLUSTERSTATS_MAX_STATS", [], "list", "Stat names (fnmatch) merged crawl-wide as the maximum.", M),
    _s("CLUSTERSTATS_MIN_STATS", [], "list", "Stat names (fnmatch) merged crawl-wide as the minimum.", M),
    _s("ERRORMONITOR_MAX_ERROR_RATE", None, "float", "Highest share of failed attempts (0..1) in the window"
       " before ERRORMONITOR_ACTION; None: no limit.", M, optional=True, low=0, high=1),
    _s("ERRORMONITOR_MAX_ERRORS", None, "int", "Most errors crawl-wide in the window before"
       " ERRORMONITOR_ACTION; None: no limit.", M, optional=True, low=1),
    _s("ERRORMONITOR_WINDOW", 60.0, "float", "Seconds of the sliding error window.", M, low=0, low_open=True),
    _s("ERRORMONITOR_ACTION", "log", "choice", "What a tripped limit does: log, pause (until scrapy-dist"
       " resume) or close.", M, choices=("log", "pause", "close")),
    _s("ERRORMONITOR_MIN_ATTEMPTS", 20, "int", "Attempts in the window before the rate is judged.", M, low=1),
    _s("ERRORMONITOR_HTTP_ERRORS", ["5xx", 429], "list", "Statuses counted as errors: codes or 4xx/5xx.", M),
    _s("REDIS_ITEMS_KEY", "%(spider)s:items", "str", "Key items are written to.", I_, status=HONOURED),
    _s("REDIS_ITEMS_STREAM", False, "bool", "Write items to a STREAM (XADD) instead of a LIST (RPUSH).", I_),
    _s("REDIS_ITEMS_MAXLEN", None, "int", "Approximate stream cap (None: no cap).", I_, optional=True, low=1),
    _s("REDIS_ITEMS_FLUSH_INTERVAL", 1.0, "float", "A batch of items is written at the latest this many"
       " seconds after its first item ...", I_, low=0, low_open=True),
    _s("REDIS_ITEMS_BATCH_SIZE", 100, "int", "... or as soon as it holds this many.", I_, low=1),
    _s("REDIS_ITEMS_SERIALIZER", None, "str", "Import path of a function item -> str/bytes (default JSON).",
       I_, status=HONOURED, optional=True),
    _s("REDIS_ITEMS_EXACTLY_ONCE", True, "bool", "RedisPipeline: a page's items are appended in the sync"
       " call that acknowledges the page, only if that ack is accepted (exactly once per acknowledged"
       " fetch; docs/items.md). False: written in batches of their own, at least once.", I_),
    _s("REDIS_ITEMS_MAX_BYTES", 8 * 1024 * 1024, "int", "RedisPipeline: an item whose encoding is larger is"
       " dropped (ERROR, stat redis_items/too_large) instead of being written.", I_, low=1),
    _s("REDIS_COOKIES_CACHE_SECONDS", 1.0, "float", "SharedCookiesMiddleware: re-read a jar older than this"
       " (seconds).", "cookies", low=0),
    _s("REDIS_COOKIES_FLUSH_INTERVAL", 0.05, "float", "SharedCookiesMiddleware: cookie changes are written"
       " at the latest this many seconds after they happen.", "cookies", low=0, low_open=True))

#: scrapy-redis settings scrapy-dist does not apply: setting one logs a WARNING saying what to use instead.
SCRAPY_REDIS_IGNORED: Mapping[str, str] = MappingProxyType({
    "SCHEDULER_QUEUE_KEY": "keys are {<spider>}:* with the hash tag (REDIS_KEY_PREFIX adds a prefix)",
    "SCHEDULER_DUPEFILTER_KEY": "the filter lives in {<spider>}:bloom* (REDIS_KEY_PREFIX adds a prefix)",
    "DUPEFILTER_KEY": "the filter lives in {<spider>}:bloom* (REDIS_KEY_PREFIX adds a prefix)",
    "SCHEDULER_DUPEFILTER_CLASS": "set DUPEFILTER_CLASS",
    "SCHEDULER_SERIALIZER": "requests are encoded as msgpack, never pickle",
    "REDIS_ENCODING": "seeds and keys are UTF-8",
    "STATS_KEY": "crawl-wide stats live in {<spider>}:stats (scrapy-dist status)",
    "REDIS_DECODE_RESPONSES": "scrapy-dist builds its own clients, which need bytes; decode in your own code",
})
_IN_URL = ("scrapy-dist (like scrapy-redis) reads no such setting: give it in REDIS_URL"
           " (redis://user:password@host:port/db, rediss:// for TLS) or in REDIS_PARAMS")
#: Connection setting names people guess, read by neither scrapy-redis nor scrapy-dist: where the value goes
CONNECTION_GUESSES: Mapping[str, str] = MappingProxyType({
    "REDIS_PASSWORD": f"{_IN_URL} ({{'password': ...}})", "REDIS_PASS": f"{_IN_URL} ({{'password': ...}})",
    "REDIS_USER": f"{_IN_URL} ({{'username': ...}})", "REDIS_USERNAME": f"{_IN_URL} ({{'username': ...}})",
    "REDIS_SSL": f"{_IN_URL} ({{'ssl_ca_certs': ...}}): TLS is a rediss:// URL",
    "REDIS_TLS": f"{_IN_URL} ({{'ssl_ca_certs': ...}}): TLS is a rediss:// URL",
    "REDIS_DATABASE": f"{_IN_URL} ({{'db': ...}}), or REDIS_DB",
    "REDIS_SOCKET_TIMEOUT": f"{_IN_URL} ({{'socket_timeout': ...}})"})
#: Other names for our settings (scrapy-redis spellings); the canonical name wins when both are set.
ALIASES: Mapping[str, str] = MappingProxyType({"MAX_IDLE_TIME_BEFORE_CLOSE": "SCHEDULER_IDLE_BEFORE_CLOSE"})

STATS: tuple[tuple[str, str], ...] = (  #: every stat written: (name, meaning); ``<x>``: a variable part
    ("scheduler/enqueued", "requests written to the shared frontier (also .../redis)"),
    ("scheduler/enqueued/redis", "same, Scrapy's per-backend spelling"),
    ("scheduler/dequeued", "requests handed to the engine (also .../redis)"),
    ("scheduler/dequeued/redis", "same, Scrapy's per-backend spelling"),
    ("scheduler/requeued/lease_expired", "leases of dead or slow workers returned to the queue"),
    ("scheduler/released_at_close", "leased requests this worker gave back to the queue when it closed"),
    ("scheduler/delayed/moved", "retries whose delay ran out, moved back to the queue"),
    ("scheduler/rejected", "queue entries refused as invalid"),
    ("scheduler/rejected/<reason>", "the same, per reason"),
    ("scheduler/rejected/replayed", "copies of a signed entry already handed out, removed when leased"),
    ("scheduler/unserializable", "requests that could not be encoded (dropped)"),
    ("scheduler/politeness/penalized/<status>", "responses that slowed a domain down (429, 503)"),
    ("dupefilter/filtered", "requests dropped as already seen"),
    ("dupefilter/bloom/items", "fingerprints in the crawl-wide bloom filter"),
    ("dupefilter/bloom/fill_ratio", "items / BLOOMFILTER_CAPACITY"),
    ("dupefilter/bloom/fpr_estimate", "estimated false-positive rate at the current fill"),
    ("seeds/received", "seeds read from the seeds key"),
    ("seeds/requests", "requests made from seeds"),
    ("seeds/skipped", "seeds that made no request"),
    ("seeds/rejected", "seeds refused as invalid"),
    ("seeds/rejected/<reason>", "the same, per reason"),
    ("seeds/returned", "taken seeds given back to the seeds key"),
    ("seeds/adopted", "seeds of dead workers taken over"),
    ("seeds/strays", "garbage processing entries (of no live worker) given back to the seeds key"),
    ("deny_networks/refused", "connections refused because the host or proxy is (or resolves to) an"
     " address in SCHEDULER_DENY_NETWORKS"),
    ("seeds/lease_lost", "seed leases that ran out before they were confirmed"),
    ("seeds/errors", "failed seed exchanges with Redis"),
    ("retry/delayed", "retries parked in the delayed set until their backoff runs out"),
    ("deadletter/count", "requests written to the dead-letter list"),
    ("deadletter/reason_count/<reason>", "the same, per reason"),
    ("errormonitor/tripped", "times an ERRORMONITOR_* limit was reached"),
    ("redis_items/written", "items written to Redis"),
    ("redis_items/batches", "item batches written"),
    ("redis_items/unserializable", "items the serializer could not encode (dropped)"),
    ("redis_items/redis_errors", "failed item batch writes (retried)"),
    ("redis_items/too_large", "items larger than REDIS_ITEMS_MAX_BYTES (dropped)"),
    ("redis_items/refused", "items refused with their page's ack (the lease was another worker's by then)"),
    ("redis_items/unbound", "items of no leased request (start(), local requests): written at least once"),
    ("scheduler/acks_refused", "acks the frontier refused: the lease had run out and was another worker's"),
    ("feeds/fsyncs", "feed files flushed and fsynced before an acknowledging round"),
    ("feeds/duplicate_pages", "pages exported here whose ack was refused: another fetch exports them again"),
    ("cookies/shared/loads", "shared cookie jars read from Redis"),
    ("cookies/shared/written", "cookie changes written to Redis"),
    ("cookies/shared/rejected", "invalid cookie records read from Redis (skipped)"),
    ("cookies/shared/redis_errors", "failed cookie reads or writes (retried)"),
    ("revisit/scheduled", "requests filed again in the delayed set by their ack (REVISIT_AFTER, meta)"),
    ("revisit/stopped", "revisit chains ended by the callback (revisit_after = None, or an exception)"),
    ("revisit/invalid", "meta['revisit_after'] values that are not a number of seconds (not revisited)"),
    ("revisit/raised", "meta['revisit_after'] values below REVISIT_MIN_INTERVAL (revisited after it)"),
    ("revisit/not_modified", "conditional revisits answered 304 Not Modified (callback not called)"),
    ("revisit/conditional", "revisits sent with If-None-Match / If-Modified-Since"))

BY_NAME: Mapping[str, Setting] = MappingProxyType({s.name: s for s in TABLE})
DEFAULTS: Mapping[str, Any] = MappingProxyType({s.name: s.default for s in TABLE})


def default_value(name: str) -> Any:
    """The default of setting ``name`` (a copy of a mutable one, so a caller cannot change the table)."""
    try:
        value = DEFAULTS[name]
    except KeyError:
        raise AttributeError(f"module 'scrapy_dist.settings.defaults' has no attribute {name!r}") from None
    return type(value)(value) if isinstance(value, (dict, list)) else value


#: ``scrapy_dist.settings.defaults.NAME``: every setting's default by name, as scrapy-redis's ``defaults``.
defaults = ModuleType("scrapy_dist.settings.defaults", "Every scrapy-dist setting's default, by name.")
defaults.__dict__.update(__getattr__=default_value, __dir__=lambda: sorted(DEFAULTS))
sys.modules.setdefault(defaults.__name__, defaults)

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def _default_text(spec: Setting) -> str:
    if spec.name == "BLOOMFILTER_BLOCK_BITS":
        return "`2**31`"
    large = isinstance(spec.default, int) and not isinstance(spec.default, bool) and spec.default >= 10_000
    return f"`{spec.default:_}`" if large else f"`{spec.default!r}`"


def render_doc() -> str:
    """``docs/settings.md``: every setting and every stat, from :data:`TABLE` and :data:`STATS`."""
    lines = ["""# Settings and stats

<!-- Generated from scrapy_dist/settings/table.py by `python -m scrapy_dist.settings.table`. -->

Every value is checked once when a worker starts (and by the `scrapy-dist` command); a bad one stops it with
one line: `scrapy-dist: <SETTING>=<value>: <what is wrong>; <what is expected>`. A setting name close to one
of these gets a WARNING with the suggestion. A scrapy-dist class path in `SCHEDULER`, `DUPEFILTER_CLASS` or
`STATS_CLASS` that does not import is refused the same way, with the closest name
(`did you mean scrapy_dist.scheduler.Scheduler?`); so is any `DUPEFILTER_CLASS` that does not import when
`SCHEDULER` is scrapy-dist's. (`SCHEDULER` and `STATS_CLASS` need the add-on or a `RedisSpider`: without
them nothing of scrapy-dist runs before Scrapy loads these two.)

Which Redis: `REDIS_URL` (or `REDIS_SENTINELS`, `REDIS_HOST`/`REDIS_PORT`) from `-s` or the project's
settings, then the `REDIS_URL` environment variable, then the embedded Redis. Every worker logs the one it
uses at INFO, password masked.

Status: relative to scrapy-redis (new, honoured, changed, ignored)."""]
    section = ""
    for spec in TABLE:
        if spec.section != section:
            section = spec.section
            lines += ["", f"## {section.capitalize()}", "", "| Setting | Type | Default | Meaning | Status |",
                      "|---|---|---|---|---|"]
        status = STATUS_TEXT[spec.status] + (f": {spec.note}" if spec.note else "")
        kind = spec.type_name + (f", {spec.range_words.removeprefix('of ')}" if spec.range_words else "")
        lines.append(f"| `{spec.name}` | {kind} | {_default_text(spec)} | {spec.doc} | {status} |")
    lines += ["", "## Aliases", ""]
    lines += [f"- `{alias}`: scrapy-redis name of `{name}` (which wins when both are set)"
              for alias, name in ALIASES.items()]
    lines += ["", "## scrapy-redis settings not applied", "", "Each logs a WARNING when set.", ""]
    lines += [f"- `{name}`: {why}" for name, why in SCRAPY_REDIS_IGNORED.items()]
    lines += ["", "## Connection settings that do not exist", "",
              "Each logs a WARNING saying where the value goes (its value is not logged).", ""]
    lines += [f"- `{name}`: {why}" for name, why in CONNECTION_GUESSES.items()]
    lines += ["", "## Stats", "", "| Stat | Meaning |", "|---|---|"]
    lines += [f"| `{name}` | {meaning} |" for name, meaning in STATS]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover
    target = Path(sys.argv[1]) if sys.argv[1:] else DOC_PATH
    target.write_text(render_doc(), encoding="utf-8")
    print(target)
