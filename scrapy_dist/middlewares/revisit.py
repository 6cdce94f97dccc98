"""Conditional revisits (``REVISIT_CONDITIONAL = True``): a 304 Not Modified ends the fetch quietly.

A revisit entry carries its page's validators as ``If-None-Match`` / ``If-Modified-Since`` headers
(written into the entry at ack time by :class:`scrapy_dist.frontier.revisit.Revisits`), so the request is already
conditional when it is leased. This downloader middleware handles the answer:

* **304** to a request that sent a validator: counted (``revisit/not_modified``), the page counts as
  fetched unchanged (the revisit chain goes on, with the same validators), the spider's
  ``on_not_modified(response)`` is called if it defines one, and the request ends with
  :class:`NotModified` (an ``IgnoreRequest``): the callback is not called, nothing is logged as an error,
  Scrapy's ``HttpErrorMiddleware`` never sees the 304. A request with an ``errback`` gets the failure
  there (``failure.check(NotModified)``).
* anything else goes on as usual; a 200 brings new validators for the next revisit.

Order 580: closer to the engine than the downloader's own middlewares (compression, redirects look at a
304 as nothing of theirs). Scrapy's ``HttpCacheMiddleware`` answers its own 304s from its cache: do not
combine the two for the same requests.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from scrapy.exceptions import IgnoreRequest, NotConfigured

from scrapy_dist.frontier.revisit import VALIDATOR_HEADERS
from scrapy_dist.settings import DistSettings
from scrapy_dist.settings.refusal import refusing

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.crawler import Crawler
    from scrapy.http import Response
    from typing_extensions import Self

logger = logging.getLogger(__name__)


class NotModified(IgnoreRequest):
    """A conditional revisit was answered 304 Not Modified: the page did not change."""


class ConditionalRevisitMiddleware:
    """Downloader middleware of ``REVISIT_CONDITIONAL`` (see the module docstring); the add-on enables
    it. Disabled (``NotConfigured``) without ``REVISIT_CONDITIONAL``."""

    def __init__(self, crawler: Crawler) -> None:
        self.crawler = crawler
        self.stats = crawler.stats

    @classmethod
    @refusing
    def from_crawler(cls, crawler: Crawler) -> Self:
        if not DistSettings.for_crawler(crawler).scheduler.revisit_conditional:
            raise NotConfigured  # no message: Scrapy would log it as a WARNING in every crawl
        return cls(crawler)

    @staticmethod
    def conditional(request: Request) -> bool:
        return any(request.headers.get(h) for h in VALIDATOR_HEADERS)

    def process_request(self, request: Request) -> None:
        if self.conditional(request) and self.stats is not None:
            self.stats.inc_value("revisit/conditional")

    def process_response(self, request: Request, response: Response) -> Response:
        if response.status != 304 or not self.conditional(request):
            return response
        if self.stats is not None:
            self.stats.inc_value("revisit/not_modified")
        from scrapy_dist.frontier.scheduler import get_scheduler

        sched = get_scheduler(self.crawler)
        if sched is not None and sched.revisits is not None:
            sched.revisits.not_modified(request)
        hook = getattr(self.crawler.spider, "on_not_modified", None)
        if callable(hook):
            try:
                hook(response)
            except Exception:
                logger.exception("on_not_modified(%s) raised", response)
        raise NotModified(f"304 Not Modified: {request.url}")

    def process_exception(self, request: Request, exception: BaseException) -> Any:
        return None
