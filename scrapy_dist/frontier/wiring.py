"""What a crawler gives the scheduler: its settings, dupefilter, queue order, revisits and signals, and
what the scheduler runs for it when the project has no add-on.

:func:`build` is :meth:`Scheduler.from_crawler <scrapy_dist.frontier.scheduler.Scheduler.from_crawler>`:
the scheduler's ``__init__`` takes plain objects, this module reads them from the crawler. A setting
refused on the way (the scheduler's own, the dupefilter's, ...) refuses the crawl's start
(:mod:`scrapy_dist.settings.reader`), and the scheduler built then opens nothing.

:func:`run_components` gives the two-line setup (``SCHEDULER`` and ``DUPEFILTER_CLASS`` without the
add-on) what the add-on would enable (:mod:`scrapy_dist.settings.reader`): the extensions are built and
connected to the crawler's signals here, the networks check is put into the running downloader's chain,
and what needs a place among Scrapy's middlewares is named in one WARNING with the add-on's line.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, TypeVar

from scrapy import signals
from scrapy.dupefilters import BaseDupeFilter
from scrapy.exceptions import NotConfigured
from scrapy.utils.misc import build_from_crawler, load_object

from scrapy_dist.egress import enforce
from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.frontier import engine as _engine
from scrapy_dist.frontier import orders
from scrapy_dist.frontier.politeness import DomainLimits
from scrapy_dist.frontier.revisit import Revisits
from scrapy_dist.redis.keys import CrawlKeys, crawler_keys
from scrapy_dist.redis.outage import Outage
from scrapy_dist.settings import DistSettings
from scrapy_dist.settings.reader import ADDON_LINE, COMPONENTS, Component, mentions, refuse_start, start_error
from scrapy_dist.wire.codec import entry_policy

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

    from scrapy_dist.frontier.scheduler import Scheduler

logger = logging.getLogger(__name__)
S = TypeVar("S", bound="Scheduler")


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
        engine=_engine.EngineView(crawler),
        outage=Outage.for_crawler(crawler),
        domain_limits=DomainLimits.from_dist(ds) if cfg.politeness == "cluster" else None,
        policy=entry_policy(crawler),
    )
    sched.revisits = Revisits.from_crawler(crawler)
    sched.revisits.policy = sched.policy if keys is not None else None
    sched.ledger.revisit_of = sched.revisits.plan
    sched.forget_dead = ds.dupefilter.forget_dead
    sched.networks = enforce(crawler, cfg.deny_networks)  # SCHEDULER_DENY_NETWORKS holds without the add-on too
    sched.record_start = sched._batched_df and ds.seeds.record_fingerprint
    if cfg.politeness == "cluster":
        crawler.signals.connect(sched.response_received, signal=signals.response_received)
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
        if c.attach == "chain" and not _engine.add_first_downloader_middleware(crawler, component):
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
