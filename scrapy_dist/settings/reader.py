"""Raw setting values (:class:`SettingsReader`, warning about near-miss, scrapy-redis and Scrapy queue
names), the components a crawl runs (:data:`COMPONENTS`), and the refusal of a crawl that cannot start
(:func:`refuse_start`: one ERROR line, then ``CloseSpider(REASON)`` and ``scrapy crawl`` exits with 1)."""

from __future__ import annotations

import difflib
import functools
import importlib
import logging
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

from scrapy import signals
from scrapy.exceptions import CloseSpider, NotConfigured
from scrapy.settings import default_settings
from scrapy.utils.misc import load_object

from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.settings.table import ALIASES, BY_NAME, CONNECTION_GUESSES, SCRAPY_REDIS_IGNORED, Setting
from scrapy_dist.settings.values import SettingsError, convert

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

logger = logging.getLogger(__name__)

#: scrapy-redis's queue classes -> the queue order of :mod:`scrapy_dist.queue` each one means
QUEUE_ALIASES = {f"scrapy_redis.queue.{old}": new for old, new in (
    ("PriorityQueue", "PriorityQueue"), ("FifoQueue", "FifoQueue"), ("LifoQueue", "LifoQueue"),
    ("SpiderPriorityQueue", "PriorityQueue"), ("SpiderQueue", "FifoQueue"), ("SpiderStack", "LifoQueue"))}

#: an unknown setting with one of these prefixes may be a typo of ours
OUR_PREFIXES = ("REDIS_", "SCHEDULER_", "BLOOMFILTER_", "DUPEFILTER_", "CLUSTERSTATS_", "ERRORMONITOR_",
                 "RETRY_", "DEADLETTER_", "HTTPERROR_", "DOMAIN_", "MAX_IDLE")

#: Scrapy's own queue settings and what applies instead with the scrapy-dist scheduler.
_IN_REDIS = "the queue lives in Redis (SCHEDULER_QUEUE_CLASS chooses its order)"
_STARTS = "start requests share the Redis queue, after callback requests of equal priority"
SCRAPY_QUEUE_SETTINGS: Mapping[str, str] = MappingProxyType({
    "SCHEDULER_MEMORY_QUEUE": _IN_REDIS, "SCHEDULER_DISK_QUEUE": _IN_REDIS,
    "SCHEDULER_START_MEMORY_QUEUE": _STARTS, "SCHEDULER_START_DISK_QUEUE": _STARTS,
    "JOBDIR": "the frontier is kept in Redis (SCHEDULER_PERSIST); JOBDIR keeps only Scrapy's own state"})


def importable(name: str, path: str | None) -> Any:
    """``path`` if it names an object that can be imported (or a scrapy-redis queue alias)."""
    if path is None or path in QUEUE_ALIASES:
        return path
    try:
        load_object(path)
    except (ImportError, AttributeError, ValueError, NameError, TypeError) as exc:
        problem = " ".join(str(exc).split()) or type(exc).__name__
        raise SettingsError(name, path, f"cannot be imported ({problem})",
                            f"did you mean {close}?" if (close := closest_path(path))
                            else "expected an import path like package.module.Name") from None
    return path


def closest_path(path: str) -> str | None:
    """The importable scrapy-dist name closest to ``path``, or None (outside scrapy-dist, nothing close)."""
    module, _, name = path.rpartition(".")
    if module != "scrapy_dist" and not module.startswith("scrapy_dist."):
        return None
    try:
        found = importlib.import_module(module)
    except ImportError:  # a misspelt module: the closest of scrapy-dist's modules, if it has the name
        modules = [m.name for m in pkgutil.iter_modules(importlib.import_module("scrapy_dist").__path__)]
        if not (close := difflib.get_close_matches(module.partition(".")[2], modules, n=1, cutoff=0.6)):
            return None
        module = f"scrapy_dist.{close[0]}"
        found = importlib.import_module(module)
    close = difflib.get_close_matches(name, [n for n in dir(found) if not n.startswith("_")], n=1, cutoff=0.6)
    return f"{module}.{close[0]}" if close else None


