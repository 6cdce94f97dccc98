"""``RedisSpider`` and ``RedisCrawlSpider``: spiders whose seeds are pushed to Redis (docs/seeds.md) and read
in ``async def start()``; their scrapy-redis attributes (often ``-a`` strings) are converted when built."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import dis
import logging
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scrapy import Request, Spider, signals
from scrapy.settings import SETTINGS_PRIORITIES
from scrapy.spiders import CrawlSpider

from scrapy_dist.seeds import SeedRules, parse_seed, seed_request, spider_has_callback
from scrapy_dist.seeds.feed import SeedFeed, SeedReader, TakeResult  # noqa: F401 - re-exported
from scrapy_dist.settings import SettingsError
from scrapy_dist.settings.reader import refuse_misspelt_components, refuse_start, start_error
from scrapy_dist.wire.entrypolicy import keep_allowed_domains

if TYPE_CHECKING:
    from scrapy.crawler import Crawler
    from scrapy.settings import Settings
    from typing_extensions import Self

logger = logging.getLogger(__name__)

IDLE_PRIORITY = 50  #: of the SCHEDULER_IDLE_BEFORE_CLOSE a spider's ``max_idle_time`` sets: above ``-s``
ARGUMENTS = ("redis_key", "redis_batch_size", "max_idle_time", "redis_encoding")  #: the ``-a`` it reads

_SEEDS_IN_START = ("seeds are read in async def start(); to yield requests of your own too, override start()"
                   " and end it with `async for request in super().start(): yield request`")
#: scrapy-redis RedisSpider methods that scrapy-dist's never calls, and what to do instead.
SCRAPY_REDIS_HOOKS: dict[str, str] = {
    "start_requests": _SEEDS_IN_START,
    "next_requests": _SEEDS_IN_START + "; override make_request_from_data to change what a seed becomes",
    "schedule_next_requests": _SEEDS_IN_START,
    "fetch_data": "seeds are taken by scrapy-dist (LPOP, SPOP or ZPOPMAX, recorded until they are in the"
                  " frontier); override make_request_from_data to change what a seed becomes",
    "pop_list_queue": "seeds are taken by scrapy-dist; override make_request_from_data instead",
    "pop_priority_queue": "seeds are taken by scrapy-dist; override make_request_from_data instead",
    "spider_idle": "when the crawl is idle is decided crawl-wide (SCHEDULER_IDLE_BEFORE_CLOSE); connect a"
                   " handler to signals.spider_idle yourself if you need one",
    "setup_redis": "there is no spider.server; a client of your own:"
                   " scrapy_dist.connection.get_redis(settings)"}


def _users_class(klass: type) -> bool:
    return klass.__module__.partition(".")[0] not in ("scrapy", "scrapy_dist", "builtins")


def unused_hooks(spider_cls: type) -> list[str]:
    """The scrapy-redis hooks ``spider_cls`` defines that nothing calls (none with its own ``start()``)."""
    owners = {name: next((k for k in spider_cls.__mro__ if name in vars(k)), None)
              for name in ("start", *SCRAPY_REDIS_HOOKS)}
    own = [name for name, klass in owners.items() if klass is not None and _users_class(klass)]
    return [] if "start" in own else own


def reads_missing_server(spider: Any) -> list[str]:
    """The methods of the spider's classes that read ``self.server`` (scrapy-redis's), unless one sets it."""
    if "server" in vars(spider) or any("server" in vars(k) for k in type(spider).__mro__):
        return []
    readers: list[str] = []
    for klass in filter(_users_class, type(spider).__mro__):
        for name, func in vars(klass).items():
            code = getattr(getattr(func, "__func__", func), "__code__", None)
            ops = {i.opname for c in _code_objects(code) for i in dis.get_instructions(c)
                   if i.argval == "server"}
            if "STORE_ATTR" in ops:
                return []  # it makes its own
            if "LOAD_ATTR" in ops or "LOAD_METHOD" in ops:
                readers.append(f"{klass.__name__}.{name}")
    return readers


def _code_objects(code: Any) -> list[Any]:
    """``code`` and the code objects nested in it (comprehensions, inner functions)."""
    if code is None:
        return []
    return [code, *(c for const in code.co_consts if hasattr(const, "co_code") for c in _code_objects(const))]


@dataclass(frozen=True)
class SpiderArguments:
    """The converted values (``None``: the spider does not set it, the setting applies)."""

    redis_key: str | None = None  #: the seeds key, ``%(name)s`` replaced (as scrapy-redis leaves it)
    redis_batch_size: int | None = None
    max_idle_time: float | None = None

    @classmethod
    def of(cls, spider: Any) -> SpiderArguments:
        """Read and convert the spider's attributes; :class:`SettingsError` if one is unusable."""
        return cls(
            redis_key=_key(getattr(spider, "redis_key", None), getattr(spider, "name", "")),
            redis_batch_size=_number(spider, "redis_batch_size", True, 1, "not a whole number of at least 1",
                                     "expected seeds per round trip, e.g. -a redis_batch_size=16"),
            max_idle_time=_number(spider, "max_idle_time", False, 0, "not a number of seconds >= 0",
                                  "expected e.g. -a max_idle_time=30 (0: never close an idle crawl)"))


