"""Where a worker may connect (``SCHEDULER_DENY_NETWORKS``): the checks of a host or proxy written as an IP
address, and resolvers that check the address each connection uses (so DNS rebinding meets the check).

May import: ``utils`` and the root's exceptions."""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from scrapy import signals
from scrapy.exceptions import IgnoreRequest
from scrapy.resolver import CachingThreadedResolver, dnscache
from scrapy.utils.httpobj import urlparse_cached
from twisted.internet import defer
from twisted.internet._resolver import ComplexResolverSimplifier, SimpleResolverComplexifier
from twisted.internet.address import IPv4Address
from twisted.internet.interfaces import IHostnameResolver, IResolutionReceiver, IResolverSimple
from zope.interface import implementer, provider

from scrapy_dist.exceptions import RejectedEntry
from scrapy_dist.utils import RateLimitedLog, inc_stat

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from scrapy import Request
    from scrapy.crawler import Crawler
    from twisted.internet.defer import Deferred
    from twisted.internet.interfaces import IHostResolution

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
logger = logging.getLogger(__name__)


class DeniedNetwork(IgnoreRequest):
    """A connection (to a request's host or its proxy) to an address in ``SCHEDULER_DENY_NETWORKS``."""


def parse_networks(values: Iterable[Any]) -> list[Network]:
    """CIDR strings as networks; raises ``ValueError`` naming the first bad one."""
    out: list[Network] = []
    for v in values:
        try:
            out.append(ipaddress.ip_network(str(v).strip(), strict=False))
        except ValueError:
            raise ValueError(f"SCHEDULER_DENY_NETWORKS: {v!r} is not a network like 10.0.0.0/8") from None
    return out


def denied(address: str, networks: Iterable[Network]) -> Network | None:
    """The network holding ``address`` (an IPv4-mapped address as its IPv4 one), or ``None``."""
    try:
        ip: Address = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return next((net for net in networks
                 if any(c is not None and c.version == net.version and c in net for c in (ip, mapped))), None)


def literal_refusal(host: str, networks: Iterable[Network], what: str = "host") -> str:
    """Why ``host`` written as an IP address (which Twisted connects to without a resolver) is refused."""
    host = host.strip("[]").rstrip(".").lower()
    if not host or not (host[0].isdigit() or ":" in host):
        return ""
    return f"{what} {host} is in denied network {net}" if (net := denied(host, networks)) is not None else ""


def request_refusal(request: Request, networks: Sequence[Network]) -> str:
    """Why ``request``'s host or ``meta["proxy"]``, written as an IP address, is refused (or ``""``)."""
    if not networks:
        return ""
    why = literal_refusal(urlparse_cached(request).hostname or "", networks)
    if not why and isinstance(proxy := request.meta.get("proxy"), str) and proxy:
        why = literal_refusal(proxy_host(proxy), networks, "proxy")
    return why


def checked_request(request: Request, networks: Sequence[Network], stats: Any = None) -> Request:
    """``request``, or :class:`RejectedEntry` (``denied_network``, counted) if :func:`request_refusal`."""
    if not (why := request_refusal(request, networks)):
        return request
    inc_stat(stats, "deny_networks/refused")
    raise RejectedEntry("denied_network", why)


def proxy_host(proxy: str) -> str:
    """The host of a proxy URL as Scrapy's ``HttpProxyMiddleware`` reads it (a scheme is optional)."""
    try:
        return urlsplit(proxy if "://" in proxy else f"http://{proxy}").hostname or ""
    except ValueError:
        return ""