COMPONENT_SETTINGS = ("SCHEDULER", "DUPEFILTER_CLASS", "STATS_CLASS")  #: pointed at scrapy-dist's classes


def check_components(settings: Any) -> None:
    """Raise :class:`SettingsError` (with the closest name) if a :data:`COMPONENT_SETTINGS` names a
    scrapy-dist class that cannot be imported, or our scheduler's ``DUPEFILTER_CLASS`` cannot be."""
    paths = {name: settings.get(name) for name in COMPONENT_SETTINGS}
    ours = str(paths["SCHEDULER"]).startswith("scrapy_dist.")
    for name, value in paths.items():
        also = ours and name == "DUPEFILTER_CLASS"  # our scheduler needs it
        if isinstance(value, str) and value and (value.startswith("scrapy_dist.") or also):
            importable(name, value)


def queue_order(name: str, path: str) -> str:
    """``path`` if it names a queue order (``score(request)`` and ``sequence``, built without arguments) or
    a scrapy-redis alias of one; a queue class of one's own is refused (the frontier is one sorted set)."""
    if importable(name, path) in QUEUE_ALIASES:
        return path
    try:
        order = load_object(path)()
        ok = callable(getattr(order, "score", None)) and getattr(order, "sequence", None) in ("asc", "desc")
    except Exception:  # a constructor that wants arguments: a queue object, not an order
        ok = False
    if not ok:
        raise SettingsError(name, path, "not a queue order (a class with score(request) and sequence)",
                            "expected scrapy_dist.queue.PriorityQueue, FifoQueue or LifoQueue (or their"
                            " scrapy_redis.queue names), or a class like them")
    return path


class SettingsReader:
    """Raw values of a Scrapy ``Settings`` or a plain mapping, converted per :data:`.table.TABLE`."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings if settings is not None else {}
        self._cache: dict[str, Any] = {}

    def raw(self, name: str) -> Any:
        return self.settings.get(name)

    def given(self, name: str) -> bool:
        return self.raw(name) is not None

    def value(self, name: str) -> Any:
        if name not in self._cache:
            spec, raw = BY_NAME[name], self.raw(name)
            self._cache[name] = convert(spec, spec.default if raw is None else raw)  # a dict or list: a copy
        return self._cache[name]

    def scrapy(self, name: str, default: Any, low: float | None = None) -> Any:
        """One of Scrapy's own settings, checked as the type of ``default``."""
        raw = self.raw(name)
        spec = Setting(name, default, type(default).__name__, "", "scrapy", low=low)
        return default if raw is None else convert(spec, raw)

    def scrapy_queue_warnings(self) -> list[str]:
        """One warning per Scrapy queue setting the project changed that our scheduler cannot honour."""
        if "scrapy_dist" not in str(self.raw("SCHEDULER") or ""):
            return []
        priority = getattr(self.settings, "getpriority", lambda name: None)  # > 0: project, spider, -s
        out = [f"scrapy-dist: {name} has no effect with the scrapy-dist scheduler: {instead}"
               for name, instead in SCRAPY_QUEUE_SETTINGS.items() if (priority(name) or 0) > 0]
        pq = str(self.raw("SCHEDULER_PRIORITY_QUEUE") or "")
        if pq and not pq.endswith(("DownloaderAwarePriorityQueue", "ScrapyPriorityQueue")):
            out.append(f"scrapy-dist: SCHEDULER_PRIORITY_QUEUE={pq} has no effect with the scrapy-dist"
                       " scheduler (it serves by priority); use SCHEDULER_QUEUE_CLASS for the queue's order")
        return out

    def unknown_names(self) -> list[str]:
        """One warning per name like one of ours but not ours, and per ignored scrapy-redis setting set."""
        try:
            names = [str(n) for n in self.settings]
        except TypeError:
            return []
        known = set(BY_NAME) | set(ALIASES)
        hinted = known | set(SCRAPY_REDIS_IGNORED) | set(CONNECTION_GUESSES)
        out = []
        for name in sorted(names):
            if name in SCRAPY_REDIS_IGNORED and self.given(name):
                out.append(f"scrapy-dist: {name} is a scrapy-redis setting scrapy-dist does not apply:"
                           f" {SCRAPY_REDIS_IGNORED[name]}")
            elif name in CONNECTION_GUESSES and self.given(name):
                out.append(f"scrapy-dist: unknown setting {name}: {CONNECTION_GUESSES[name]}")
            # Scrapy's own settings are never "did you mean" one of ours
            elif (name not in hinted and name.startswith(OUR_PREFIXES) and not hasattr(default_settings, name)
                  and (close := difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.85))):
                out.append(f"scrapy-dist: unknown setting {name}; did you mean {close[0]}?")
        return out


