"""What the frontier takes from Scrapy's running crawler: its engine, its settings (``from_crawler``
wiring), and the durability of its item output.

**Engine access**: the one place that reads ``engine._slot`` (a Scrapy upgrade that moves it is a one-file
fix): the requests in progress (a request leaves ``inprogress`` only once its callback's output reached
the scheduler: then it may be acknowledged), waking the engine, the running scheduler, the downloader's
middleware chain and its slot queues. The scheduler takes an :class:`Engine`: :class:`EngineView` of a
real crawler, or :class:`DetachedEngine` for one driven without an engine (tests, tools).

**Wiring**: :func:`build` is ``Scheduler.from_crawler``: the scheduler's ``__init__`` takes plain objects,
read here from the crawler; a refused setting refuses the crawl's start (:mod:`scrapy_dist.settings.reader`).
:func:`run_components` gives the two-line setup (no add-on) what the add-on would enable.

**Item output**: :class:`ItemOutbox` holds the items ``RedisPipeline`` writes until their page's ack,
which carries them in the same ``sync`` call (lua/sync_items.lua); :class:`FeedBarrier` flushes and fsyncs
local feed files before a round acknowledges their pages. Storages that store only at close (S3, FTP,
post-processed files) cannot be made durable before an ack: one WARNING at start names each.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from urllib.parse import urlparse

from redis.crc import key_slot
from scrapy import signals
from scrapy.dupefilters import BaseDupeFilter
from scrapy.exceptions import NotConfigured
from scrapy.utils.misc import build_from_crawler, load_object
from twisted.python.failure import Failure

from scrapy_dist.egress import enforce
from scrapy_dist.exceptions import ReleasedAtClose, ScrapyDistError
from scrapy_dist.frontier import orders
from scrapy_dist.frontier.orders import DomainLimits
from scrapy_dist.frontier.revisit import Revisits
from scrapy_dist.redis.connection import is_cluster
from scrapy_dist.redis.keys import CrawlKeys, crawler_keys
from scrapy_dist.redis.outage import Outage
from scrapy_dist.settings import DistSettings
from scrapy_dist.settings.reader import ADDON_LINE, COMPONENTS, Component, mentions, refuse_start, start_error
from scrapy_dist.wire.codec import entry_policy

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.crawler import Crawler

    from scrapy_dist.frontier.scheduler import Scheduler
    from scrapy_dist.frontier.shard import ItemRoute
    from scrapy_dist.frontier.syncloop import SyncLoop

logger = logging.getLogger(__name__)
S = TypeVar("S", bound="Scheduler")


def _slot(crawler: Any) -> Any:
    try:
        engine = crawler.engine
    except (AttributeError, RuntimeError):  # Crawler.engine raises until the crawl starts
        return None
    return getattr(engine, "_slot", None)


def inprogress(crawler: Any) -> Any:
    """The engine's set of requests in progress, or ``None`` if it cannot be found."""
    return getattr(_slot(crawler), "inprogress", None)


def wake(crawler: Any) -> None:
    """Ask the engine to call ``next_request`` soon."""
    nextcall = getattr(_slot(crawler), "nextcall", None)
    if nextcall is not None:
        nextcall.schedule()


def scheduler(crawler: Any) -> Any:
    """The engine's scheduler object, or ``None`` before the crawl starts."""
    return getattr(_slot(crawler), "scheduler", None)


def is_closing(crawler: Any) -> bool:
    """Whether the engine has started closing the spider."""
    slot = _slot(crawler)
    return slot is not None and getattr(slot, "closing", None) is not None


def take_unstarted(crawler: Any, which: Callable[[Any], bool]) -> list[Any]:
    """Once the engine is closing: the requests ``which`` accepts that wait in the downloader's slot queues
    (not started), taken out and failed with :class:`ReleasedAtClose`, so the engine stops waiting for
    them; ``[]`` before."""
    if not is_closing(crawler):
        return []
    slots = getattr(getattr(crawler.engine, "downloader", None), "slots", None) or {}
    taken = []
    for slot in list(slots.values()):
        queue = getattr(slot, "queue", None)
        if not queue:
            continue
        kept = []
        while queue:
            request, dfd = queue.popleft()
            if which(request):
                taken.append((request, dfd))
            else:
                kept.append((request, dfd))
        queue.extend(kept)
    for request, dfd in taken:
        dfd.errback(Failure(ReleasedAtClose(f"given back to the queue at close: {request.url}")))
    return [request for request, _ in taken]