def _key(value: Any, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise SettingsError("redis_key", value, f"a {type(value).__name__}, not a string",
                            "expected a key name such as '%(name)s:start_urls'")
    try:
        expanded = value % {"name": name, "spider": name}
    except (TypeError, ValueError, KeyError) as exc:
        raise SettingsError("redis_key", value, f"bad %-template ({exc})",
                            "only %(name)s is replaced; write a literal % as %%") from None
    if not expanded.strip():
        raise SettingsError("redis_key", value, "an empty key",
                            "expected a key name such as '%(name)s:start_urls', or leave it unset")
    return expanded


def _number(spider: Any, name: str, integer: bool, low: int, problem: str, hint: str) -> Any:
    """Attribute ``name`` (a number or a ``-a`` string) as an int or float of at least ``low``, or None."""
    if (value := getattr(spider, name, None)) is None:
        return None
    number = math.nan
    with contextlib.suppress(TypeError, ValueError):
        number = float(value.strip() if isinstance(value, str) else value)
    whole = not integer or number.is_integer()
    if isinstance(value, bool) or not math.isfinite(number) or number < low or not whole:
        raise SettingsError(name, value, problem, hint)
    return int(number) if integer else number


def apply_spider_arguments(spider: Any, crawler: Crawler) -> SpiderArguments:
    """Convert the spider's scrapy-redis attributes in place; ``max_idle_time`` sets the idle setting."""
    args = SpiderArguments.of(spider)
    encoding = getattr(spider, "redis_encoding", None)
    if encoding is not None and str(encoding).strip().lower().replace("-", "").replace("_", "") != "utf8":
        logger.warning("scrapy-dist: redis_encoding=%s is not applied: seeds are read as UTF-8 (others are"
                       " rejected as not_utf8); override make_request_from_data to decode another encoding",
                       encoding)
    for name in sorted(vars(spider)):  # a near miss of an argument it reads (-a redis_kye=...)
        if name not in ARGUMENTS and (close := difflib.get_close_matches(name, ARGUMENTS, n=1, cutoff=0.75)):
            logger.warning("scrapy-dist: spider argument %s is not one %s reads; did you mean %s?", name,
                           type(spider).__name__, close[0])
    for name in unused_hooks(type(spider)):
        logger.warning("scrapy-dist: %s.%s() is never called: %s", type(spider).__name__, name,
                       SCRAPY_REDIS_HOOKS[name])
    if readers := reads_missing_server(spider):
        logger.warning("scrapy-dist: %s() reads self.server, scrapy-redis's client, which scrapy-dist's"
                       " RedisSpider lacks: in from_crawler after super(), set `spider.server ="
                       " scrapy_dist.connection.get_redis(crawler.settings)`", "(), ".join(readers))
    for name, value in dataclasses.asdict(args).items():
        if value is not None:
            setattr(spider, name, value)
    if args.max_idle_time is None:
        _warn_scrapy_redis_idle(crawler.settings)
    elif getattr(crawler.settings, "frozen", False):  # built outside Crawler.crawl(): too late to set
        logger.warning("scrapy-dist: max_idle_time=%s is ignored: the settings were already frozen; set"
                       " SCHEDULER_IDLE_BEFORE_CLOSE instead", args.max_idle_time)
    else:
        crawler.settings.set("SCHEDULER_IDLE_BEFORE_CLOSE", args.max_idle_time, priority=IDLE_PRIORITY)
    return args


def _warn_scrapy_redis_idle(settings: Settings) -> None:
    """Warn of a scrapy-redis project's ``SCHEDULER_IDLE_BEFORE_CLOSE`` > 0 (there a pop timeout)."""
    if settings.get("MAX_IDLE_TIME_BEFORE_CLOSE") is not None:
        return
    # the spider is built before add-ons fill settings: ADDONS is read as written
    addons = {k if isinstance(k, str) else f"{getattr(k, '__module__', '')}.{getattr(k, '__name__', '')}"
              for k in settings.getdict("ADDONS")}
    priority = settings.getpriority("SCHEDULER_IDLE_BEFORE_CLOSE")
    if addons & {"scrapy_dist.Addon", "scrapy_dist.addon.Addon"} or priority not in (
            SETTINGS_PRIORITIES["project"], SETTINGS_PRIORITIES["spider"]):
        return
    value = settings.get("SCHEDULER_IDLE_BEFORE_CLOSE")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return  # None (never close), or garbage the settings check reports
    if seconds > 0:
        logger.warning("scrapy-dist: SCHEDULER_IDLE_BEFORE_CLOSE = %s closes this RedisSpider's workers"
                       " after %s s without work crawl-wide (in scrapy-redis, a blocking pop timeout): set it"
                       " to 0 to wait for ever, or name it MAX_IDLE_TIME_BEFORE_CLOSE (scrapy-redis's idle"
                       " close) to keep closing without this warning", value, value)


class RedisMixin:
    """Reads the spider's seeds from Redis in ``async def start()``."""

    redis_key: str | None = None
    redis_batch_size: int | None = None
    max_idle_time: float | None = None  #: sets SCHEDULER_IDLE_BEFORE_CLOSE
    #: scrapy-redis's, for make_request_from_data overrides: seeds are read as UTF-8 (others: a warning)
    redis_encoding: str = "utf-8"

    name: str
    crawler: Crawler
    _seed_feed: SeedFeed | None = None

    @classmethod
    def from_crawler(cls, crawler: Crawler, *args: Any, **kwargs: Any) -> Self:
        refuse_misspelt_components(crawler)  # before Scrapy loads SCHEDULER, which would fail noisily
        spider = super().from_crawler(crawler, *args, **kwargs)  # type: ignore[misc]
        keep_allowed_domains(spider)  # an iterator (scrapy-redis's example) must outlive Scrapy's reads
        try:
            apply_spider_arguments(spider, crawler)  # -a values are strings: converted as scrapy-redis does
        except SettingsError as exc:
            refuse_start(crawler, exc)
        crawler.signals.connect(spider._close_seed_feed, signal=signals.spider_closed)
        return spider

    async def start(self) -> AsyncIterator[Any]:
        """Yield requests for the seeds as they arrive, until the crawl closes as idle."""
        if start_error(self.crawler) is not None:  # the crawl stops as it opens: no seed is taken
            return
        self._seed_feed = SeedFeed.from_spider(self)
        async for request in self._seed_feed.requests():
            yield request

    def make_request_from_data(self, data: bytes) -> Request | None:
        """The request for one raw seed (a URL or a JSON object), ``None`` to skip it; raise
        :class:`~scrapy_dist.exceptions.RejectedEntry` to reject it (any other exception: ``hook_error``)."""
        rules = self._seed_feed.rules if self._seed_feed is not None else SeedRules()
        seed = parse_seed(data, rules, has_callback=spider_has_callback(self))  # type: ignore[arg-type]
        return seed_request(seed, self, dedupe=rules.dedupe)  # type: ignore[arg-type]

    async def _close_seed_feed(self, spider: Spider, reason: str) -> None:
        if spider is self and self._seed_feed is not None:
            await self._seed_feed.close()


class RedisSpider(RedisMixin, Spider):
    """A :class:`scrapy.Spider` whose start requests come from Redis (``<name>:start_urls``)."""


class RedisCrawlSpider(RedisMixin, CrawlSpider):
    """A ``CrawlSpider`` (rules followed from every seed without a callback) seeded from Redis."""

    def _build_request(self, rule_index: int, link: Any) -> Request:
        # the wire format refuses private method names (a name read from Redis must not reach private
        # methods): rule requests name public stand-ins for CrawlSpider's _callback/_errback
        request = super()._build_request(rule_index, link)
        return request.replace(callback=self.rule_callback, errback=self.rule_errback)

    def rule_callback(self, response: Any, **cb_kwargs: Any) -> Any:
        return self._callback(response, **cb_kwargs)

    def rule_errback(self, failure: Any) -> Any:
        return self._errback(failure)
