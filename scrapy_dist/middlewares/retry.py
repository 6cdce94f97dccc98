"""Retries delayed in the shared frontier, and final failures kept as dead letters (docs/retries.md)."""

from __future__ import annotations

import logging
import random
import time
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from scrapy import signals
from scrapy.downloadermiddlewares.retry import RetryMiddleware as ScrapyRetryMiddleware
from scrapy.downloadermiddlewares.retry import get_retry_request
from scrapy.exceptions import IgnoreRequest
from scrapy.http import Response
from scrapy.spidermiddlewares.httperror import HttpError
from scrapy.spidermiddlewares.httperror import HttpErrorMiddleware as ScrapyHttpErrorMiddleware
from scrapy.utils.python import global_object_name
from scrapy.utils.response import response_status_message

from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.frontier.orders import dead_letter_record, retry_delay
from scrapy_dist.frontier.scheduler import get_scheduler
from scrapy_dist.settings import DistSettings
from scrapy_dist.settings.reader import refusing
from scrapy_dist.utils import RateLimitedLog
from scrapy_dist.wire.entrypolicy import as_scheduled

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.crawler import Crawler
    from twisted.python.failure import Failure
    from typing_extensions import Self

    from scrapy_dist.settings import RetrySettings

logger = logging.getLogger(__name__)

#: requests already dead-lettered by this process (the same failure can be seen by several hooks)
_dead_lettered: weakref.WeakSet[Request] = weakref.WeakSet()


class RetryScheduled(IgnoreRequest, ScrapyDistError):
    """Ends an attempt whose retry waits in the frontier's delayed set (not logged, not dead-lettered)."""


def exception_reason(exc: BaseException | type[BaseException]) -> str:
    """The dead-letter / stats reason of an exception: its class's import path, as Scrapy's retry stats."""
    return global_object_name(exc if isinstance(exc, type) else type(exc))


class DeadLetterWriter:
    """Appends dead-letter records through the crawler's scheduler (they ride the failed request's ack)."""

    def __init__(self, crawler: Crawler) -> None:
        self.crawler = crawler
        self.scheduler_of: Callable[[], Any] = lambda: get_scheduler(crawler)  #: our scheduler, or None
        self._no_frontier_log = RateLimitedLog.once(logger)

    def write(self, request: Request, reason: str, *, status: int | None = None, detail: str = "",
              attempts: int | None = None) -> bool:
        """Dead-letter ``request``; ``False`` if it already was, or if there is no frontier to keep it."""
        if request in _dead_lettered:
            return False
        if (scheduler := self.scheduler_of()) is None:
            self._no_frontier_log.log(logging.WARNING, "Not recording %s as a dead letter (%s): dead letters"
                                                       " need SCHEDULER = 'scrapy_dist.scheduler.Scheduler'."
                                                       " Further ones are not reported.", request, reason)
            return False
        record = dead_letter_record(request, reason=reason, worker=scheduler.worker_id,
                                    spider=self.crawler.spider, status=status, detail=detail,
                                    attempts=attempts, policy=scheduler.dead_policy)
        scheduler.dead_letter(record, request)
        _dead_lettered.add(request)
        assert self.crawler.stats is not None
        self.crawler.stats.inc_value("deadletter/count")
        self.crawler.stats.inc_value(f"deadletter/reason_count/{reason}")
        logger.debug("Dead-lettered %(request)s: %(reason)s", {"request": request, "reason": reason})
        return True