def add_first_downloader_middleware(crawler: Any, mw: Any) -> bool:
    """Put ``mw`` first in the running downloader's middleware chain (its ``process_request`` before every
    other one's, its ``process_response`` / ``process_exception`` last); False if the chain cannot be
    found (nothing was changed)."""
    try:
        engine = crawler.engine
    except (AttributeError, RuntimeError):  # Crawler.engine raises until the crawl starts
        return False
    manager = getattr(getattr(engine, "downloader", None), "middleware", None)
    methods = getattr(manager, "methods", None)
    if manager is None or not isinstance(methods, dict):
        return False
    for name, first in (("process_request", True), ("process_response", False),
                        ("process_exception", False)):
        method = getattr(mw, name, None)
        if method is None:
            continue
        if name not in methods:
            return False
        if first:
            methods[name].appendleft(method)
        else:
            methods[name].append(method)
    manager.middlewares = (mw, *manager.middlewares)
    return True


def locally_idle(crawler: Any) -> bool:
    """Whether the engine's own scheduler has nothing pending and its downloader nothing active."""
    slot = _slot(crawler)
    if slot is None:
        return True
    return not slot.scheduler.has_pending_requests() and not crawler.engine.downloader.active


class Engine(Protocol):
    """What the scheduler needs of the engine."""

    def inprogress(self) -> Any:
        """Requests the engine still works on (a container), or ``None`` when that cannot be known."""

    def wake(self) -> None:
        """Make the engine ask for requests soon."""

    def close(self, reason: str) -> None:
        """Close the spider (the scheduler cannot go on)."""

    def slot_load(self, request: Any) -> int:
        """Requests the downloader is fetching in the download slot ``request`` would use."""

    def take_unstarted(self, which: Callable[[Any], bool]) -> list[Any]:
        """Once the engine closes, the requests ``which`` accepts that have not started downloading, taken
        back (the engine no longer waits for them); ``[]`` before."""


class EngineView:
    """:class:`Engine` of a real crawler."""

    def __init__(self, crawler: Any) -> None:
        self.crawler = crawler

    def inprogress(self) -> Any:
        return inprogress(self.crawler)

    def wake(self) -> None:
        wake(self.crawler)

    def close(self, reason: str) -> None:
        engine = getattr(self.crawler, "engine", None)
        if engine is None or engine.spider is None or is_closing(self.crawler):
            return
        task = asyncio.get_running_loop().create_task(engine.close_spider_async(reason=reason))
        # keep a reference: the loop holds tasks weakly
        self._closing_task = task

    def slot_load(self, request: Any) -> int:
        # Downloader.get_slot_key and Downloader.slots are public
        try:
            downloader = self.crawler.engine.downloader
        except (AttributeError, RuntimeError):  # Crawler.engine raises until the crawl starts
            return 0
        if downloader is None:
            return 0
        slot = downloader.slots.get(downloader.get_slot_key(request))
        return len(slot.active) if slot is not None else 0

    def take_unstarted(self, which: Callable[[Any], bool]) -> list[Any]:
        return take_unstarted(self.crawler, which)


class DetachedEngine:
    """:class:`Engine` for a scheduler driven without Scrapy's engine: nothing is ever in progress (a
    request handed out is finished at the next round), waking is a no-op, ``close`` is recorded."""

    def __init__(self) -> None:
        self.closed: str | None = None

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


