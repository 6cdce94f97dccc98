"""Refuse requests to networks a crawl must not reach (``SCHEDULER_DENY_NETWORKS``).

Anyone who can push a seed or a queue entry chooses URLs the workers fetch from inside your network:
``http://169.254.169.254/`` (cloud metadata and its credentials), ``http://127.0.0.1:6379/`` (the Redis
itself), an admin page on ``10.0.0.1``. :class:`DenyNetworksMiddleware` checks the address a request's
host resolves to -- not only its spelling: ``http://2130706433/`` or a DNS name pointing at 127.0.0.1 are
caught too -- before the request leaves the worker. A refused request fails with :class:`DeniedNetwork`
(an ``IgnoreRequest``), is counted (``deny_networks/refused``) and dead-lettered with reason
``denied_network``.

The check resolves the host through the reactor's resolver, which with Scrapy's default
``DNS_RESOLVER`` and ``DNSCACHE_ENABLED`` fills the DNS cache the download then uses: the address checked
is the address connected to, so a DNS answer that changes between the check and the connection (DNS
rebinding) does not get through. With another resolver every address ``getaddrinfo`` gives is checked,
which leaves that window open; see ``docs/security.md``. A request sent through a proxy (``meta["proxy"]``)
is checked by its target host: the proxy's own address is the operator's choice.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from scrapy.exceptions import IgnoreRequest, NotConfigured
from scrapy.utils.defer import maybe_deferred_to_future
from scrapy.utils.httpobj import urlparse_cached
from twisted.internet import threads

from scrapy_dist.settings import DistSettings
from scrapy_dist.settings.refusal import refusing
from scrapy_dist.utils.ratelimit import RateLimitedLog

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from scrapy import Request
    from scrapy.crawler import Crawler
    from typing_extensions import Self

logger = logging.getLogger(__name__)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class DeniedNetwork(IgnoreRequest):
    """A request whose host resolves into ``SCHEDULER_DENY_NETWORKS``."""


def parse_networks(values: Iterable[Any]) -> list[Network]:
    """CIDR strings as networks; raises ``ValueError`` naming the first bad one."""
    out: list[Network] = []
    for v in values:
        try:
            out.append(ipaddress.ip_network(str(v).strip(), strict=False))
        except ValueError:
            raise ValueError(
                f"SCHEDULER_DENY_NETWORKS: {v!r} is not a network (CIDR, e.g. 10.0.0.0/8)"
            ) from None
    return out


def denied(address: str, networks: list[Network]) -> Network | None:
    """The network of ``networks`` holding ``address`` (an IPv4-mapped IPv6 address counts as its IPv4
    address), or ``None``."""
    try:
        ip: Address = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    candidates = [ip]
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        candidates.append(ip.ipv4_mapped)
    for net in networks:
        if any(c.version == net.version and c in net for c in candidates):
            return net
    return None


def _getaddrinfo(host: str) -> list[str]:
    return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})


class DenyNetworksMiddleware:
    """Downloader middleware refusing requests whose host resolves into ``SCHEDULER_DENY_NETWORKS``
    (see the module docstring). A host's verdict is cached for ``ttl`` seconds (at most 10,000 hosts), so
    the cost is one resolution per host and minute, not per request."""

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
        #: host -> (expires, denial detail or "")
        self._verdicts: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self._dead_letters: Any = None
        self._log = RateLimitedLog(logger)

    @classmethod
    @refusing
    def from_crawler(cls, crawler: Crawler) -> Self:
        # checked (one line on a bad value) when the crawl's settings were read
        networks = parse_networks(DistSettings.for_crawler(crawler).scheduler.deny_networks)
        o = cls(networks, crawler)
        from scrapy_dist.middlewares.retry import DeadLetterWriter

        o._dead_letters = DeadLetterWriter(crawler)
        return o

    async def verdict(self, host: str) -> str:
        """Why ``host`` is denied (``""`` if it is not); resolves it unless the answer is cached."""
        now = self.clock()
        cached = self._verdicts.get(host)
        if cached is not None and cached[0] > now:
            return cached[1]
        addresses = await self._resolve(host)
        why = ""
        for address in addresses:
            net = denied(address, self.networks)
            if net is not None:
                why = f"{host} resolves to {address}, in denied network {net}"
                break
        if not addresses:
            why = f"{host} does not resolve"
        self._verdicts[host] = (now + self.ttl, why)
        self._verdicts.move_to_end(host)
        while len(self._verdicts) > 10_000:
            self._verdicts.popitem(last=False)
        return why

    async def _resolve(self, host: str) -> list[str]:
        try:
            ipaddress.ip_address(host.split("%", 1)[0])
            return [host]
        except ValueError:
            pass
        from twisted.internet import reactor as _reactor

        reactor: Any = _reactor
        out: set[str] = set()
        # the reactor's resolver: with Scrapy's caching resolver the download connects to this address;
        # it fails for a host without IPv4 address, and getaddrinfo below still answers
        with contextlib.suppress(Exception):
            out.add(str(await maybe_deferred_to_future(reactor.resolve(host))))
        with contextlib.suppress(OSError, UnicodeError):
            out.update(await maybe_deferred_to_future(threads.deferToThread(_getaddrinfo, host)))
        return sorted(out)

    async def process_request(self, request: Request) -> None:
        host = (urlparse_cached(request).hostname or "").rstrip(".").lower()
        if not host:
            return None
        why = await self.verdict(host)
        if not why:
            return None
        if self.crawler is not None and self.crawler.stats is not None:
            self.crawler.stats.inc_value("deny_networks/refused")
        if self._dead_letters is not None:
            self._dead_letters.write(request, "denied_network", detail=why)
        self._log.log(logging.WARNING, "Refused %s: %s (SCHEDULER_DENY_NETWORKS)", request, why)
        raise DeniedNetwork(why)