class RetryMiddleware(ScrapyRetryMiddleware):
    """Drop-in for Scrapy's ``RetryMiddleware`` (docs/retries.md): the retry waits in ``{spider}:delayed``
    and the attempt ends with :class:`RetryScheduled`, its errback removed, so an errback only sees the final
    failure, which is dead-lettered. Without the scrapy-dist scheduler it retries like Scrapy's."""

    retries: RetrySettings
    dead_letters: DeadLetterWriter
    clock: Callable[[], float]
    rng: Callable[[], float]

    @classmethod
    @refusing
    def from_crawler(cls, crawler: Crawler) -> Self:
        o = super().from_crawler(crawler)  # Scrapy's own RETRY_* settings, read by Scrapy's RetryMiddleware
        o.retries, o.dead_letters = DistSettings.for_crawler(crawler).retries, DeadLetterWriter(crawler)
        o.clock, o.rng = time.time, random.random
        crawler.signals.connect(o.spider_error, signal=signals.spider_error)
        return o

    # no ``spider`` parameter: Scrapy 2.19 deprecates it
    def process_response(self, request: Request,  # type: ignore[override]
                         response: Response) -> Request | Response:
        if request.meta.get("dont_retry", False) or response.status not in self.retry_http_codes:
            return response
        return self._retry(request, response_status_message(response.status),
                           dead_reason=str(response.status), status=response.status,
                           retry_after=response.headers.get(b"Retry-After")) or response

    def process_exception(self, request: Request,  # type: ignore[override]
                          exception: Exception) -> Request | Response | None:
        reason, detail = exception_reason(exception), str(exception)
        if isinstance(exception, IgnoreRequest):
            # raised by a downloader middleware's process_request (robots.txt, offsite, ...)
            if self.retries.deadletter_ignored and not isinstance(exception, RetryScheduled):
                self.dead_letters.write(request, reason, detail=detail)
            return None
        if isinstance(exception, self.exceptions_to_retry) and not request.meta.get("dont_retry", False):
            return self._retry(request, exception, dead_reason=reason, detail=detail)
        self.dead_letters.write(request, reason, detail=detail)  # a failure that is not retried is final
        return None

    def spider_error(self, failure: Failure, response: Response | Failure, spider: Any = None) -> None:
        """A callback or errback raised: the request failed for good (nothing retries those)."""
        request = getattr(response, "request", None)  # an errback raised: Scrapy sets it on the failure
        status = response.status if isinstance(response, Response) else None
        if request is not None:
            self.dead_letters.write(request, exception_reason(failure.value), status=status,
                                    detail=str(failure.value))

    def _retry(self, request: Request, reason: str | Exception, *, dead_reason: str,  # type: ignore[override]
               status: int | None = None, retry_after: bytes | None = None, detail: str = ""
               ) -> Request | None:
        """An immediate retry, ``None`` (exhausted: dead-lettered), or :class:`RetryScheduled` (delayed)."""
        assert self.crawler.spider is not None
        new = get_retry_request(
            request, reason=reason, spider=self.crawler.spider,
            max_retry_times=request.meta.get("max_retry_times", self.max_retry_times),
            priority_adjust=request.meta.get("priority_adjust", self.priority_adjust),
            give_up_log_level=request.meta.get("give_up_log_level", self.give_up_log_level))
        if new is None:
            self.dead_letters.write(request, dead_reason, status=status, detail=detail or str(reason))
            return None
        if (scheduler := self.dead_letters.scheduler_of()) is None:
            return new  # Scrapy's behaviour: retried at once, in this process
        now = self.clock()
        delay = retry_delay(new.meta["retry_times"], self.retries.backoff_base, self.retries.backoff_max,
                            status=status, retry_after=retry_after, now=now, rng=self.rng)
        # persisted as scheduled: no Authorization/Cookie a downloader middleware added goes to Redis
        persisted = as_scheduled(new, request)
        if not scheduler.delay_request(persisted, not_before=now + delay, reason=dead_reason):
            return new  # cannot go to Redis (logged by the scheduler): retried at once, here
        assert self.crawler.stats is not None
        self.crawler.stats.inc_value("retry/delayed")
        logger.debug("Retry %(n)d of %(request)s delayed %(delay).2fs in the shared frontier (%(reason)s)",
                     {"n": new.meta["retry_times"], "request": request, "delay": delay, "reason": reason})
        # this attempt ends here; only the retry copy (which keeps the errback) may see a final failure
        request.errback = None
        raise RetryScheduled(f"retry in {delay:.2f}s")


class HttpErrorMiddleware(ScrapyHttpErrorMiddleware):
    """Scrapy's ``HttpErrorMiddleware`` (order 50) dead-lettering what it filters (HTTPERROR_DEAD_LETTER)."""

    dead_letters: DeadLetterWriter | None = None

    @classmethod
    @refusing
    def from_crawler(cls, crawler: Crawler) -> Self:
        o = super().from_crawler(crawler)
        if DistSettings.for_crawler(crawler).retries.httperror_dead_letter:
            o.dead_letters = DeadLetterWriter(crawler)
        return o

    # no ``spider`` parameter: Scrapy 2.19 deprecates it (the supertype still accepts it)
    def process_spider_exception(self, response: Response,  # type: ignore[override]
                                 exception: Exception) -> Iterable[Any] | None:
        result = super().process_spider_exception(response, exception)
        request = response.request
        if isinstance(exception, HttpError) and self.dead_letters is not None and request is not None:
            self.dead_letters.write(request, str(response.status), status=response.status,
                                    detail=response_status_message(response.status))
        return result
