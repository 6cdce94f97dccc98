"""Every scrapy-dist setting, read, typed and validated once per crawler: :class:`DistSettings`.

:data:`TABLE` is the one source of truth: each :class:`Setting` carries its default, type, range, doc
line and status relative to scrapy-redis; ``scrapy_dist.defaults`` and ``docs/settings.md`` are made
from it (``python -m scrapy_dist.settings`` rewrites the doc). :data:`STATS` lists every stat the
package writes.

Components take their values from ``DistSettings.for_crawler(crawler)`` in ``from_crawler`` and never
read ``crawler.settings`` themselves. A bad value is refused with one line,
``scrapy-dist: <SETTING>=<value>: <what is wrong>; <what is expected>`` (:class:`SettingsError`);
``for_crawler`` logs it and stops ``scrapy crawl`` with exit status 1 before anything starts (see
:func:`scrapy_dist.connection.abort_crawl`). A setting name close to one of ours gets one WARNING.

Which Redis (:meth:`ConnectionSettings.source`), the same in workers and in the ``scrapy-dist``
command: ``REDIS_URL`` (``-s`` or the project's settings; ``REDIS_SENTINELS``, ``REDIS_HOST`` /
``REDIS_PORT`` count as settings too), then the ``REDIS_URL`` environment variable, then the embedded
Redis.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from scrapy_dist.exceptions import ScrapyDistError

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

__all__ = [
    "DEFAULTS",
    "STATS",
    "TABLE",
    "ConnectionSettings",
    "DistSettings",
    "Setting",
    "SettingsError",
    "mask_url",
    "render_doc",
]

logger = logging.getLogger(__name__)

#: Status of a setting relative to scrapy-redis (the migration table's column).
OURS, HONOURED, CHANGED, IGNORED = "new", "honoured", "changed", "ignored"
_STATUS_TEXT = {
    OURS: "new in scrapy-dist",
    HONOURED: "honoured as in scrapy-redis",
    CHANGED: "scrapy-redis name, changed",
    IGNORED: "scrapy-redis name, not applied (WARNING)",
}
_ATTR = "_scrapy_dist_settings"
#: Longest value quoted in an error line.
_SHOWN = 60


class SettingsError(ScrapyDistError):
    """A setting has a value scrapy-dist refuses; ``str()`` is the one line users see."""

    def __init__(self, name: str, value: Any, problem: str, expected: str) -> None:
        self.name, self.value, self.problem, self.expected = name, value, problem, expected
        super().__init__(f"scrapy-dist: {name}={_show(name, value)}: {problem}; {expected}")


def _show(name: str, value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    if name == "REDIS_URL" and isinstance(value, str):
        text = mask_url(value)
    text = " ".join(text.split()) if text.strip() else repr(text)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN - 3]}..."


# -- the table ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    """One setting: its default, type, range and documentation.

    ``kind``: ``str``, ``int``, ``float``, ``bool``, ``dict``, ``list``, ``url``, ``auto_bool`` (True,
    False or None = detect) or ``choice``. ``optional``: None is a valid value ("no limit", "unset").
    ``status``: new / honoured / changed / ignored, relative to scrapy-redis; ``note`` says what differs.
    """

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

    @property
    def type_name(self) -> str:
        base = {"auto_bool": "bool or None", "url": "str (URL)", "choice": "str"}.get(self.kind, self.kind)
        return f"{base} or None" if self.optional and "None" not in base else base


def _s(name: str, default: Any, kind: str, doc: str, section: str, **kw: Any) -> Setting:
    return Setting(name, default, kind, doc, section, **kw)


C, S, D, SE, R, M, I_ = "connection", "scheduler", "dupefilter", "seeds", "retries", "monitoring", "items"
TABLE: tuple[Setting, ...] = (
    # -- connection
    _s("REDIS_URL", None, "url", "redis://, rediss:// or unix:// URL of the Redis to use; unset: the"
       " REDIS_URL environment variable, else the embedded Redis.", C, status=HONOURED, optional=True),
    _s("REDIS_HOST", None, "str", "Host of the Redis (when REDIS_URL is not set).", C, status=HONOURED,
       optional=True),
    _s("REDIS_PORT", None, "int", "Port of the Redis (when REDIS_URL is not set).", C, status=HONOURED,
       optional=True, low=1, high=65535),
    _s("REDIS_PARAMS", {}, "dict", "Extra keyword arguments for the redis-py client (timeouts, TLS files,"
       " ...); a dict or a JSON object.", C, status=CHANGED,
       note="redis_cls is ignored: scrapy-dist builds its clients"),
    _s("REDIS_CLUSTER", None, "auto_bool", "Force (True/False) or auto-detect (None) a Redis Cluster.", C),
    _s("REDIS_SENTINELS", [], "list", "Sentinel addresses host:port; the master's credentials and db come"
       " from REDIS_URL.", C),
    _s("REDIS_SENTINEL_MASTER", "mymaster", "str", "Name of the master the Sentinels watch.", C),
    _s("REDIS_KEY_PREFIX", "", "str", "Prepended to every key, so several projects can share one Redis.", C),
    _s("REDIS_EMBEDDED_DIR", None, "str", "Where the embedded Redis keeps its data (relative to the"
       " project's .scrapy dir).", C, optional=True),
    # -- scheduler / frontier
    _s("SCHEDULER_QUEUE_CLASS", "scrapy_dist.queue.PriorityQueue", "str", "Order of the shared queue:"
       " PriorityQueue, FifoQueue or LifoQueue (scrapy-redis paths are accepted).", S, status=HONOURED),
    _s("SCHEDULER_PERSIST", True, "bool", "Keep the frontier and the filter when the crawl ends.", S,
       status=CHANGED, note="default True (scrapy-redis: False)"),
    _s("SCHEDULER_FLUSH_ON_START", False, "bool", "Clear the crawl's frontier and filter at start.", S,
       status=HONOURED),
    _s("SCHEDULER_IDLE_BEFORE_CLOSE", 0.0, "float", "Close a worker after this many seconds with no work"
       " crawl-wide (0: never); alias MAX_IDLE_TIME_BEFORE_CLOSE.", S, status=CHANGED, low=0,
       note="seconds of crawl-wide idleness, not a blocking pop timeout"),
    _s("SCHEDULER_LEASE_SECONDS", 60.0, "float", "A leased request returns to the queue if not acknowledged"
       " within this many seconds.", S, low=0, low_open=True),
    _s("SCHEDULER_PREFETCH", 0, "int", "Requests leased ahead of demand per worker (0: 2 x"
       " CONCURRENT_REQUESTS, at least 16).", S, low=0),
    _s("SCHEDULER_FLUSH_INTERVAL", 0.05, "float", "Discovered requests are sent at the latest this many"
       " seconds after they were found ...", S, low=0, low_open=True),
    _s("SCHEDULER_FLUSH_BATCH", 500, "int", "... or as soon as this many are waiting.", S, low=1),
    _s("SCHEDULER_IDLE_POLL", 0.25, "float", "Seconds between two requests for work of an idle worker.", S,
       low=0, low_open=True),
    _s("SCHEDULER_ALLOWED_SCHEMES", ["http", "https"], "list", "URL schemes a queue entry or seed may have.",
       S),
    _s("SCHEDULER_MAX_ENTRY_BYTES", 1024 * 1024, "int", "Largest encoded request accepted from the queue"
       " (bytes).", S, low=64),
    _s("SCHEDULER_SHARDS", 1, "int", "Number of frontier shards (hash slots) a crawl is spread over.", S,
       low=1, high=1024),
    _s("SCHEDULER_POLITENESS", "process", "choice", "process: Scrapy's per-process DOWNLOAD_DELAY /"
       " CONCURRENT_REQUESTS_PER_DOMAIN; cluster: enforced crawl-wide.", S, choices=("process", "cluster")),
    _s("DOMAIN_LIMITS", {}, "dict", 'Per-domain rules {"*.example.com": {"delay": 1.0, "concurrency": 2,'
       ' "jitter": 0.5}}, most specific glob wins.', S),
    # -- dupefilter
    _s("BLOOMFILTER_CAPACITY", 100_000_000, "int", "Fingerprints the filter holds at BLOOMFILTER_ERROR_RATE.",
       D, low=1, high=2**40),
    _s("BLOOMFILTER_ERROR_RATE", 0.001, "float", "False-positive rate at capacity (between 0 and 1).", D,
       low=0, low_open=True, high=0.5),
    _s("BLOOMFILTER_BLOCK_BITS", 2**31, "int", "Bits per bitmap block (one Redis string each).", D,
       low=2**13, high=2**32),
    # -- seeds
    _s("REDIS_START_URLS_KEY", "%(name)s:start_urls", "str", "Key seeds are read from (%(name)s: the"
       " spider).", SE, status=HONOURED),
    _s("REDIS_START_URLS_AS_SET", False, "bool", "The seeds key is a SET.", SE, status=HONOURED),
    _s("REDIS_START_URLS_AS_ZSET", False, "bool", "The seeds key is a ZSET (highest score first).", SE,
       status=HONOURED),
    _s("REDIS_START_URLS_BATCH_SIZE", 0, "int", "Seeds taken per round (0: CONCURRENT_REQUESTS).", SE,
       status=HONOURED, low=0),
    _s("REDIS_START_URLS_MAX_BYTES", 64 * 1024, "int", "Largest seed accepted (bytes).", SE, low=16),
    _s("REDIS_START_URLS_REJECTED_MAXLEN", 100_000, "int", "Newest rejection records kept in"
       " <seeds key>:rejected.", SE, low=0),
    # -- retries / dead letters
    _s("RETRY_BACKOFF_BASE", 1.0, "float", "First retry delay (seconds); doubles per attempt.", R, low=0),
    _s("RETRY_BACKOFF_MAX", 300.0, "float", "Longest retry delay (seconds).", R, low=0),
    _s("DEADLETTER_IGNORED", False, "bool", "Also dead-letter requests dropped by IgnoreRequest.", R),
    _s("HTTPERROR_DEAD_LETTER", False, "bool", "Dead-letter responses HttpErrorMiddleware drops.", R),
    # -- monitoring
    _s("CLUSTERSTATS_INTERVAL", 5.0, "float", "Seconds between two flushes of a worker's stats and heartbeat"
       " (0: ClusterStats off).", M, low=0),
    _s("CLUSTERSTATS_MAX_STATS", [], "list", "Stat names (fnmatch) merged crawl-wide as the maximum.", M),
    _s("CLUSTERSTATS_MIN_STATS", [], "list", "Stat names (fnmatch) merged crawl-wide as the minimum.", M),
    _s("ERRORMONITOR_MAX_ERROR_RATE", None, "float", "Highest share of failed attempts (0..1) in the window"
       " before ERRORMONITOR_ACTION; None: no limit.", M, optional=True, low=0, high=1),
    _s("ERRORMONITOR_MAX_ERRORS", None, "int", "Most errors crawl-wide in the window before"
       " ERRORMONITOR_ACTION; None: no limit.", M, optional=True, low=1),
    _s("ERRORMONITOR_WINDOW", 60.0, "float", "Length of the sliding error window (seconds).", M, low=0,
       low_open=True),
    _s("ERRORMONITOR_ACTION", "log", "choice", "What a tripped limit does: log, pause (until scrapy-dist"
       " resume) or close.", M, choices=("log", "pause", "close")),
    _s("ERRORMONITOR_MIN_ATTEMPTS", 20, "int", "Attempts the window must hold before the rate is judged.", M,
       low=1),
    _s("ERRORMONITOR_HTTP_ERRORS", ["5xx", 429], "list", "Statuses counted as errors: numbers or 4xx/5xx.",
       M),
    # -- items / cookies
    _s("REDIS_ITEMS_KEY", "%(spider)s:items", "str", "Key items are written to.", I_, status=HONOURED),
    _s("REDIS_ITEMS_STREAM", False, "bool", "Write items to a STREAM (XADD) instead of a LIST (RPUSH).", I_),
    _s("REDIS_ITEMS_MAXLEN", None, "int", "Approximate stream length cap; None: unbounded.", I_,
       optional=True, low=1),
    _s("REDIS_ITEMS_FLUSH_INTERVAL", 1.0, "float", "A batch of items is written at the latest this many"
       " seconds after its first item ...", I_, low=0, low_open=True),
    _s("REDIS_ITEMS_BATCH_SIZE", 100, "int", "... or as soon as it holds this many.", I_, low=1),
    _s("REDIS_ITEMS_SERIALIZER", None, "str", "Import path of a function item -> str/bytes (default JSON).",
       I_, status=HONOURED, optional=True),
    _s("REDIS_COOKIES_CACHE_SECONDS", 1.0, "float", "SharedCookiesMiddleware: re-read a jar older than this"
       " (seconds).", "cookies", low=0),
    _s("REDIS_COOKIES_FLUSH_INTERVAL", 0.05, "float", "SharedCookiesMiddleware: cookie changes are written at"
       " the latest this many seconds after they happen.", "cookies", low=0, low_open=True),
)

#: scrapy-redis settings scrapy-dist does not apply: setting one logs a WARNING saying what to use instead.
SCRAPY_REDIS_IGNORED: Mapping[str, str] = MappingProxyType({
    "SCHEDULER_QUEUE_KEY": "keys are {<spider>}:* with the hash tag (REDIS_KEY_PREFIX adds a prefix)",
    "SCHEDULER_DUPEFILTER_KEY": "the filter lives in {<spider>}:bloom* (REDIS_KEY_PREFIX adds a prefix)",
    "DUPEFILTER_KEY": "the filter lives in {<spider>}:bloom* (REDIS_KEY_PREFIX adds a prefix)",
    "SCHEDULER_DUPEFILTER_CLASS": "set DUPEFILTER_CLASS",
    "SCHEDULER_SERIALIZER": "requests are encoded as msgpack, never pickle",
    "REDIS_ENCODING": "seeds and keys are UTF-8",
    "STATS_KEY": "crawl-wide stats live in {<spider>}:stats (scrapy-dist status)",
})
#: Other names for our settings (scrapy-redis spellings); the canonical name wins when both are set.
ALIASES: Mapping[str, str] = MappingProxyType({"MAX_IDLE_TIME_BEFORE_CLOSE": "SCHEDULER_IDLE_BEFORE_CLOSE"})

#: Every stat the package writes: (name, meaning). ``<x>`` stands for a variable part.
STATS: tuple[tuple[str, str], ...] = (
    ("scheduler/enqueued", "requests written to the shared frontier (also .../redis)"),
    ("scheduler/enqueued/redis", "same, Scrapy's per-backend spelling"),
    ("scheduler/dequeued", "requests handed to the engine (also .../redis)"),
    ("scheduler/dequeued/redis", "same, Scrapy's per-backend spelling"),
    ("scheduler/requeued/lease_expired", "leases of dead or slow workers returned to the queue"),
    ("scheduler/delayed/moved", "retries whose delay ran out, moved back to the queue"),
    ("scheduler/rejected", "queue entries refused as invalid"),
    ("scheduler/rejected/<reason>", "the same, per reason"),
    ("scheduler/unserializable", "requests that could not be encoded (dropped)"),
    ("scheduler/politeness/penalized/<status>", "responses that slowed a domain down (429, 503)"),
    ("dupefilter/filtered", "requests dropped as already seen"),
    ("dupefilter/<figure>", "the filter's size, fill ratio and estimated error rate"),
    ("seeds/received", "seeds read from the seeds key"),
    ("seeds/requests", "requests made from seeds"),
    ("seeds/skipped", "seeds that made no request"),
    ("seeds/rejected", "seeds refused as invalid"),
    ("seeds/rejected/<reason>", "the same, per reason"),
    ("seeds/returned", "taken seeds given back to the seeds key"),
    ("seeds/adopted", "seeds of dead workers taken over"),
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
    ("cookies/<counter>", "SharedCookiesMiddleware's jar reads, writes and errors"),
)

BY_NAME: Mapping[str, Setting] = MappingProxyType({s.name: s for s in TABLE})
#: Every setting's default (what ``scrapy_dist.defaults.NAME`` returns).
DEFAULTS: Mapping[str, Any] = MappingProxyType({s.name: s.default for s in TABLE})
#: Prefixes of our setting names: an unknown setting with one of them may be a typo of ours.
_OUR_PREFIXES = ("REDIS_", "SCHEDULER_", "BLOOMFILTER_", "DUPEFILTER_", "CLUSTERSTATS_", "ERRORMONITOR_",
                 "RETRY_", "DEADLETTER_", "HTTPERROR_", "DOMAIN_", "MAX_IDLE")


# -- masking ------------------------------------------------------------------------------------
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)
_MASKED = r"\1***"


def mask_url(url: str) -> str:
    """``url`` with its password (in the userinfo or a ``password=`` query argument) replaced by ``***``.

    A password may hold unencoded ``#``, ``/``, ``?`` or ``@``: the user info ends at the last ``@``.

    >>> mask_url("redis://user:secret@host:6379/0")
    'redis://user:***@host:6379/0'
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    userinfo, at, after = rest.rpartition("@")
    if at and ":" in userinfo and "?" not in userinfo.split(":", 1)[0]:
        user = userinfo.split(":", 1)[0]
        rest = f"{user}:***@{after}"
    return f"{scheme}://{_QUERY_PASSWORD.sub(_MASKED, rest)}"