class DenyPolicy:
    """The networks this process refuses to connect to: ``networks`` and those of its running crawls."""

    def __init__(self, networks: Sequence[Network] = ()) -> None:
        self.fixed = list(networks)
        self._crawls: dict[int, tuple[list[Network], Any]] = {}  # crawl -> (networks, stats or None)
        self._marks: OrderedDict[str, str] = OrderedDict()  # stand-in host name -> why (see mark())
        self._log = RateLimitedLog(logger)

    def join(self, key: int, networks: Sequence[Network], stats: Any = None) -> None:
        self._crawls[key] = (list(networks), stats)

    def leave(self, key: int) -> None:
        self._crawls.pop(key, None)

    @property
    def networks(self) -> list[Network]:
        return list(dict.fromkeys([*self.fixed, *(n for nets, _ in self._crawls.values() for n in nets)]))

    def check(self, address: str, name: str) -> str:
        """``address`` (an answer for ``name``) unless denied: then count, log and raise DeniedNetwork."""
        if (net := denied(address, self.networks)) is None:
            return address
        why = f"{name} resolves to {address}, in denied network {net}"
        for _, stats in self._crawls.values():
            inc_stat(stats, "deny_networks/refused")
        self._log.log(logging.WARNING, "Refused to connect: %s (SCHEDULER_DENY_NETWORKS)", why)
        raise DeniedNetwork(why)

    def mark(self, why: str) -> str:
        """A host name standing in for a refused address, whose lookup fails (:meth:`unmark`)."""
        name = f"denied-{secrets.token_hex(8)}{_MARK_SUFFIX}"
        self._marks[name] = why
        while len(self._marks) > 10_000:
            self._marks.popitem(last=False)
        return name

    def unmark(self, name: str) -> Deferred[str] | None:
        return (defer.fail(DeniedNetwork(self._marks.get(name, "refused address (SCHEDULER_DENY_NETWORKS)")))
                if name.endswith(_MARK_SUFFIX) else None)


_MARK_SUFFIX = ".denied.scrapy-dist.invalid"

POLICY = DenyPolicy()  #: The policy of this process, which the resolvers of this module consult.


@implementer(IResolverSimple)
class DenyingResolver:
    """Any ``IResolverSimple`` (``inner``) whose every answer, cached or fresh, is checked."""

    def __init__(self, inner: Any, policy: DenyPolicy = POLICY) -> None:
        self.inner, self.policy = inner, policy

    def getHostByName(self, name: str, timeout: Sequence[int] = (1, 3, 11, 45)) -> Deferred[str]:
        if (refused := self.policy.unmark(name)) is not None:
            return refused
        answer: Deferred[str] = self.inner.getHostByName(name, timeout)
        return answer.addCallback(self.policy.check, name)


class DenyNetworksResolver(DenyingResolver):
    """Scrapy's default resolver, checked: for ``TWISTED_DNS_RESOLVER`` (the add-on sets it)."""

    def __init__(self, reactor: Any, cache_size: int, timeout: float) -> None:
        super().__init__(CachingThreadedResolver(reactor, cache_size, timeout))
        self.reactor, self.timeout = reactor, timeout

    #: Scrapy's: ``cls(reactor, DNSCACHE_SIZE or 0, DNS_TIMEOUT)``
    from_crawler = CachingThreadedResolver.__dict__["from_crawler"]

    def install_on_reactor(self) -> None:
        install(self.reactor, self.policy, self)


@provider(IResolutionReceiver)
class _DenyingReceiver:
    """Passes on the addresses of a resolution; a denied one becomes a stand-in that fails to connect."""

    def __init__(self, receiver: Any, name: str, policy: DenyPolicy) -> None:
        self.receiver, self.name, self.policy = receiver, name, policy

    def resolutionBegan(self, resolution: IHostResolution) -> None:
        self.receiver.resolutionBegan(resolution)

    def addressResolved(self, address: Any) -> None:
        try:
            self.policy.check(str(getattr(address, "host", "")), self.name)
        except DeniedNetwork as exc:
            address = IPv4Address("TCP", self.policy.mark(str(exc)), getattr(address, "port", 0))
        self.receiver.addressResolved(address)

    def resolutionComplete(self) -> None:
        self.receiver.resolutionComplete()


