"""Every scrapy-dist setting, read, typed and validated once per crawler (:meth:`DistSettings.for_crawler`)
from :data:`~.table.TABLE`; each field names its setting; a bad value refuses the start in one line."""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

from scrapy_dist.settings import reader, values
from scrapy_dist.settings.reader import SettingsReader, refuse_start, start_error  # noqa: F401 - re-exported
from scrapy_dist.settings.table import ALIASES, BY_NAME, DEFAULTS, defaults  # noqa: F401 - re-exported
from scrapy_dist.settings.values import SettingsError, mask_url  # noqa: F401 - re-exported

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

logger = logging.getLogger(__name__)

_ATTR = "_scrapy_dist_settings"
_T = TypeVar("_T")


def _setting(name: str) -> Any:
    """A field filled from setting ``name`` of :data:`.table.TABLE`, with its default (a list as a tuple)."""
    default = DEFAULTS[name]
    return field(default=tuple(default) if isinstance(default, list) else default, metadata={"setting": name})


def _scrapy(name: str, default: Any, low: float | None = None) -> Any:
    """A field filled from Scrapy's own setting ``name``."""
    return field(default=default, metadata={"scrapy": name, "low": low})


def _build(cls: type[_T], raw: SettingsReader, **derived: Any) -> _T:
    """``cls``, :func:`_setting`/:func:`_scrapy` fields read from ``raw`` but ``derived``; dicts frozen."""
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name in derived:
            continue
        if "setting" in f.metadata:
            value = raw.value(f.metadata["setting"])
            derived[f.name] = tuple(map(str, value)) if isinstance(value, list) else value
        elif "scrapy" in f.metadata:
            derived[f.name] = raw.scrapy(f.metadata["scrapy"], f.default, low=f.metadata["low"])
    return cls(**{k: MappingProxyType(v) if isinstance(v, dict) else v for k, v in derived.items()})


@dataclass(frozen=True)
class ConnectionSettings:
    """Where Redis is and how to talk to it (see :mod:`scrapy_dist.redis.connection`)."""

    url: str | None = None  #: from the setting or the environment; None: Sentinels, host/port or embedded
    url_source: str = ""  # REDIS_URL or "REDIS_URL environment variable"
    host: str | None = None
    port: int | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    cluster: bool | None = _setting("REDIS_CLUSTER")
    sentinels: tuple[tuple[str, int], ...] = ()
    sentinel_master: str = _setting("REDIS_SENTINEL_MASTER")
    key_prefix: str = _setting("REDIS_KEY_PREFIX")
    embedded_dir: str | None = _setting("REDIS_EMBEDDED_DIR")
    embedded_maxmemory: int | str | None = _setting("REDIS_EMBEDDED_MAXMEMORY")

    @property
    def source(self) -> str:
        """The setting that chose the Redis (``REDIS_SENTINELS``, ``REDIS_URL``, ..., ``embedded``)."""
        if self.sentinels:
            return "REDIS_SENTINELS"
        if self.url_source == "REDIS_URL":
            return "REDIS_URL"
        return "REDIS_HOST/REDIS_PORT" if self.host or self.port else self.url_source or "embedded"


@dataclass(frozen=True)
class SchedulerSettings:
    """The frontier's settings."""

    queue_class: str = _setting("SCHEDULER_QUEUE_CLASS")
    persist: bool = _setting("SCHEDULER_PERSIST")
    flush_on_start: bool = _setting("SCHEDULER_FLUSH_ON_START")
    idle_before_close: float = _setting("SCHEDULER_IDLE_BEFORE_CLOSE")
    lease_seconds: float = _setting("SCHEDULER_LEASE_SECONDS")
    prefetch: int = 16  # derived: SCHEDULER_PREFETCH, 0 -> max(16, 2 x CONCURRENT_REQUESTS)
    concurrent_requests: int = _scrapy("CONCURRENT_REQUESTS", 16, low=1)
    flush_interval: float = _setting("SCHEDULER_FLUSH_INTERVAL")
    flush_batch: int = _setting("SCHEDULER_FLUSH_BATCH")
    idle_poll: float = _setting("SCHEDULER_IDLE_POLL")
    shutdown_grace: float = _setting("SCHEDULER_SHUTDOWN_GRACE")
    allowed_schemes: tuple[str, ...] = _setting("SCHEDULER_ALLOWED_SCHEMES")
    max_entry_bytes: int = _setting("SCHEDULER_MAX_ENTRY_BYTES")
    rejected_maxlen: int = _setting("SCHEDULER_REJECTED_MAXLEN")
    dead_maxlen: int = _setting("DEADLETTER_MAXLEN")
    replay_memory: int = _setting("SCHEDULER_REPLAY_MEMORY")
    entry_secret: bytes | None = field(default=None, repr=False)
    deny_networks: tuple[str, ...] = _setting("SCHEDULER_DENY_NETWORKS")
    downloader_aware: bool = True  #: SCHEDULER_PRIORITY_QUEUE is DownloaderAwarePriorityQueue
    shards: int = _setting("SCHEDULER_SHARDS")
    politeness: str = _setting("SCHEDULER_POLITENESS")
    domain_limits: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    download_delay: float = _scrapy("DOWNLOAD_DELAY", 0.0, low=0)
    concurrent_requests_per_domain: int = _scrapy("CONCURRENT_REQUESTS_PER_DOMAIN", 8, low=1)
    download_delay_jitter: float = _scrapy("DOWNLOAD_DELAY_JITTER", 0.5, low=0)
    revisit_after: Mapping[str, float | None] = field(default_factory=dict)
    revisit_conditional: bool = _setting("REVISIT_CONDITIONAL")
    revisit_min_interval: float = _setting("REVISIT_MIN_INTERVAL")
    idle_poll_max: float = _setting("SCHEDULER_IDLE_POLL_MAX")


