"""What the frontier takes from Scrapy's crawler (the one place reading ``engine._slot``), and what rides a
finished request's ack: its items (``ItemOutbox``) and revisit (``Revisits``), local feeds fsynced first."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import msgpack
from redis.crc import key_slot
from scrapy import signals
from scrapy.exceptions import NotConfigured
from scrapy.utils.httpobj import urlparse_cached
from scrapy.utils.misc import build_from_crawler, load_object
from twisted.python.failure import Failure

from scrapy_dist.exceptions import ReleasedAtClose
from scrapy_dist.frontier.orders import NOT_SET, RevisitRules
from scrapy_dist.frontier.shard import lease_member, member_prefix
from scrapy_dist.redis.connection import is_cluster
from scrapy_dist.settings import DistSettings
from scrapy_dist.settings.reader import ADDON_LINE, COMPONENTS, Component, mentions
from scrapy_dist.settings.values import check_seconds
from scrapy_dist.utils import RateLimitedLog, inc_stat
from scrapy_dist.wire.codec import load_payload
from scrapy_dist.wire.entrypolicy import DEFAULT_POLICY, entry_policy

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.crawler import Crawler
    from typing_extensions import Self

    from scrapy_dist.frontier.scheduler import Scheduler
    from scrapy_dist.frontier.shard import ItemRoute
    from scrapy_dist.frontier.syncloop import SyncLoop
    from scrapy_dist.wire.entrypolicy import EntryPolicy

logger = logging.getLogger(__name__)
META_KEY = "revisit_after"  #: the meta key a request (or its callback) sets: seconds, or None to stop
MAX_VALIDATOR_BYTES = 256  #: longer validators are not stored (the page is revisited unconditionally)
VALIDATOR_HEADERS = (b"If-None-Match", b"If-Modified-Since")


def engine_of(crawler: Any) -> Any:
    """``crawler.engine``, or None before the crawl starts (Scrapy raises RuntimeError then)."""
    try:
        return crawler.engine
    except (AttributeError, RuntimeError):
        return None


def _slot(crawler: Any) -> Any:
    return getattr(engine_of(crawler), "_slot", None)


def inprogress(crawler: Any) -> Any:
    """The engine's requests in progress (left once the callback's output reached the scheduler)."""
    return getattr(_slot(crawler), "inprogress", None)


def scheduler(crawler: Any) -> Any:
    """The engine's scheduler, or ``None`` before the crawl starts."""
    return getattr(_slot(crawler), "scheduler", None)


def is_closing(crawler: Any) -> bool:
    return getattr(_slot(crawler), "closing", None) is not None


def locally_idle(crawler: Any) -> bool:
    """Whether the engine's own scheduler has nothing pending and its downloader nothing active."""
    slot = _slot(crawler)
    return slot is None or not (slot.scheduler.has_pending_requests() or crawler.engine.downloader.active)


class Engine:
    """What the scheduler needs of Scrapy's engine (``inprogress()`` None: unknown; ``take_unstarted``: only
    once closing). This base stands for no engine (tests, tools): nothing in progress, ``close`` recorded."""

    closed: str | None = None

    def inprogress(self) -> Any:
        return ()

    def wake(self) -> None:
        pass

    def close(self, reason: str) -> None:
        self.closed = reason

    def slot_load(self, request: Any) -> int:
        return 0

    def take_unstarted(self, which: Callable[[Any], bool]) -> list[Any]:
        return []


class EngineView(Engine):
    """:class:`Engine` of a real crawler."""

    def __init__(self, crawler: Any) -> None:
        self.crawler = crawler

    def inprogress(self) -> Any:
        return inprogress(self.crawler)

    def wake(self) -> None:
        if (nextcall := getattr(_slot(self.crawler), "nextcall", None)) is not None:
            nextcall.schedule()

    def close(self, reason: str) -> None:
        if (engine := engine_of(self.crawler)) is None or engine.spider is None or is_closing(self.crawler):
            return
        # keep a reference: the loop holds tasks weakly
        self._closing_task = asyncio.get_running_loop().create_task(engine.close_spider_async(reason=reason))

    def slot_load(self, request: Any) -> int:
        if (downloader := getattr(engine_of(self.crawler), "downloader", None)) is None:
            return 0
        slot = downloader.slots.get(downloader.get_slot_key(request))
        return len(slot.active) if slot is not None else 0

    def take_unstarted(self, which: Callable[[Any], bool]) -> list[Any]:
        # taken out of the downloader's slot queues and failed: the engine stops waiting for them
        if not is_closing(self.crawler):
            return []
        slots = getattr(getattr(self.crawler.engine, "downloader", None), "slots", None) or {}
        taken: list[tuple[Any, Any]] = []
        for slot in list(slots.values()):
            queue: Any = getattr(slot, "queue", None)
            for pair in [queue.popleft() for _ in range(len(queue or ()))]:  # kept ones go back in order
                (taken if which(pair[0]) else queue).append(pair)
        for request, dfd in taken:
            dfd.errback(Failure(ReleasedAtClose(f"given back to the queue at close: {request.url}")))
        return [request for request, _ in taken]


