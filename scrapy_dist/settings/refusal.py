"""A crawl that cannot start (a bad setting, Redis not answering): one ERROR line, a clean stop, and a
failed start as Scrapy counts it.

The mechanism, found by experiment with Scrapy 2.19 (``scrapy crawl``, ``CrawlerProcess``,
``AsyncCrawlerProcess``, ``CrawlerRunner``):

* an exception raised by a component while the crawl starts either makes Scrapy's clean-up of the
  half-opened engine log its own tracebacks ("Engine slot not assigned"), or leaves the crawl's task or
  Deferred failed (asyncio's "Task exception was never retrieved", Twisted's "Unhandled error in
  Deferred"), and a ``SystemExit`` ends the process of an application that embeds Scrapy;
* a ``CloseSpider`` raised by a ``spider_opened`` handler is the one exit Scrapy's engine takes cleanly
  at start: every component opened so far is closed, the crawl's Deferred or task succeeds;
* every Scrapy runner sets ``bootstrap_failed`` when the crawler has no spider once the crawl is over,
  and ``scrapy crawl`` then exits with status 1.

So :func:`refuse_start` logs the error as one line, connects a ``spider_opened`` handler raising
``CloseSpider(REASON)`` and a ``spider_closed`` handler that clears ``crawler.spider``. Components call
it instead of raising, and then stay inert: an extension, middleware or pipeline raises a bare
``NotConfigured`` (Scrapy disables it without a word; :func:`refusing` does both), the scheduler opens
nothing. A script sees ``bootstrap_failed`` on its runner and the error in :func:`start_error`.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, TypeVar

from scrapy import signals
from scrapy.exceptions import CloseSpider, NotConfigured

from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.settings.reader import COMPONENT_SETTINGS, check_components
from scrapy_dist.settings.values import SettingsError

if TYPE_CHECKING:
    from collections.abc import Callable

    from scrapy.crawler import Crawler

logger = logging.getLogger(__name__)

#: The close reason (``finish_reason``) of a crawl refused at start.
REASON = "scrapy_dist_refused"
_ATTR = "_scrapy_dist_start_error"
F = TypeVar("F", bound="Callable[..., Any]")


def start_error(crawler: Any) -> ScrapyDistError | None:
    """The error that stopped ``crawler`` at start (the first one), or None."""
    return getattr(crawler, _ATTR, None)


def refuse_start(crawler: Crawler, error: ScrapyDistError) -> None:
    """Log ``error`` as one ERROR line and stop the crawl cleanly once it is open (see the module
    docstring); ``scrapy crawl`` then exits with status 1. Only the first error of a crawler is logged:
    later ones are its consequences."""
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
    """Decorate an extension's, middleware's or pipeline's ``from_crawler``: a :class:`ScrapyDistError`
    it raises refuses the crawl's start and disables the component; a crawl already refused does not
    build it (so nothing of it touches Redis)."""

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
    """Refuse the start if ``SCHEDULER``, ``DUPEFILTER_CLASS`` or ``STATS_CLASS`` names a scrapy-dist class
    that does not exist, and put Scrapy's default in its place, so that Scrapy does not fail with a
    traceback loading it before the crawl can stop. Settings must not be frozen yet (an add-on, a
    spider's ``from_crawler``)."""
    from scrapy.settings import default_settings

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