@dataclass(frozen=True)
class DupefilterSettings:
    capacity: int = _setting("BLOOMFILTER_CAPACITY")
    error_rate: float = _setting("BLOOMFILTER_ERROR_RATE")
    block_bits: int = _setting("BLOOMFILTER_BLOCK_BITS")
    debug: bool = _scrapy("DUPEFILTER_DEBUG", False)
    ttl: float | None = _setting("DUPEFILTER_TTL")
    generations: int = _setting("BLOOMFILTER_GENERATIONS")
    forget_dead: bool = _setting("DEADLETTER_FORGET")


@dataclass(frozen=True)
class SeedSettings:
    key_template: str = _setting("REDIS_START_URLS_KEY")
    kind: str = "list"  # from REDIS_START_URLS_AS_SET / _AS_ZSET
    batch_size: int = 16  # derived: REDIS_START_URLS_BATCH_SIZE, 0 -> CONCURRENT_REQUESTS
    max_bytes: int = _setting("REDIS_START_URLS_MAX_BYTES")
    rejected_maxlen: int = _setting("REDIS_START_URLS_REJECTED_MAXLEN")
    meta_allowed: tuple[str, ...] = _setting("SEEDS_META_ALLOWED")
    headers_allowed: tuple[str, ...] = _setting("SEEDS_HEADERS_ALLOWED")
    dedupe: bool = _setting("REDIS_START_URLS_DEDUPE")
    record_fingerprint: bool = _setting("SEEDS_RECORD_FINGERPRINT")


@dataclass(frozen=True)
class RetrySettings:
    backoff_base: float = _setting("RETRY_BACKOFF_BASE")
    backoff_max: float = _setting("RETRY_BACKOFF_MAX")
    deadletter_ignored: bool = _setting("DEADLETTER_IGNORED")
    httperror_dead_letter: bool = _setting("HTTPERROR_DEAD_LETTER")


@dataclass(frozen=True)
class MonitoringSettings:
    interval: float = _setting("CLUSTERSTATS_INTERVAL")
    max_stats: tuple[str, ...] = _setting("CLUSTERSTATS_MAX_STATS")
    min_stats: tuple[str, ...] = _setting("CLUSTERSTATS_MIN_STATS")
    max_error_rate: float | None = _setting("ERRORMONITOR_MAX_ERROR_RATE")
    max_errors: int | None = _setting("ERRORMONITOR_MAX_ERRORS")
    window: float = _setting("ERRORMONITOR_WINDOW")
    action: str = _setting("ERRORMONITOR_ACTION")
    min_attempts: int = _setting("ERRORMONITOR_MIN_ATTEMPTS")
    http_errors: tuple[Any, ...] = _setting("ERRORMONITOR_HTTP_ERRORS")  # numbers stay numbers


@dataclass(frozen=True)
class ItemSettings:
    key_template: str = _setting("REDIS_ITEMS_KEY")
    stream: bool = _setting("REDIS_ITEMS_STREAM")
    maxlen: int | None = _setting("REDIS_ITEMS_MAXLEN")
    flush_interval: float = _setting("REDIS_ITEMS_FLUSH_INTERVAL")
    batch_size: int = _setting("REDIS_ITEMS_BATCH_SIZE")
    serializer: str | None = _setting("REDIS_ITEMS_SERIALIZER")
    exactly_once: bool = _setting("REDIS_ITEMS_EXACTLY_ONCE")
    max_bytes: int = _setting("REDIS_ITEMS_MAX_BYTES")


