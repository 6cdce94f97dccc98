"""What a crawler gives the scheduler: its settings, dupefilter, queue order, revisits and signals.

:func:`build` is :meth:`Scheduler.from_crawler <scrapy_dist.frontier.scheduler.Scheduler.from_crawler>`:
the scheduler's ``__init__`` takes plain objects, this module reads them from the crawler. A setting
refused on the way (the scheduler's own, the dupefilter's, ...) refuses the crawl's start
(:mod:`scrapy_dist.settings.refusal`), and the scheduler built then opens nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from scrapy import signals
from scrapy.dupefilters import BaseDupeFilter
from scrapy.utils.misc import build_from_crawler, load_object

from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.frontier import engine as _engine
from scrapy_dist.frontier import orders
from scrapy_dist.frontier.politeness import DomainLimits
from scrapy_dist.frontier.revisit import Revisits
from scrapy_dist.redis.keys import CrawlKeys, crawler_keys
from scrapy_dist.redis.outage import Outage
from scrapy_dist.settings import DistSettings
from scrapy_dist.settings.refusal import refuse_start, start_error
from scrapy_dist.wire.codec import entry_policy

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

    from scrapy_dist.frontier.scheduler import Scheduler

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
    sched.ledger.revisit_of = sched.revisits.plan
    sched.forget_dead = ds.dupefilter.forget_dead
    if cfg.politeness == "cluster":
        crawler.signals.connect(sched.response_received, signal=signals.response_received)
    return sched