def run_components(crawler: Crawler, ds: DistSettings) -> list[Any]:
    """Build what the add-on would enable and the two-line setup lacks (kept: signals hold them weakly)."""
    built: list[Any] = []
    lacking: list[Component] = []
    if engine_of(crawler) is None:  # a scheduler built outside a crawl (tests, tools) runs nothing more
        return built
    for c in COMPONENTS:
        user = crawler.settings.getdict(c.setting)
        if mentions(user, c.path) or (c.replaces and mentions(user, c.replaces)):
            continue  # enabled, or left out on purpose
        if c.attach == "position":
            if not c.when or functools.reduce(getattr, c.when.split("."), ds):
                lacking.append(c)
            continue
        try:
            component = build_from_crawler(load_object(c.path), crawler)
        except NotConfigured:
            continue
        if c.attach == "chain" and not _add_first_downloader_middleware(crawler, component):
            lacking.append(c)
            continue
        built.append(component)
    if lacking:
        logger.warning(
            "scrapy-dist: this crawl runs without the add-on, so without %s; add %s to settings.py for"
            " them (it keeps SCHEDULER and DUPEFILTER_CLASS as they are)",
            "; ".join(f"{c.path.rpartition('.')[2]} ({c.lacks})" for c in lacking), ADDON_LINE)
    return built


def _add_first_downloader_middleware(crawler: Any, mw: Any) -> bool:
    """Put ``mw`` first in the running downloader's middleware chain; False if it cannot be found."""
    manager: Any = getattr(getattr(crawler.engine, "downloader", None), "middleware", None)
    if not isinstance(methods := getattr(manager, "methods", None), dict):
        return False
    for name, first in (("process_request", True), ("process_response", False), ("process_exception", False)):
        if (method := getattr(mw, name, None)) is None:
            continue
        if name not in methods:
            return False
        (methods[name].appendleft if first else methods[name].append)(method)
    manager.middlewares = (mw, *manager.middlewares)
    return True


def feed_exporter(crawler: Crawler) -> Any:
    from scrapy.extensions.feedexport import FeedExporter
    extensions = getattr(getattr(crawler, "extensions", None), "middlewares", ())
    return next((ext for ext in extensions if isinstance(ext, FeedExporter)), None)


def at_risk(feeds: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    """(uri, why) of each feed whose items cannot be on disk before their pages are acknowledged."""
    out = []
    for uri, options in feeds.items():
        scheme = urlparse(uri).scheme  # a Windows drive letter parses as a scheme
        if options.get("postprocessing"):
            out.append((uri, "post-processed (compressed) as it is written, complete only at close"))
        elif scheme not in ("", "file") and len(scheme) != 1 and scheme != "stdout":
            out.append((uri, f"a {scheme}:// storage, which stores the file only at close or per batch"))
    return out


def _fsync_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):  # a file closed meanwhile (a batch rotated) was flushed
            os.fsync(fd)


def install_feed_barrier(crawler: Crawler, loop: SyncLoop) -> bool:
    """Flush and fsync the crawl's local feed files before each acknowledging round; whether it has feeds."""
    if (exporter := feed_exporter(crawler)) is None or not getattr(exporter, "feeds", None):
        return False
    for uri, why in at_risk(exporter.feeds):
        logger.warning(
            "FEEDS %s is %s: a worker killed before the close loses the items of pages already"
            " acknowledged (no other worker fetches them again). For output that survives any kill, use"
            " ITEM_PIPELINES = {'scrapy_dist.pipelines.RedisPipeline': 300} and export with `scrapy-dist"
            " items %s --export FILE` (docs/items.md)", uri, why, getattr(crawler.spider, "name", "SPIDER"))
    loop.ack_barrier = functools.partial(flush_feeds, crawler)
    return True