# -- wiring from a crawler -----------------------------------------------------------------------
def build(cls: type[S], crawler: Crawler) -> S:
    """A ``cls`` scheduler wired from ``crawler``; if the crawl's start is (or gets) refused, one that opens
    nothing while the crawl stops."""
    if start_error(crawler) is None:
        try:
            sched = _wired(cls, crawler)
        except ScrapyDistError as exc:
            refuse_start(crawler, exc)
        else:
            if start_error(crawler) is None:  # the dupefilter may have refused it
                return sched
    sched = cls(BaseDupeFilter(), None, crawler=crawler)
    sched.refused = True
    return sched


def _wired(cls: type[S], crawler: Crawler) -> S:
    ds = DistSettings.for_crawler(crawler)
    cfg = ds.scheduler
    dupefilter = build_from_crawler(load_object(crawler.settings["DUPEFILTER_CLASS"]), crawler)
    qcls: Any = orders.ALIASES.get(cfg.queue_class) or load_object(cfg.queue_class)
    try:
        keys: CrawlKeys | None = crawler_keys(crawler)
    except ValueError:  # no spider name yet (a harness that builds the scheduler first): at open()
        keys = None
    sched = cls(
        dupefilter,
        keys,
        ds,
        crawler=crawler,
        config=cfg,
        order=qcls(),
        stats=crawler.stats,
        engine=EngineView(crawler),
        outage=Outage.for_crawler(crawler),
        domain_limits=DomainLimits.from_dist(ds) if cfg.politeness == "cluster" else None,
        policy=entry_policy(crawler),
    )
    sched.revisits = Revisits.from_crawler(crawler)
    sched.revisits.policy = sched.policy if keys is not None else None
    sched.ledger.riders.revisit_of = sched.revisits.plan
    sched.encoder.forget_dead = ds.dupefilter.forget_dead
    sched.networks = enforce(crawler, cfg.deny_networks)  # holds without the add-on too
    sched.encoder.record_start = sched._batched_df and ds.seeds.record_fingerprint
    if cfg.politeness == "cluster":
        crawler.signals.connect(sched.penalties.response_received, signal=signals.response_received)
    sched.components = run_components(crawler, ds)
    return sched


def run_components(crawler: Crawler, ds: DistSettings) -> list[Any]:
    """Build what the add-on would enable and the project's settings lack (see the module docstring);
    returns the components built (kept by the scheduler: signals hold their handlers weakly)."""
    built: list[Any] = []
    lacking: list[Component] = []
    try:
        crawler.engine  # noqa: B018 - a scheduler built outside a crawl (tests, tools) runs nothing more
    except (AttributeError, RuntimeError):
        return built
    for c in COMPONENTS:
        user = crawler.settings.getdict(c.setting)
        if mentions(user, c.path) or (c.replaces and mentions(user, c.replaces)):
            continue  # enabled, or left out on purpose
        if c.attach == "position":
            if not c.when or _attr(ds, c.when):
                lacking.append(c)
            continue
        try:
            component = build_from_crawler(load_object(c.path), crawler)
        except NotConfigured:
            continue
        if c.attach == "chain" and not add_first_downloader_middleware(crawler, component):
            lacking.append(c)
            continue
        built.append(component)
    if lacking:
        logger.warning(
            "scrapy-dist: this crawl runs without the add-on, so without %s; add %s to settings.py for"
            " them (it keeps SCHEDULER and DUPEFILTER_CLASS as they are)",
            "; ".join(f"{c.path.rpartition('.')[2]} ({c.lacks})" for c in lacking), ADDON_LINE,
        )
    return built


def _attr(obj: Any, path: str) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


# -- item output durable before its page's ack ------------------------------------------------------
#: URI schemes whose file this barrier can flush and fsync (a Windows drive letter parses as a scheme)
LOCAL_SCHEMES = frozenset(("", "file"))


def feed_exporter(crawler: Crawler) -> Any:
    """Scrapy's running FeedExporter extension, or None."""
    from scrapy.extensions.feedexport import FeedExporter

    manager = getattr(crawler, "extensions", None)
    for ext in getattr(manager, "middlewares", ()):
        if isinstance(ext, FeedExporter):
            return ext
    return None


