"""Refuse requests to networks a crawl must not reach (``SCHEDULER_DENY_NETWORKS``), with a dead letter.

Anyone who can push a seed or a queue entry chooses URLs the workers fetch from inside your network:
``http://169.254.169.254/`` (cloud metadata and its credentials), ``http://127.0.0.1:6379/`` (the Redis
itself), an admin page on ``10.0.0.1``. The check that counts is made on the address each connection uses,
in the DNS resolver (:mod:`scrapy_dist.egress.networks`), which :func:`~scrapy_dist.egress.enforce` puts in
place -- with this middleware (installed by the add-on) or with the scheduler alone. This middleware adds
what a resolver cannot do:

* a host or ``meta["proxy"]`` written as an IP address (Twisted connects to it without asking the
  resolver) is refused before the download;
* a request the resolver refused (:class:`DeniedNetwork`, an ``IgnoreRequest``) is dead-lettered with
  reason ``denied_network``, as are the requests refused here (also counted: ``deny_networks/refused``);
* a request sent through a proxy is also checked by its target host, resolved here: the proxy resolves it
  for the download, so this is a best effort (a name that does not resolve here is left to the proxy).

A host that does not resolve fails as Scrapy reports it (``DNSLookupError``), not as a refusal.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from scrapy.exceptions import NotConfigured
from scrapy.utils.defer import maybe_deferred_to_future
from scrapy.utils.httpobj import urlparse_cached
from twisted.internet import threads

from scrapy_dist.egress import DeniedNetwork, denied, enforce, parse_networks, request_refusal
from scrapy_dist.egress.networks import Network
from scrapy_dist.settings import DistSettings
from scrapy_dist.settings.refusal import refusing
from scrapy_dist.utils.ratelimit import RateLimitedLog

if TYPE_CHECKING:
    from collections.abc import Callable

    from scrapy import Request
    from scrapy.crawler import Crawler
    from typing_extensions import Self

__all__ = ["DeniedNetwork", "DenyNetworksMiddleware", "denied", "parse_networks"]

logger = logging.getLogger(__name__)


def _getaddrinfo(host: str) -> list[str]:
    return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})


class DenyNetworksMiddleware:
    """Downloader middleware refusing requests to ``SCHEDULER_DENY_NETWORKS`` that the resolver cannot see,
    and dead-lettering every refused request (see the module docstring). The verdict on a proxied
    request's target host is cached for ``ttl`` seconds (at most 10,000 hosts)."""

    def __init__(
        self,
        networks: list[Network],
        crawler: Crawler | None = None,
        ttl: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not networks:
            raise NotConfigured("SCHEDULER_DENY_NETWORKS is empty")
        self.networks = networks
        self.crawler = crawler
        self.ttl = ttl
        self.clock = clock
        #: proxied target host -> (expires, denial detail or "")
        self._verdicts: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self._dead_letters: Any = None
        self._log = RateLimitedLog(logger)

    @classmethod
    @refusing
    def from_crawler(cls, crawler: Crawler) -> Self:
        # checked (one line on a bad value) when the crawl's settings were read
        o = cls(enforce(crawler, DistSettings.for_crawler(crawler).scheduler.deny_networks), crawler)
        from scrapy_dist.middlewares.retry import DeadLetterWriter

        o._dead_letters = DeadLetterWriter(crawler)
        return o

    async def target_verdict(self, host: str) -> str:
        """Why a proxied request's target ``host`` is denied (``""`` if it is not, or does not resolve
        here); resolves it unless the answer is cached."""
        now = self.clock()
        cached = self._verdicts.get(host)
        if cached is not None and cached[0] > now:
            return cached[1]
        addresses: list[str] = []
        with contextlib.suppress(OSError, UnicodeError):
            addresses = await maybe_deferred_to_future(threads.deferToThread(_getaddrinfo, host))
        why = ""
        for address in addresses:
            net = denied(address, self.networks)
            if net is not None:
                why = f"{host} resolves to {address}, in denied network {net}"
                break
        self._verdicts[host] = (now + self.ttl, why)
        self._verdicts.move_to_end(host)
        while len(self._verdicts) > 10_000:
            self._verdicts.popitem(last=False)
        return why

    async def process_request(self, request: Request) -> None:
        why = request_refusal(request, self.networks)
        if not why and request.meta.get("proxy"):
            host = (urlparse_cached(request).hostname or "").rstrip(".").lower()
            why = await self.target_verdict(host) if host else ""
        if not why:
            return None
        if self.crawler is not None and self.crawler.stats is not None:
            self.crawler.stats.inc_value("deny_networks/refused")
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