async def flush_feeds(crawler: Crawler) -> None:
    fds = []
    for slot in getattr(feed_exporter(crawler), "slots", ()):
        if (file := slot.file) is None or getattr(file, "closed", False):
            continue
        file.flush()
        if not slot.feed_options.get("postprocessing"):
            with contextlib.suppress(AttributeError, OSError, ValueError):
                fds.append(file.fileno())
    if fds:
        await asyncio.to_thread(_fsync_all, fds)
        inc_stat(crawler.stats, "feeds/fsyncs")


@dataclass(eq=False)
class ItemOutbox:
    """Encoded items by the request they came from (reactor thread only)."""

    #: whether a request came from a lease (only those are acknowledged, so only their items can ride)
    leased: Callable[[Request], bool] = lambda request: True
    _items: dict[Request, list[bytes | str]] = field(default_factory=dict)

    def stage(self, request: Request, data: bytes | str) -> bool:
        """Keep ``data`` until ``request``'s ack takes it; False for a request of no lease (not kept)."""
        if not self.leased(request):
            return False
        self._items.setdefault(request, []).append(data)
        return True

    def take(self, request: Request) -> list[bytes | str]:
        return self._items.pop(request, [])


def attach(scheduler: Scheduler, route: ItemRoute) -> ItemOutbox | None:
    """Make ``scheduler``'s acks carry the items of their pages to ``route``; the outbox to stage them in, or
    None when the frontier is not open or the items key lives in another cluster hash slot than a shard's."""
    if not scheduler.frontiers:
        return None
    if is_cluster(scheduler.redis):
        slot = key_slot(route.key.encode())
        if any(key_slot(f.keys.queue.encode()) != slot for f in scheduler.frontiers):
            return None
    ledger = scheduler.ledger
    outbox = ItemOutbox(lambda request: request in ledger.handed)
    for frontier in scheduler.frontiers:
        frontier.items = route
    ledger.riders.items_of = outbox.take
    return outbox


def validators_of(headers: Any) -> dict[bytes, bytes]:
    """The conditional request headers a response's ``ETag`` / ``Last-Modified`` allow."""
    out = {}
    for source, target in ((b"ETag", b"If-None-Match"), (b"Last-Modified", b"If-Modified-Since")):
        value = headers.get(source)
        if value and len(value) <= MAX_VALIDATOR_BYTES and all(32 <= c <= 126 for c in value):
            out[target] = bytes(value)
    return out


def with_validators(payload: bytes, validators: Mapping[bytes, bytes], policy: EntryPolicy) -> bytes:
    """``payload`` with its conditional headers replaced by ``validators``, signed again only if it was."""
    signed = policy.verify(payload)
    d = load_payload(payload, policy.max_bytes)
    drop = {h.lower() for h in VALIDATOR_HEADERS}
    headers = [pair for pair in d.get("h", []) if bytes(pair[0]).lower() not in drop]
    headers += [[k, [v]] for k, v in validators.items()]
    if headers:
        d["h"] = headers
    else:
        d.pop("h", None)
    return (policy if signed else DEFAULT_POLICY).seal(msgpack.packb(d, use_bin_type=True))


def _middleware_enabled(settings: Any) -> bool:
    for path, order in settings.getwithbase("DOWNLOADER_MIDDLEWARES").items():
        try:
            cls = load_object(path) if isinstance(path, str) else path
        except (ImportError, ValueError, NameError, AttributeError):
            continue
        if order is not None and getattr(cls, "turns_304_into_not_modified", False):
            return True
    return False