def redis_location(v: Callable[[str], Any]) -> tuple[dict[str, Any], Any, Any]:
    """``(REDIS_PARAMS, host, port)`` as scrapy-redis combines them: ``REDIS_DB``, ``REDIS_HOST`` and
    ``REDIS_PORT`` win over ``REDIS_PARAMS``' (``redis_cls`` is dropped: we build our own clients)."""
    params = v("REDIS_PARAMS")
    params.pop("redis_cls", None)
    if v("REDIS_DB") is not None:
        params["db"] = v("REDIS_DB")
    host, port = v("REDIS_HOST"), v("REDIS_PORT")
    if not host and params.get("host") not in (None, ""):
        host = convert(replace(BY_NAME["REDIS_HOST"], name="REDIS_PARAMS['host']"), params["host"])
    if not port and params.get("port") not in (None, ""):
        port = convert(replace(BY_NAME["REDIS_PORT"], name="REDIS_PARAMS['port']"), params["port"])
    return params, host, port


REASON = "scrapy_dist_refused"  #: The close reason (``finish_reason``) of a crawl refused at start.
_ATTR = "_scrapy_dist_start_error"
F = TypeVar("F", bound="Callable[..., Any]")


def start_error(crawler: Any) -> ScrapyDistError | None:
    """The error that stopped ``crawler`` at start (the first one), or None."""
    return getattr(crawler, _ATTR, None)


def refuse_start(crawler: Crawler, error: ScrapyDistError) -> None:
    """Log ``error`` as one ERROR line and stop the crawl cleanly once it is open (see the module
    docstring). Only the first error of a crawler is logged: later ones are its consequences."""
    if start_error(crawler) is not None:
        return
    logger.error("%s", error)
    setattr(crawler, _ATTR, error)

    def opened(spider: Any) -> None:
        raise CloseSpider(REASON)

    def closed(spider: Any, reason: str) -> None:
        crawler.spider = None  # Scrapy's runners count a crawl that ends without a spider as a failed start
    crawler.signals.connect(opened, signal=signals.spider_opened, weak=False)
    crawler.signals.connect(closed, signal=signals.spider_closed, weak=False)


def refusing(from_crawler: F) -> F:
    """Decorate a component's ``from_crawler``: a :class:`ScrapyDistError` it raises refuses the crawl's start
    and disables the component; a crawl already refused does not build it."""

    @functools.wraps(from_crawler)
    def wrapper(cls: Any, crawler: Crawler, *args: Any, **kwargs: Any) -> Any:
        if start_error(crawler) is not None:
            raise NotConfigured
        try:
            return from_crawler(cls, crawler, *args, **kwargs)
        except ScrapyDistError as exc:
            refuse_start(crawler, exc)
            raise NotConfigured from exc
    return wrapper  # type: ignore[return-value]


