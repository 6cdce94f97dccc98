"""Conditional revisits (``REVISIT_CONDITIONAL = True``): a 304 Not Modified ends the fetch quietly
(docs/continuous.md, "Conditional revisits").

A revisit entry already carries its page's validators (written at ack time by
:class:`scrapy_dist.frontier.revisit.Revisits`). A 304 to a request that sent one is counted, keeps the
revisit chain going, calls the spider's ``on_not_modified(response)`` if it has one, and ends the request
with :class:`NotModified` (an ``IgnoreRequest``: no callback, no error, an errback may check for it).
Order 580, so the downloader's own middlewares never see the 304 as theirs.
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

    #: what the frontier's revisits look for in DOWNLOADER_MIDDLEWARES (it does not import this layer)
    turns_304_into_not_modified = True

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
