"""scrapy-dist's Scrapy middlewares: the shared cookie jar (``cookies``) and delayed retries and dead-lettered
HTTP errors (``retry``), imported on first use; here the two small guards the add-on installs."""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections import OrderedDict
from importlib import import_module
from typing import TYPE_CHECKING, Any

from scrapy.exceptions import IgnoreRequest, NotConfigured
from scrapy.utils.defer import maybe_deferred_to_future
from scrapy.utils.httpobj import urlparse_cached
from twisted.internet import threads

from scrapy_dist.egress import DeniedNetwork, Network, denied, enforce, request_refusal
from scrapy_dist.frontier.engine import VALIDATOR_HEADERS
from scrapy_dist.frontier.scheduler import get_scheduler
from scrapy_dist.settings import DistSettings
from scrapy_dist.settings.reader import refusing
from scrapy_dist.utils import RateLimitedLog, inc_stat

if TYPE_CHECKING:
    from collections.abc import Callable

    from scrapy import Request
    from scrapy.crawler import Crawler
    from scrapy.http import Response
    from typing_extensions import Self

    from scrapy_dist.middlewares.cookies import SharedCookiesMiddleware
    from scrapy_dist.middlewares.retry import HttpErrorMiddleware, RetryMiddleware, RetryScheduled
    from scrapy_dist.wire.entrypolicy import AddedCredentialsMiddleware, ScheduledHeadersMiddleware

#: public name -> module under scrapy_dist.middlewares, or a full module path (and a line in __all__)
_EXPORTS = {"SharedCookiesMiddleware": "cookies", "RetryMiddleware": "retry", "RetryScheduled": "retry",
            "HttpErrorMiddleware": "retry", "ScheduledHeadersMiddleware": "scrapy_dist.wire.entrypolicy",
            "AddedCredentialsMiddleware": "scrapy_dist.wire.entrypolicy"}

__all__ = ["AddedCredentialsMiddleware", "ConditionalRevisitMiddleware", "DeniedNetwork",
           "DenyNetworksMiddleware", "HttpErrorMiddleware", "NotModified", "RetryMiddleware",
           "RetryScheduled", "ScheduledHeadersMiddleware", "SharedCookiesMiddleware"]


def __getattr__(name: str) -> Any:
    if (module := _EXPORTS.get(name)) is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(module if "." in module else f"{__name__}.{module}"), name)


logger = logging.getLogger(__name__)


def _getaddrinfo(host: str) -> list[str]:
    return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})


class DenyNetworksMiddleware:
    """Refuses, and dead-letters, requests to ``SCHEDULER_DENY_NETWORKS`` the resolver cannot see: a host or
    proxy written as an IP address, a proxied request's target (resolved here, cached ``ttl`` seconds)."""

    def __init__(self, networks: list[Network], crawler: Crawler | None = None, ttl: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not networks:
            raise NotConfigured("SCHEDULER_DENY_NETWORKS is empty")
        self.networks, self.crawler, self.ttl, self.clock = networks, crawler, ttl, clock
        self._verdicts: OrderedDict[str, tuple[float, str]] = OrderedDict()  #: target -> (expires, why or "")
        self._dead_letters: Any = None
        self._log = RateLimitedLog(logger)

    @classmethod
    @refusing
    def from_crawler(cls, crawler: Crawler) -> Self:
        from scrapy_dist.middlewares.retry import DeadLetterWriter
        o = cls(enforce(crawler, DistSettings.for_crawler(crawler).scheduler.deny_networks), crawler)
        o._dead_letters = DeadLetterWriter(crawler)
        return o

    async def target_verdict(self, host: str) -> str:
        """Why a proxied request's target ``host`` is denied (``""``: it is not, or does not resolve)."""
        now, cached = self.clock(), self._verdicts.get(host)
        if cached is not None and cached[0] > now:
            return cached[1]
        addresses: list[str] = []
        with contextlib.suppress(OSError, UnicodeError):
            addresses = await maybe_deferred_to_future(threads.deferToThread(_getaddrinfo, host))
        nets = ((a, denied(a, self.networks)) for a in addresses)
        why = next((f"{host} resolves to {a}, in denied network {net}" for a, net in nets if net), "")
        self._verdicts[host] = (now + self.ttl, why)
        self._verdicts.move_to_end(host)
        while len(self._verdicts) > 10_000:
            self._verdicts.popitem(last=False)
        return why

    async def process_request(self, request: Request) -> None:
        if not (why := request_refusal(request, self.networks)) and request.meta.get("proxy"):
            host = (urlparse_cached(request).hostname or "").rstrip(".").lower()
            why = await self.target_verdict(host) if host else ""
        if not why:
            return None
        inc_stat(getattr(self.crawler, "stats", None), "deny_networks/refused")
        self._log.log(logging.WARNING, "Refused %s: %s (SCHEDULER_DENY_NETWORKS)", request, why)
        self._dead_letter(request, why)
        raise DeniedNetwork(why)

    def process_exception(self, request: Request, exception: BaseException) -> None:
        """A connection the resolver refused (counted and logged there): dead-lettered here."""
        if isinstance(exception, DeniedNetwork):
            self._dead_letter(request, str(exception))

    def _dead_letter(self, request: Request, why: str) -> None:
        if self._dead_letters is not None:
            self._dead_letters.write(request, "denied_network", detail=why)


class NotModified(IgnoreRequest):
    """A conditional revisit was answered 304 Not Modified: the page did not change."""


class ConditionalRevisitMiddleware:
    """``REVISIT_CONDITIONAL`` (docs/continuous.md): a 304 to a revisit that sent validators is counted,
    keeps the revisits going, calls ``spider.on_not_modified(response)``, raises :class:`NotModified`."""

    #: what the frontier's revisits look for in DOWNLOADER_MIDDLEWARES (it does not import this layer)
    turns_304_into_not_modified = True

    def __init__(self, crawler: Crawler) -> None:
        self.crawler, self.stats = crawler, crawler.stats

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
        if self.conditional(request):
            inc_stat(self.stats, "revisit/conditional")

    def process_response(self, request: Request, response: Response) -> Response:
        if response.status != 304 or not self.conditional(request):
            return response
        inc_stat(self.stats, "revisit/not_modified")
        if (sched := get_scheduler(self.crawler)) is not None and sched.revisits is not None:
            sched.revisits.not_modified(request)
        if callable(hook := getattr(self.crawler.spider, "on_not_modified", None)):
            try:
                hook(response)
            except Exception:
                logger.exception("on_not_modified(%s) raised", response)
        raise NotModified(f"304 Not Modified: {request.url}")

    def process_exception(self, request: Request, exception: BaseException) -> Any:
        return None