def refuse_misspelt_components(crawler: Crawler) -> None:
    """Refuse the start if a :data:`COMPONENT_SETTINGS` names a missing scrapy-dist class, and put Scrapy's
    default in its place, so Scrapy loads it without a traceback (settings not frozen yet)."""
    settings = crawler.settings
    for _ in COMPONENT_SETTINGS:
        try:
            check_components(settings)
            return
        except SettingsError as exc:
            refuse_start(crawler, exc)
            if getattr(settings, "frozen", True):
                return
            settings.set(exc.name, getattr(default_settings, exc.name),
                         priority=settings.getpriority(exc.name) or "default")


ADDON_LINE = 'ADDONS = {"scrapy_dist.Addon": 0}'  #: the add-on line that enables everything below


@dataclass(frozen=True)
class Component:
    """One component. ``attach``: how the scheduler runs it without the add-on: ``signals`` (an extension
    it connects itself), ``chain`` (a downloader middleware put anywhere in the running chain) or
    ``position`` (only the add-on can place it; the scheduler names ``lacks`` in one WARNING)."""

    path: str
    setting: str
    order: int
    attach: str
    lacks: str = ""
    replaces: str = ""  # Scrapy's component it replaces
    when: str = ""  #: a DistSettings attribute path: while false the component does nothing


#: Plain settings the add-on fills in while they hold Scrapy's default.
SETTINGS = {"SCHEDULER": "scrapy_dist.scheduler.Scheduler",
            "DUPEFILTER_CLASS": "scrapy_dist.dupefilter.BloomDupeFilter"}

COMPONENTS = (
    Component("scrapy_dist.extensions.ClusterStats", "EXTENSIONS", 500, "signals"),
    Component("scrapy_dist.extensions.IdleMonitor", "EXTENSIONS", 500, "signals"),
    Component("scrapy_dist.extensions.ErrorMonitor", "EXTENSIONS", 500, "signals"),
    # first in the chain, so credentials are remembered as scheduled before other middlewares add theirs
    Component("scrapy_dist.middlewares.ScheduledHeadersMiddleware", "DOWNLOADER_MIDDLEWARES", 10,
              "position", "credential headers the spider set kept apart from those middlewares add"),
    # denied networks refused before any work; anywhere in the chain, it refuses before the download
    Component("scrapy_dist.middlewares.DenyNetworksMiddleware", "DOWNLOADER_MIDDLEWARES", 20,
              "chain", "SCHEDULER_DENY_NETWORKS"),
    # last, to learn which credential values the middlewares added
    Component("scrapy_dist.middlewares.AddedCredentialsMiddleware", "DOWNLOADER_MIDDLEWARES", 990,
              "position", "credential headers added by middlewares kept out of the shared queue"),
    Component("scrapy_dist.middlewares.ConditionalRevisitMiddleware", "DOWNLOADER_MIDDLEWARES", 580,
              "position", "REVISIT_CONDITIONAL (a 304 ends a conditional revisit)",
              when="scheduler.revisit_conditional"),
    Component("scrapy_dist.middlewares.retry.RetryMiddleware", "DOWNLOADER_MIDDLEWARES", 550, "position",
              "delayed retries through the shared frontier (Scrapy's RetryMiddleware retries at once, on"
              " this worker)", replaces="scrapy.downloadermiddlewares.retry.RetryMiddleware"),
    Component("scrapy_dist.middlewares.HttpErrorMiddleware", "SPIDER_MIDDLEWARES", 50, "position",
              "dead letters for HTTP error responses",
              replaces="scrapy.spidermiddlewares.httperror.HttpErrorMiddleware"))


def mentions(component_dict: dict[Any, Any], path: str) -> bool:
    """Whether a component dict names the class at ``path`` (enabled or ``None``), by any import path."""
    target = load_object(path)
    for key in component_dict:
        try:
            if (load_object(key) if isinstance(key, str) else key) is target:
                return True
        except (ImportError, AttributeError, ValueError, NameError):
            continue
    return False