def at_risk(feeds: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    """(uri, why) of each feed whose items cannot be on disk before their pages are acknowledged."""
    out = []
    for uri, options in feeds.items():
        scheme = urlparse(uri).scheme
        if options.get("postprocessing"):
            out.append((uri, "post-processed (compressed) as it is written, complete only at close"))
        elif scheme not in LOCAL_SCHEMES and len(scheme) != 1 and scheme != "stdout":
            out.append((uri, f"a {scheme}:// storage, which stores the file only at close or per batch"))
    return out


def _fsync_all(fds: list[int]) -> None:
    for fd in fds:
        # a file closed meanwhile (a batch rotated) was flushed by its close
        with contextlib.suppress(OSError):
            os.fsync(fd)


class FeedBarrier:
    """Flush and fsync the crawl's local feed files before each acknowledging round."""

    def __init__(self, crawler: Crawler) -> None:
        self.crawler = crawler
        self.stats = crawler.stats

    @classmethod
    def install(cls, crawler: Crawler, loop: SyncLoop) -> FeedBarrier | None:
        """Put a barrier on ``loop`` when the crawl exports feeds; warn about those at risk."""
        exporter = feed_exporter(crawler)
        if exporter is None or not getattr(exporter, "feeds", None):
            return None
        for uri, why in at_risk(exporter.feeds):
            logger.warning(
                "FEEDS %s is %s: a worker killed before the close loses the items of pages already"
                " acknowledged (no other worker fetches them again). For output that survives any kill, use"
                " ITEM_PIPELINES = {'scrapy_dist.pipelines.RedisPipeline': 300} and export with"
                " `scrapy-dist items %s --export FILE` (docs/items.md)",
                uri, why, getattr(crawler.spider, "name", "SPIDER"),
            )
        barrier = cls(crawler)
        loop.ack_barriers.append(barrier)
        return barrier

    async def __call__(self) -> None:
        exporter = feed_exporter(self.crawler)
        fds = []
        for slot in getattr(exporter, "slots", ()):
            file = slot.file
            if file is None or getattr(file, "closed", False):
                continue
            file.flush()
            if slot.feed_options.get("postprocessing"):
                continue
            with contextlib.suppress(AttributeError, OSError, ValueError):
                fds.append(file.fileno())
        if fds:
            await asyncio.to_thread(_fsync_all, fds)
            if self.stats is not None:
                self.stats.inc_value("feeds/fsyncs")


class ItemOutbox:
    """Encoded items by the request they came from (reactor thread only)."""

    def __init__(self, leased: Callable[[Request], bool] = lambda request: True) -> None:
        self._items: dict[Request, list[bytes | str]] = {}
        #: whether a request came from a lease (only those are acknowledged, so only their items can ride)
        self.leased = leased
        #: items staged since the start
        self.staged = 0

    def stage(self, request: Request, data: bytes | str) -> bool:
        """Keep ``data`` until ``request``'s ack takes it; False (nothing kept) for a request of no lease
        (one crawled by this worker only): its items must be written otherwise."""
        if not self.leased(request):
            return False
        self._items.setdefault(request, []).append(data)
        self.staged += 1
        return True

    def take(self, request: Request) -> list[bytes | str]:
        """The items ``request`` produced (once; ``[]`` for none)."""
        return self._items.pop(request, [])

    def clear(self) -> int:
        """Forget every staged item (their requests were not acknowledged: they are crawled again);
        returns how many."""
        n = sum(len(v) for v in self._items.values())
        self._items.clear()
        return n

    def __len__(self) -> int:
        return sum(len(v) for v in self._items.values())


def attach(scheduler: Scheduler, route: ItemRoute) -> ItemOutbox | None:
    """Make ``scheduler``'s acks carry the items of their pages to ``route``; the outbox to stage them in,
    or None when they cannot ride the acks: the frontier is not open, or Redis is a cluster and the items
    key lives in another hash slot than a shard's keys (a script touches one slot: on a cluster, items ride
    the acks only with one shard and an items key carrying the crawl's hash tag, ``{spider}:items``)."""
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
    scheduler.ledger.riders.items_of = outbox.take
    return outbox