@dataclass(eq=False)
class Revisits:
    """Whether and when a finished request is fetched again: a chain goes on while each fetch succeeds
    (below 400, or a conditional revisit's 304) and its callback neither raises nor sets ``revisit_after =
    None``. A scheduled revisit waits in a shard's delayed set (meta ``"<score> r"``)."""

    rules: RevisitRules = field(default_factory=RevisitRules)
    conditional: bool = False
    polite: bool = False
    policy: EntryPolicy | None = None
    stats: Any = None
    min_interval: float = 0.0
    stopped: bool = False  # the crawl was closed: no chain goes on
    outcome: dict[Any, bool] = field(default_factory=dict)  # False: the callback raised, the chain stops
    validators: dict[Any, dict[bytes, bytes]] = field(default_factory=dict)  # to carry into the revisit
    _log: RateLimitedLog = field(default_factory=lambda: RateLimitedLog.once(logger))

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        cfg = DistSettings.for_crawler(crawler).scheduler
        o = cls(RevisitRules(cfg.revisit_after), cfg.revisit_conditional, cfg.politeness == "cluster",
                entry_policy(crawler), crawler.stats, cfg.revisit_min_interval)
        crawler.signals.connect(o.response_received, signal=signals.response_received)
        crawler.signals.connect(o.spider_error, signal=signals.spider_error)
        if o.conditional and not _middleware_enabled(crawler.settings):
            logger.warning("REVISIT_CONDITIONAL is on but %s is not in DOWNLOADER_MIDDLEWARES: the 304"
                           " answers of revisits reach HttpErrorMiddleware instead of counting as unchanged"
                           " pages. Enable the add-on (ADDONS = {'scrapy_dist.Addon': 0}) or add the"
                           " middleware at 580", "scrapy_dist.middlewares.ConditionalRevisitMiddleware")
        return o

    def _refiled(self, policy: EntryPolicy, member: bytes, validators: dict[bytes, bytes] | None) -> bytes:
        """The member a revisit files (b"": ``member``), with a new nonce: not taken for the acked entry."""
        with contextlib.suppress(Exception):  # a member we cannot patch is revisited as it is
            prefix = member_prefix(member, self.polite)
            payload = member[len(prefix) :]
            patched = (with_validators(payload, validators, policy)
                       if self.conditional and validators is not None else policy.renew(payload))
            if patched != payload and len(patched) <= policy.max_bytes:
                return prefix + patched
        return b""

    def response_received(self, response: Any, request: Request, spider: Any = None) -> None:
        if response.status < 400 and self.wanted(request):
            self.outcome.setdefault(request, True)
            if self.conditional and response.status != 304:
                self.validators[request] = validators_of(response.headers)

    def spider_error(self, failure: Any, response: Any, spider: Any = None) -> None:
        if (request := getattr(response, "request", None)) is not None and request in self.outcome:
            self.outcome[request] = False

    def not_modified(self, request: Request) -> None:
        """A conditional revisit answered 304 (the middleware): the page counts as fetched, unchanged."""
        if self.wanted(request):
            self.outcome[request] = True

    def delay_for(self, request: Request) -> float | None:
        """``meta["revisit_after"]`` if set, else the most specific ``REVISIT_AFTER`` rule (None: none)."""
        if META_KEY in request.meta:
            try:
                seconds = check_seconds(request.meta[META_KEY])
            except ValueError as exc:
                inc_stat(self.stats, "revisit/invalid")
                self._log.log(logging.WARNING, "meta['revisit_after'] of %s: %s; not revisited (logged once)",
                              request, exc)
                return None
            if seconds is not None and seconds < self.min_interval:
                inc_stat(self.stats, "revisit/raised")
                return self.min_interval
            return seconds
        seconds = self.rules.for_url(request.url, urlparse_cached(request).hostname or "")
        return None if seconds is NOT_SET else seconds

    def stop(self) -> None:
        """End every chain this worker would go on with (``scrapy-dist close``)."""
        self.stopped = True

    def wanted(self, request: Request) -> bool:
        return META_KEY in request.meta or bool(self.rules)

    def plan(self, request: Request, lease: tuple[int, bytes]) -> tuple[float, bytes] | None:
        """When ``request`` is finished: ``(delay, new member or b"")`` to file it again, or None."""
        ok = self.outcome.pop(request, None) and not self.stopped  # None: not fetched, or not wanted
        validators = self.validators.pop(request, None)
        if (delay := self.delay_for(request) if ok else None) is None:
            if ok is False or (ok and META_KEY in request.meta):
                inc_stat(self.stats, "revisit/stopped")
            return None
        new, policy = b"", self.policy
        if policy is not None and (policy.secret is not None or validators is not None):
            new = self._refiled(policy, lease_member(lease[1]), validators)
        inc_stat(self.stats, "revisit/scheduled")
        return delay, new