@dataclass(frozen=True)
class CookieSettings:
    cache_seconds: float = _setting("REDIS_COOKIES_CACHE_SECONDS")
    flush_interval: float = _setting("REDIS_COOKIES_FLUSH_INTERVAL")
    enabled: bool = _scrapy("COOKIES_ENABLED", True)
    debug: bool = _scrapy("COOKIES_DEBUG", False)


@dataclass(frozen=True)
class DistSettings:
    """Every scrapy-dist setting, typed and validated (:meth:`from_settings`, :meth:`for_crawler`)."""

    connection: ConnectionSettings = field(default_factory=ConnectionSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    dupefilter: DupefilterSettings = field(default_factory=DupefilterSettings)
    seeds: SeedSettings = field(default_factory=SeedSettings)
    retries: RetrySettings = field(default_factory=RetrySettings)
    monitoring: MonitoringSettings = field(default_factory=MonitoringSettings)
    items: ItemSettings = field(default_factory=ItemSettings)
    cookies: CookieSettings = field(default_factory=CookieSettings)
    warnings: tuple[str, ...] = ()  #: near-miss names, ignored scrapy-redis settings, aliases shadowed

    @classmethod
    def from_settings(cls, settings: Any, environ: Mapping[str, str] | None = None) -> DistSettings:
        """Read and check every setting of ``settings`` (Scrapy ``Settings`` or a mapping); raise
        :class:`SettingsError` on the first bad value. ``environ`` may supply ``REDIS_URL``."""
        env = os.environ if environ is None else environ
        raw = SettingsReader(settings)
        reader.check_components(raw.settings)
        v = raw.value
        warnings = [f"scrapy-dist: {alias} is ignored because {canonical} is set"
                    for alias, canonical in ALIASES.items() if raw.given(alias) and raw.given(canonical)]
        idle = v("SCHEDULER_IDLE_BEFORE_CLOSE")
        if not raw.given("SCHEDULER_IDLE_BEFORE_CLOSE") and raw.given("MAX_IDLE_TIME_BEFORE_CLOSE"):
            alias_spec = replace(BY_NAME["SCHEDULER_IDLE_BEFORE_CLOSE"], name="MAX_IDLE_TIME_BEFORE_CLOSE")
            idle = values.convert(alias_spec, raw.raw("MAX_IDLE_TIME_BEFORE_CLOSE"))
        # the reader takes None for "not set"; for this setting an explicit None means "never close"
        if idle is None or ("SCHEDULER_IDLE_BEFORE_CLOSE" in raw.settings
                            and raw.raw("SCHEDULER_IDLE_BEFORE_CLOSE") is None):
            idle = math.inf  # a long-running crawl: every comparison with "seconds idle" says "not yet"
        # Redis: settings first, then the environment, then the embedded server
        url, url_source = v("REDIS_URL"), "REDIS_URL" if v("REDIS_URL") else ""
        params, host, port = reader.redis_location(v)
        if not (url or v("REDIS_SENTINELS") or host or port) and env.get("REDIS_URL", "").strip():
            try:
                url = values.check_url(env["REDIS_URL"])
            except SettingsError as exc:
                raise SettingsError("REDIS_URL", exc.value, f"{exc.problem} (environment variable)",
                                    exc.expected) from None
            url_source = "REDIS_URL environment variable"
        connection = _build(ConnectionSettings, raw, url=url, url_source=url_source, host=host, port=port,
                            params=params, sentinels=values.sentinels(v("REDIS_SENTINELS")),
                            sentinel_master=v("REDIS_SENTINEL_MASTER") or "mymaster")
        values.check_client_options(url, params)
        concurrent = raw.scrapy("CONCURRENT_REQUESTS", 16, low=1)
        schemes = tuple(str(s).strip().lower() for s in v("SCHEDULER_ALLOWED_SCHEMES"))
        if not schemes or any(not re.fullmatch(r"[a-z][a-z0-9+.-]*", s) for s in schemes):
            raise SettingsError("SCHEDULER_ALLOWED_SCHEMES", v("SCHEDULER_ALLOWED_SCHEMES"),
                                "not a list of URL schemes", 'expected e.g. ["http", "https"]')
        deny = tuple(str(n).strip() for n in v("SCHEDULER_DENY_NETWORKS") if str(n).strip())
        for net in deny:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise SettingsError("SCHEDULER_DENY_NETWORKS", list(deny), f"{net!r} is not a network",
                                    'expected CIDR blocks like ["10.0.0.0/8", "fc00::/7"], or []') from None
        scheduler = _build(
            SchedulerSettings, raw, idle_before_close=idle, allowed_schemes=schemes, deny_networks=deny,
            queue_class=reader.queue_order("SCHEDULER_QUEUE_CLASS", v("SCHEDULER_QUEUE_CLASS")),
            prefetch=v("SCHEDULER_PREFETCH") or max(16, 2 * concurrent),
            entry_secret=v("SCHEDULER_ENTRY_SECRET") or env.get("SCRAPY_DIST_SECRET", "").encode() or None,
            downloader_aware="DownloaderAwarePriorityQueue" in str(raw.raw("SCHEDULER_PRIORITY_QUEUE") or ""),
            domain_limits=values.domain_limits(v("DOMAIN_LIMITS")),
            revisit_after=values.revisit_rules(v("REVISIT_AFTER"), v("REVISIT_MIN_INTERVAL")))
        if scheduler.downloader_aware and raw.scrapy("CONCURRENT_REQUESTS_PER_IP", 0, low=0):
            # as in Scrapy: a request's IP slot is unknown before its download, so the least busy is unknown
            raise SettingsError("SCHEDULER_PRIORITY_QUEUE", raw.raw("SCHEDULER_PRIORITY_QUEUE"),
                                "DownloaderAwarePriorityQueue does not support CONCURRENT_REQUESTS_PER_IP",
                                "set CONCURRENT_REQUESTS_PER_IP = 0 or use the default priority queue")
        if v("REDIS_START_URLS_AS_SET") and v("REDIS_START_URLS_AS_ZSET"):
            raise SettingsError("REDIS_START_URLS_AS_SET", True, "cannot be combined with"
                                " REDIS_START_URLS_AS_ZSET=True (the seeds key has one type)", "set only one")
        kind = "zset" if v("REDIS_START_URLS_AS_ZSET") else "set" if v("REDIS_START_URLS_AS_SET") else "list"
        seeds = _build(SeedSettings, raw, kind=kind,
                       batch_size=v("REDIS_START_URLS_BATCH_SIZE") or concurrent)
        if not seeds.key_template:
            raise SettingsError("REDIS_START_URLS_KEY", "", "empty", "expected e.g. %(name)s:start_urls")
        if v("RETRY_BACKOFF_MAX") < v("RETRY_BACKOFF_BASE"):
            raise SettingsError("RETRY_BACKOFF_MAX", v("RETRY_BACKOFF_MAX"), "below RETRY_BACKOFF_BASE"
                                f" ({v('RETRY_BACKOFF_BASE'):g})", "expected at least RETRY_BACKOFF_BASE")
        http_errors = tuple(v("ERRORMONITOR_HTTP_ERRORS"))
        for code in http_errors:
            if not re.fullmatch(r"[1-5](xx|\d\d)", str(code).strip().lower()):
                raise SettingsError("ERRORMONITOR_HTTP_ERRORS", list(http_errors),
                                    f"{code!r} is not a status", 'expected e.g. 503 or "5xx"')
        return cls(
            connection=connection, scheduler=scheduler, seeds=seeds,
            dupefilter=_build(DupefilterSettings, raw), retries=_build(RetrySettings, raw),
            monitoring=_build(MonitoringSettings, raw, http_errors=http_errors),
            items=_build(ItemSettings, raw,
                         serializer=reader.importable("REDIS_ITEMS_SERIALIZER", v("REDIS_ITEMS_SERIALIZER"))),
            cookies=_build(CookieSettings, raw),
            warnings=tuple(warnings + raw.unknown_names() + raw.scrapy_queue_warnings()))

    @classmethod
    def coerce(cls, settings: Any) -> DistSettings:
        """``settings`` itself if it is a :class:`DistSettings`, else :meth:`from_settings` of it."""
        return settings if isinstance(settings, DistSettings) else cls.from_settings(settings)

    @classmethod
    def for_crawler(cls, crawler: Crawler) -> DistSettings:
        """:meth:`from_settings` of the crawler's settings, cached once frozen (its warnings logged once)."""
        if (cached := getattr(crawler, _ATTR, None)) is not None:
            return cached  # type: ignore[no-any-return]
        built = cls.from_settings(crawler.settings)
        if getattr(crawler.settings, "frozen", True):
            setattr(crawler, _ATTR, built)
            for line in built.warnings:
                logger.warning("%s", line)
        return built