@implementer(IHostnameResolver)
class DenyingNameResolver:
    """Any ``IHostnameResolver`` (``inner``) whose denied addresses become stand-ins that fail to connect."""

    def __init__(self, inner: Any, policy: DenyPolicy = POLICY) -> None:
        self.inner, self.policy = inner, policy

    def resolveHostName(self, resolutionReceiver: Any, hostName: str, portNumber: int = 0,
                        addressTypes: Any = None, transportSemantics: str = "TCP") -> IHostResolution:
        receiver = _DenyingReceiver(resolutionReceiver, hostName, self.policy)
        return self.inner.resolveHostName(  # type: ignore[no-any-return]
            receiver, hostName, portNumber, addressTypes, transportSemantics)


def install(reactor: Any, policy: DenyPolicy = POLICY, ours: DenyNetworksResolver | None = None) -> str:
    """Make every name ``reactor`` resolves pass ``policy``; the dotted name of a foreign one it wraps."""
    current = reactor.resolver
    if isinstance(current, DenyingResolver) and isinstance(reactor.nameResolver, DenyingNameResolver):
        return ""
    checking: DenyingResolver
    if ours is None and isinstance(current, ComplexResolverSimplifier):  # a name resolver was installed
        inner: Any = current._nameResolver
        checking = DenyingResolver(current, policy)
        names = DenyingNameResolver(inner, policy)
    else:
        inner = current
        checking = ours or (DenyNetworksResolver(reactor, dnscache.limit or 0, current.timeout)
                            if type(current) is CachingThreadedResolver else DenyingResolver(current, policy))
        checking.policy = policy
        names = DenyingNameResolver(SimpleResolverComplexifier(checking.inner), policy)
    reactor.installNameResolver(names)
    reactor.resolver = checking  # installNameResolver set a plain wrapper of names: ours reads stand-ins
    if ours is not None or type(inner) is CachingThreadedResolver:
        return ""
    path = f"{type(inner).__module__}.{type(inner).__qualname__}"
    return "" if path.startswith("twisted.") else path


_enforced: weakref.WeakSet[Any] = weakref.WeakSet()
_warnings = RateLimitedLog.once(logger)  # each text once per process


def enforce(crawler: Crawler, deny_networks: Iterable[str]) -> list[Network]:
    """Put ``crawler``'s ``SCHEDULER_DENY_NETWORKS`` in force from the engine's start to its stop."""
    if not (networks := parse_networks(deny_networks)) or crawler in _enforced:
        return networks
    _enforced.add(crawler)

    def started() -> None:
        POLICY.join(id(crawler), networks, crawler.stats)
        _check_reactor(crawler)
        _check_env_proxies(networks)
    crawler.signals.connect(started, signal=signals.engine_started, weak=False)
    crawler.signals.connect(lambda: POLICY.leave(id(crawler)), signal=signals.engine_stopped, weak=False)
    return networks


def _check_reactor(crawler: Crawler) -> None:
    if not crawler.settings.getbool("TWISTED_REACTOR_ENABLED", True):
        _warnings.log(logging.WARNING, "SCHEDULER_DENY_NETWORKS: with TWISTED_REACTOR_ENABLED = False only"
                      " hosts and proxies written as IP addresses are refused, not a DNS name into a denied"
                      " network: deny those networks at the firewall as well", key="no reactor")
        return
    from twisted.internet import reactor
    if wrapped := install(reactor):
        _warnings.log(logging.WARNING, "TWISTED_DNS_RESOLVER (or DNS_RESOLVER) = %r is not scrapy-dist's: it"
                      " is wrapped to check every address against SCHEDULER_DENY_NETWORKS; for Scrapy's DNS"
                      " cache too, use TWISTED_DNS_RESOLVER = 'scrapy_dist.egress.DenyNetworksResolver'",
                      wrapped, key=wrapped)


def _check_env_proxies(networks: list[Network]) -> None:
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        value = os.environ.get(var, "")
        if value and (why := literal_refusal(proxy_host(value), networks, "proxy")):
            _warnings.log(logging.WARNING, "%s: %s (SCHEDULER_DENY_NETWORKS); used all the same (the"
                          " operator's setting): only a proxy named by a DNS name is checked on each"
                          " connection", var, why, key=f"{var} {why}")