# -- converters ---------------------------------------------------------------------------------
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _num(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


def _expected_number(spec: Setting) -> str:
    noun = "an integer" if spec.kind == "int" else "a number"
    lo, hi = spec.low, spec.high
    if lo == 0 and spec.low_open and hi is None:
        return f"expected a positive {noun[noun.index(' ') + 1:]}"
    if lo is not None and hi is not None:
        return f"expected {noun} {'above' if spec.low_open else 'from'} {_num(lo)} up to {_num(hi)}"
    if lo is not None:
        return f"expected {noun} {'above' if spec.low_open else 'of at least'} {_num(lo)}"
    return f"expected {noun}"


def _number(spec: Setting, value: Any) -> float | int:
    integer = spec.kind == "int"
    what = "an integer" if integer else "a number"
    expected = _expected_number(spec)
    if isinstance(value, bool):
        raise SettingsError(spec.name, value, "not a number", expected)
    number: float | int
    if isinstance(value, (int, float)):
        number = value
    elif isinstance(value, str):
        text = value.strip().replace("_", "")
        try:
            number = int(text) if integer else float(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                raise SettingsError(spec.name, value, f"not {what}", expected) from None
    else:
        raise SettingsError(spec.name, value, f"not {what} but a {type(value).__name__}", expected)
    if isinstance(number, float):
        if not math.isfinite(number):
            raise SettingsError(spec.name, value, "not a finite number", expected)
        if integer:
            if not number.is_integer():
                raise SettingsError(spec.name, value, "not an integer", expected)
            number = int(number)
    lo, hi = spec.low, spec.high
    too_low = lo is not None and (number <= lo if spec.low_open else number < lo)
    if too_low or (hi is not None and number > hi):
        raise SettingsError(spec.name, value, "out of range", expected)
    return int(number) if integer else float(number)


def _bool(spec: Setting, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise SettingsError(spec.name, value, "not a boolean", "expected True or False (1/0, true/false)")


def _dict(spec: Setting, value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        if not value.strip():
            return {}
        try:
            value = json.loads(value)
        except ValueError:
            raise SettingsError(spec.name, value, "not a JSON object",
                                'expected a dict, or JSON like {"socket_timeout": 30}') from None
    if isinstance(value, Mapping):
        return dict(value)
    raise SettingsError(spec.name, value, f"not a dict but a {type(value).__name__}",
                        'expected a dict, or JSON like {"socket_timeout": 30}')


def _list(spec: Setting, value: Any) -> list[Any]:
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                loaded = json.loads(text)
            except ValueError:
                raise SettingsError(spec.name, value, "not a JSON list",
                                    "expected a list, or comma-separated values") from None
            return list(loaded)
        return [part.strip() for part in text.split(",") if part.strip()]
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    raise SettingsError(spec.name, value, f"not a list but a {type(value).__name__}",
                        "expected a list, or comma-separated values")


def _check_url(value: Any) -> str:
    name, expected = "REDIS_URL", "expected redis://[[user]:password@]host[:port][/db], rediss://... or" \
                                  " unix:///path/to/socket[?db=N]"
    if not isinstance(value, str):
        raise SettingsError(name, value, f"not a string but a {type(value).__name__}", expected)
    url = value.strip()
    match = re.match(r"([A-Za-z][A-Za-z0-9+.-]*):(//)?", url)
    if match is None or not match.group(2):
        # "127.0.0.1:6380" or "localhost:6379" parse as a scheme; "redis:/host" lacks a slash
        looks_like_ours = match is not None and match.group(1).lower() in ("redis", "rediss", "unix")
        problem = "malformed: the scheme must be followed by //" if looks_like_ours else "no scheme"
        raise SettingsError(name, value, problem, expected)
    scheme = match.group(1).lower()
    if scheme not in ("redis", "rediss", "unix"):
        raise SettingsError(name, value, f"scheme {scheme}:// is not Redis", expected)
    rest = url[match.end():]
    if scheme == "unix":
        path = rest.rpartition("@")[2].split("?", 1)[0]
        if not path.startswith("/"):
            raise SettingsError(name, value, "no socket path", expected)
        return url
    hostinfo = rest.rpartition("@")[2]
    hostport, _, tail = hostinfo.partition("/")
    try:
        parts = urlsplit(f"redis://{hostport}")
        _ = parts.port
    except ValueError:
        raise SettingsError(name, value, "the port is not a number from 1 to 65535", expected) from None
    if hostport.endswith(":"):
        raise SettingsError(name, value, "empty port", expected)
    db = tail.split("?", 1)[0].split("#", 1)[0]
    if db and not db.isdigit():
        raise SettingsError(name, value, f"database {db!r} is not a number", expected)
    return url


def _convert(spec: Setting, value: Any) -> Any:
    if value is None or (spec.optional and isinstance(value, str) and value.strip().lower() in ("", "none")):
        if spec.optional or spec.default is None:
            return None
        if spec.kind in ("dict", "list"):
            return type(spec.default)()
        raise SettingsError(spec.name, value, "missing", f"expected a {spec.type_name}")
    kind = spec.kind
    if kind in ("int", "float"):
        return _number(spec, value)
    if kind == "bool":
        return _bool(spec, value)
    if kind == "auto_bool":
        if isinstance(value, str) and value.strip().lower() in ("", "auto", "none"):
            return None
        try:
            return _bool(spec, value)
        except SettingsError:
            raise SettingsError(spec.name, value, "not a boolean",
                                "expected True, False or None (auto-detect)") from None
    if kind == "dict":
        return _dict(spec, value)
    if kind == "list":
        return _list(spec, value)
    if kind == "url":
        return _check_url(value)
    if kind == "choice":
        text = str(value).strip().lower()
        if text not in spec.choices:
            raise SettingsError(spec.name, value, "unknown value",
                                f"expected one of {', '.join(spec.choices)}")
        return text
    if not isinstance(value, str):
        raise SettingsError(spec.name, value, f"not a string but a {type(value).__name__}",
                            "expected a string")
    return value


# -- the object ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConnectionSettings:
    """Where Redis is and how to talk to it (see :mod:`scrapy_dist.connection`)."""

    #: the REDIS_URL to use, from the setting or the environment; None: Sentinels, host/port or embedded
    url: str | None = None
    #: where ``url`` came from: ``REDIS_URL`` (settings) or ``REDIS_URL environment variable``
    url_source: str = ""
    host: str | None = None
    port: int | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    cluster: bool | None = None
    sentinels: tuple[tuple[str, int], ...] = ()
    sentinel_master: str = "mymaster"
    key_prefix: str = ""
    embedded_dir: str | None = None

    @property
    def source(self) -> str:
        """The setting that chose the Redis: ``REDIS_SENTINELS``, ``REDIS_URL``, ``REDIS_URL environment
        variable``, ``REDIS_HOST/REDIS_PORT`` or ``embedded``."""
        if self.sentinels:
            return "REDIS_SENTINELS"
        if self.url_source == "REDIS_URL":
            return "REDIS_URL"
        if self.host or self.port:
            return "REDIS_HOST/REDIS_PORT"
        return self.url_source or "embedded"


@dataclass(frozen=True)
class SchedulerSettings:
    """The frontier's settings, as :class:`scrapy_dist.scheduler.Scheduler` takes them."""

    queue_class: str = "scrapy_dist.queue.PriorityQueue"
    persist: bool = True
    flush_on_start: bool = False
    idle_before_close: float = 0.0  # SCHEDULER_IDLE_BEFORE_CLOSE, else MAX_IDLE_TIME_BEFORE_CLOSE
    lease_seconds: float = 60.0
    prefetch: int = 16  # derived: SCHEDULER_PREFETCH, 0 -> max(16, 2 x CONCURRENT_REQUESTS)
    flush_interval: float = 0.05
    flush_batch: int = 500
    idle_poll: float = 0.25
    allowed_schemes: tuple[str, ...] = ("http", "https")
    max_entry_bytes: int = 1024 * 1024
    shards: int = 1
    politeness: str = "process"
    domain_limits: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: Scrapy's per-domain defaults the crawl-wide politeness starts from
    download_delay: float = 0.0
    concurrent_requests_per_domain: int = 8
    download_delay_jitter: float = 0.5


@dataclass(frozen=True)
class DupefilterSettings:
    capacity: int = 100_000_000
    error_rate: float = 0.001
    block_bits: int = 2**31
    debug: bool = False  # Scrapy's DUPEFILTER_DEBUG


@dataclass(frozen=True)
class SeedSettings:
    key_template: str = "%(name)s:start_urls"
    #: derived from REDIS_START_URLS_AS_SET / _AS_ZSET: ``list``, ``set`` or ``zset``
    kind: str = "list"
    #: derived: REDIS_START_URLS_BATCH_SIZE, 0 -> CONCURRENT_REQUESTS
    batch_size: int = 16
    max_bytes: int = 64 * 1024
    rejected_maxlen: int = 100_000


@dataclass(frozen=True)
class RetrySettings:
    backoff_base: float = 1.0
    backoff_max: float = 300.0
    deadletter_ignored: bool = False
    httperror_dead_letter: bool = False


@dataclass(frozen=True)
class MonitoringSettings:
    interval: float = 5.0
    max_stats: tuple[str, ...] = ()
    min_stats: tuple[str, ...] = ()
    max_error_rate: float | None = None
    max_errors: int | None = None
    window: float = 60.0
    action: str = "log"
    min_attempts: int = 20
    http_errors: tuple[Any, ...] = ("5xx", 429)


@dataclass(frozen=True)
class ItemSettings:
    key_template: str = "%(spider)s:items"
    stream: bool = False
    maxlen: int | None = None
    flush_interval: float = 1.0
    batch_size: int = 100
    serializer: str | None = None


@dataclass(frozen=True)
class CookieSettings:
    cache_seconds: float = 1.0
    flush_interval: float = 0.05
    enabled: bool = True  # Scrapy's COOKIES_ENABLED
    debug: bool = False  # Scrapy's COOKIES_DEBUG


@dataclass(frozen=True)
class DistSettings:
    """Every scrapy-dist setting, typed and validated; build with :meth:`from_settings` or
    :meth:`for_crawler` (cached on the crawler)."""

    connection: ConnectionSettings = field(default_factory=ConnectionSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    dupefilter: DupefilterSettings = field(default_factory=DupefilterSettings)
    seeds: SeedSettings = field(default_factory=SeedSettings)
    retries: RetrySettings = field(default_factory=RetrySettings)
    monitoring: MonitoringSettings = field(default_factory=MonitoringSettings)
    items: ItemSettings = field(default_factory=ItemSettings)
    cookies: CookieSettings = field(default_factory=CookieSettings)
    #: Scrapy's CONCURRENT_REQUESTS (the prefetch and seed batch defaults derive from it)
    concurrent_requests: int = 16
    #: one line each: near-miss names, ignored scrapy-redis settings, aliases shadowed
    warnings: tuple[str, ...] = ()

    # -- building --------------------------------------------------------------------------------
    @classmethod
    def from_settings(cls, settings: Any, environ: Mapping[str, str] | None = None) -> DistSettings:
        """Read, convert and check every scrapy-dist setting of ``settings`` (a Scrapy ``Settings`` or
        a plain mapping); raise :class:`SettingsError` (one line) on the first bad value.

        ``environ`` (default ``os.environ``) supplies ``REDIS_URL`` when no Redis setting is given.
        """
        env = os.environ if environ is None else environ
        raw = _Reader(settings)
        v = raw.value
        warnings: list[str] = []
        # aliases: the canonical name wins
        for alias, canonical in ALIASES.items():
            if raw.given(alias) and raw.given(canonical):
                warnings.append(f"scrapy-dist: {alias} is ignored because {canonical} is set")
        idle = v("SCHEDULER_IDLE_BEFORE_CLOSE")
        if not raw.given("SCHEDULER_IDLE_BEFORE_CLOSE") and raw.given("MAX_IDLE_TIME_BEFORE_CLOSE"):
            alias_spec = replace(BY_NAME["SCHEDULER_IDLE_BEFORE_CLOSE"], name="MAX_IDLE_TIME_BEFORE_CLOSE")
            idle = _convert(alias_spec, raw.raw("MAX_IDLE_TIME_BEFORE_CLOSE"))
        # Redis: settings first, then the environment, then the embedded server
        url, url_source = v("REDIS_URL"), "REDIS_URL" if v("REDIS_URL") else ""
        located = url or v("REDIS_SENTINELS") or v("REDIS_HOST") or v("REDIS_PORT")
        if not located and env.get("REDIS_URL", "").strip():
            try:
                url = _check_url(env["REDIS_URL"])
            except SettingsError as exc:
                raise SettingsError("REDIS_URL", exc.value, f"{exc.problem} (environment variable)",
                                    exc.expected) from None
            url_source = "REDIS_URL environment variable"
        params = v("REDIS_PARAMS")
        params.pop("redis_cls", None)  # scrapy-redis lets it choose the client class; we build our own
        connection = ConnectionSettings(
            url=url, url_source=url_source, host=v("REDIS_HOST"), port=v("REDIS_PORT"),
            params=MappingProxyType(params), cluster=v("REDIS_CLUSTER"),
            sentinels=_sentinels(v("REDIS_SENTINELS")),
            sentinel_master=v("REDIS_SENTINEL_MASTER") or "mymaster",
            key_prefix=v("REDIS_KEY_PREFIX") or "", embedded_dir=v("REDIS_EMBEDDED_DIR"),
        )
        concurrent = raw.scrapy_int("CONCURRENT_REQUESTS", 16, low=1)
        shards, politeness = v("SCHEDULER_SHARDS"), v("SCHEDULER_POLITENESS")
        if shards > 1 and politeness == "cluster":
            # polite.lua keeps a domain's timing in one hash; with shards its requests span several slots
            raise SettingsError("SCHEDULER_SHARDS", shards, "cannot be combined with"
                                " SCHEDULER_POLITENESS='cluster' (a domain's timing state must live in one"
                                " hash slot)", "use SCHEDULER_SHARDS=1 or SCHEDULER_POLITENESS='process'")
        schemes = tuple(str(s).strip().lower() for s in v("SCHEDULER_ALLOWED_SCHEMES"))
        if not schemes or any(not re.fullmatch(r"[a-z][a-z0-9+.-]*", s) for s in schemes):
            raise SettingsError("SCHEDULER_ALLOWED_SCHEMES", v("SCHEDULER_ALLOWED_SCHEMES"),
                                "not a list of URL schemes", 'expected e.g. ["http", "https"]')
        scheduler = SchedulerSettings(
            queue_class=v("SCHEDULER_QUEUE_CLASS"), persist=v("SCHEDULER_PERSIST"),
            flush_on_start=v("SCHEDULER_FLUSH_ON_START"), idle_before_close=idle,
            lease_seconds=v("SCHEDULER_LEASE_SECONDS"),
            prefetch=v("SCHEDULER_PREFETCH") or max(16, 2 * concurrent),
            flush_interval=v("SCHEDULER_FLUSH_INTERVAL"), flush_batch=v("SCHEDULER_FLUSH_BATCH"),
            idle_poll=v("SCHEDULER_IDLE_POLL"), allowed_schemes=schemes,
            max_entry_bytes=v("SCHEDULER_MAX_ENTRY_BYTES"), shards=shards, politeness=politeness,
            domain_limits=MappingProxyType(_domain_limits(v("DOMAIN_LIMITS"))),
            download_delay=raw.scrapy_float("DOWNLOAD_DELAY", 0.0),
            concurrent_requests_per_domain=raw.scrapy_int("CONCURRENT_REQUESTS_PER_DOMAIN", 8, low=1),
            download_delay_jitter=raw.scrapy_float("DOWNLOAD_DELAY_JITTER", 0.5),
        )
        if v("REDIS_START_URLS_AS_SET") and v("REDIS_START_URLS_AS_ZSET"):
            raise SettingsError("REDIS_START_URLS_AS_SET", True, "cannot be combined with"
                                " REDIS_START_URLS_AS_ZSET=True (the seeds key has one type)",
                                "set only one of them")
        kind = "zset" if v("REDIS_START_URLS_AS_ZSET") else "set" if v("REDIS_START_URLS_AS_SET") else "list"
        seeds = SeedSettings(
            key_template=v("REDIS_START_URLS_KEY"), kind=kind,
            batch_size=v("REDIS_START_URLS_BATCH_SIZE") or concurrent,
            max_bytes=v("REDIS_START_URLS_MAX_BYTES"), rejected_maxlen=v("REDIS_START_URLS_REJECTED_MAXLEN"),
        )
        if not seeds.key_template:
            raise SettingsError("REDIS_START_URLS_KEY", "", "empty",
                                "expected a key like %(name)s:start_urls")
        if v("RETRY_BACKOFF_MAX") < v("RETRY_BACKOFF_BASE"):
            raise SettingsError("RETRY_BACKOFF_MAX", v("RETRY_BACKOFF_MAX"), "below RETRY_BACKOFF_BASE"
                                f" ({v('RETRY_BACKOFF_BASE'):g})",
                                "expected RETRY_BACKOFF_MAX >= RETRY_BACKOFF_BASE")
        http_errors = tuple(v("ERRORMONITOR_HTTP_ERRORS"))
        for code in http_errors:
            if not re.fullmatch(r"[1-5](xx|\d\d)", str(code).strip().lower()):
                raise SettingsError("ERRORMONITOR_HTTP_ERRORS", list(http_errors),
                                    f"{code!r} is not a status",
                                    'expected statuses like 503 or classes like "5xx"')
        return cls(
            connection=connection,
            scheduler=scheduler,
            dupefilter=DupefilterSettings(
                capacity=v("BLOOMFILTER_CAPACITY"), error_rate=v("BLOOMFILTER_ERROR_RATE"),
                block_bits=v("BLOOMFILTER_BLOCK_BITS"), debug=raw.scrapy_bool("DUPEFILTER_DEBUG", False),
            ),
            seeds=seeds,
            retries=RetrySettings(
                backoff_base=v("RETRY_BACKOFF_BASE"), backoff_max=v("RETRY_BACKOFF_MAX"),
                deadletter_ignored=v("DEADLETTER_IGNORED"), httperror_dead_letter=v("HTTPERROR_DEAD_LETTER"),
            ),
            monitoring=MonitoringSettings(
                interval=v("CLUSTERSTATS_INTERVAL"), max_stats=tuple(map(str, v("CLUSTERSTATS_MAX_STATS"))),
                min_stats=tuple(map(str, v("CLUSTERSTATS_MIN_STATS"))),
                max_error_rate=v("ERRORMONITOR_MAX_ERROR_RATE"), max_errors=v("ERRORMONITOR_MAX_ERRORS"),
                window=v("ERRORMONITOR_WINDOW"), action=v("ERRORMONITOR_ACTION"),
                min_attempts=v("ERRORMONITOR_MIN_ATTEMPTS"), http_errors=http_errors,
            ),
            items=ItemSettings(
                key_template=v("REDIS_ITEMS_KEY"), stream=v("REDIS_ITEMS_STREAM"),
                maxlen=v("REDIS_ITEMS_MAXLEN"),
                flush_interval=v("REDIS_ITEMS_FLUSH_INTERVAL"), batch_size=v("REDIS_ITEMS_BATCH_SIZE"),
                serializer=v("REDIS_ITEMS_SERIALIZER"),
            ),
            cookies=CookieSettings(
                cache_seconds=v("REDIS_COOKIES_CACHE_SECONDS"),
                flush_interval=v("REDIS_COOKIES_FLUSH_INTERVAL"),
                enabled=raw.scrapy_bool("COOKIES_ENABLED", True),
                debug=raw.scrapy_bool("COOKIES_DEBUG", False),
            ),
            concurrent_requests=concurrent,
            warnings=tuple(warnings + raw.unknown_names()),
        )

    @classmethod
    def coerce(cls, settings: Any) -> DistSettings:
        """``settings`` itself if it is a :class:`DistSettings`, else :meth:`from_settings` of it."""
        return settings if isinstance(settings, DistSettings) else cls.from_settings(settings)

    @classmethod
    def for_crawler(cls, crawler: Crawler) -> DistSettings:
        """The crawler's settings object, read and checked on first use and then cached on the crawler.

        A bad value is logged as one ERROR line and stops ``scrapy crawl`` with exit status 1 (a
        ``SystemExit``, see :func:`scrapy_dist.connection.abort_crawl`); the warnings are logged once.
        Before the crawler's settings are frozen (a spider's ``from_crawler``) nothing is cached,
        since add-ons may still change them.
        """
        cached = getattr(crawler, _ATTR, None)
        if cached is not None:
            return cached  # type: ignore[no-any-return]
        try:
            built = cls.from_settings(crawler.settings)
        except SettingsError as exc:
            from scrapy_dist.connection import abort_crawl

            abort_crawl(exc)
        if getattr(crawler.settings, "frozen", True):
            setattr(crawler, _ATTR, built)
            for line in built.warnings:
                logger.warning("%s", line)
        return built


class _Reader:
    """Raw values of a Scrapy ``Settings`` or a plain mapping, converted per :data:`TABLE`."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings if settings is not None else {}
        self._cache: dict[str, Any] = {}

    def raw(self, name: str) -> Any:
        return self.settings.get(name)

    def given(self, name: str) -> bool:
        return self.raw(name) is not None

    def value(self, name: str) -> Any:
        if name not in self._cache:
            spec = BY_NAME[name]
            raw = self.raw(name)
            value = spec.default if raw is None else raw
            if isinstance(value, (dict, list)):
                value = type(value)(value)  # a private copy: the table's defaults stay untouched
            self._cache[name] = _convert(spec, value)
        return self._cache[name]

    def _scrapy(self, name: str, default: Any, kind: str, low: float | None = None) -> Any:
        raw = self.raw(name)
        spec = Setting(name, default, kind, "", "scrapy", low=low)
        return default if raw is None else _convert(spec, raw)

    def scrapy_int(self, name: str, default: int, low: float | None = None) -> int:
        return int(self._scrapy(name, default, "int", low))

    def scrapy_float(self, name: str, default: float) -> float:
        return float(self._scrapy(name, default, "float", 0))

    def scrapy_bool(self, name: str, default: bool) -> bool:
        return bool(self._scrapy(name, default, "bool"))

    def unknown_names(self) -> list[str]:
        """One warning per setting name that looks like one of ours but is not, and per ignored
        scrapy-redis setting that is set."""
        try:
            names = [str(n) for n in self.settings]
        except TypeError:
            return []
        known = set(BY_NAME) | set(ALIASES)
        out = []
        for name in sorted(names):
            if name in SCRAPY_REDIS_IGNORED:
                if self.given(name):
                    out.append(f"scrapy-dist: {name} is a scrapy-redis setting scrapy-dist does not apply:"
                               f" {SCRAPY_REDIS_IGNORED[name]}")
                continue
            if name in known or not name.startswith(_OUR_PREFIXES) or name in _SCRAPY_OWN:
                continue
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.85)
            if close:
                out.append(f"scrapy-dist: unknown setting {name}; did you mean {close[0]}?")
        return out


# Scrapy's own settings with our prefixes (never "did you mean" them).
_SCRAPY_OWN = frozenset({
    "RETRY_ENABLED", "RETRY_TIMES", "RETRY_HTTP_CODES", "RETRY_PRIORITY_ADJUST", "RETRY_EXCEPTIONS",
    "SCHEDULER_DEBUG", "SCHEDULER_DISK_QUEUE", "SCHEDULER_MEMORY_QUEUE", "SCHEDULER_PRIORITY_QUEUE",
    "SCHEDULER_START_DISK_QUEUE", "SCHEDULER_START_MEMORY_QUEUE", "DUPEFILTER_CLASS", "DUPEFILTER_DEBUG",
    "REDIRECT_ENABLED", "REDIRECT_MAX_TIMES", "REDIRECT_PRIORITY_ADJUST", "HTTPERROR_ALLOWED_CODES",
    "HTTPERROR_ALLOW_ALL", "REFERER_ENABLED", "REFERRER_POLICY",
})


def _sentinels(entries: list[Any]) -> tuple[tuple[str, int], ...]:
    out = []
    for entry in entries:
        try:
            if isinstance(entry, (tuple, list)):
                out.append((str(entry[0]), int(entry[1])))
                continue
            text = str(entry).strip()
            parts = urlsplit(text if "://" in text else f"redis://{text}")
            out.append((parts.hostname or "localhost", parts.port or 26379))
        except (ValueError, IndexError, TypeError):
            raise SettingsError("REDIS_SENTINELS", entries, f"{entry!r} is not an address",
                                'expected ["host:port", ...]') from None
    return tuple(out)


def _domain_limits(rules: dict[str, Any]) -> dict[str, dict[str, Any]]:
    expected = 'expected {"*.example.com": {"delay": 1.0, "concurrency": 2, "jitter": 0.5}}'
    out = {}
    for pattern, rule in rules.items():
        if not isinstance(rule, Mapping) or set(rule) - {"delay", "concurrency", "jitter"}:
            raise SettingsError("DOMAIN_LIMITS", rules, f"rule {pattern!r} is not a dict of delay,"
                                " concurrency, jitter", expected)
        for key, value in rule.items():
            kind = "int" if key == "concurrency" else "float"
            _convert(Setting(f"DOMAIN_LIMITS[{pattern!r}][{key!r}]", None, kind, "", S, low=1 if
                             kind == "int" else 0), value)
        out[str(pattern)] = dict(rule)
    return out


# -- docs ---------------------------------------------------------------------------------------
DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "settings.md"


def _default_text(spec: Setting) -> str:
    if spec.name == "BLOOMFILTER_BLOCK_BITS":
        return "`2**31`"
    if isinstance(spec.default, int) and not isinstance(spec.default, bool) and spec.default >= 10_000:
        return f"`{spec.default:_}`"
    return f"`{spec.default!r}`"


def render_doc() -> str:
    """``docs/settings.md``: every setting and every stat, from :data:`TABLE` and :data:`STATS`."""
    lines = [
        "# Settings and stats",
        "",
        "<!-- Generated by `python -m scrapy_dist.settings` from scrapy_dist/settings.py; do not edit. -->",
        "",
        "Every value is checked once when a worker starts (and by the `scrapy-dist` command); a bad one",
        "stops it with one line: `scrapy-dist: <SETTING>=<value>: <what is wrong>; <what is expected>`.",
        "A setting name close to one of these gets a WARNING with the suggestion.",
        "",
        "Which Redis: `REDIS_URL` (or `REDIS_SENTINELS`, `REDIS_HOST`/`REDIS_PORT`) from `-s` or the",
        "project's settings, then the `REDIS_URL` environment variable, then the embedded Redis. Every",
        "worker logs the one it uses at INFO, password masked.",
        "",
        "Status: relative to scrapy-redis (new, honoured, changed, ignored).",
    ]
    section = ""
    for spec in TABLE:
        if spec.section != section:
            section = spec.section
            lines += ["", f"## {section.capitalize()}", "", "| Setting | Type | Default | Meaning | Status |",
                      "|---|---|---|---|---|"]
        status = _STATUS_TEXT[spec.status] + (f": {spec.note}" if spec.note else "")
        lines.append(f"| `{spec.name}` | {spec.type_name} | {_default_text(spec)} | {spec.doc} | {status} |")
    lines += ["", "## Aliases", ""]
    lines += [f"- `{alias}`: scrapy-redis name of `{name}` (which wins when both are set)"
              for alias, name in ALIASES.items()]
    lines += ["", "## scrapy-redis settings not applied", "", "Each logs a WARNING when set.", ""]
    lines += [f"- `{name}`: {why}" for name, why in SCRAPY_REDIS_IGNORED.items()]
    lines += ["", "## Stats", "", "| Stat | Meaning |", "|---|---|"]
    lines += [f"| `{name}` | {meaning} |" for name, meaning in STATS]
    return "\n".join(lines) + "\n"


def write_doc(path: Path = DOC_PATH) -> Path:
    """Write :func:`render_doc` to ``path`` (``docs/settings.md``)."""
    path.write_text(render_doc(), encoding="utf-8")
    return path


def _field_names() -> list[str]:  # for the report and tests: every attribute path of DistSettings
    out = []
    for group in fields(DistSettings):
        sub = group.default_factory() if callable(group.default_factory) else None  # type: ignore[misc]
        if sub is None:
            out.append(group.name)
        else:
            out += [f"{group.name}.{f.name}" for f in fields(sub)]
    return out


if __name__ == "__main__":  # pragma: no cover
    print(write_doc(Path(sys.argv[1]) if len(sys.argv) > 1 else DOC_PATH))
