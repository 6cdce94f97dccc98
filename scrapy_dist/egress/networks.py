"""The deny list itself: networks parsed from ``SCHEDULER_DENY_NETWORKS``, whether an address is in one, and
the checks that need no DNS (a host or proxy written as an IP address)."""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING, Any

from scrapy.exceptions import IgnoreRequest
from scrapy.utils.httpobj import urlparse_cached

from scrapy_dist.exceptions import RejectedEntry

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from scrapy import Request

__all__ = ["Address", "DeniedNetwork", "Network", "checked_request", "denied", "literal_refusal",
           "parse_networks", "request_refusal"]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class DeniedNetwork(IgnoreRequest):
    """A connection (to a request's host or its proxy) to an address in ``SCHEDULER_DENY_NETWORKS``."""


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


def denied(address: str, networks: Iterable[Network]) -> Network | None:
    """The network of ``networks`` holding ``address`` (an IPv4-mapped IPv6 address counts as its IPv4
    address), or ``None`` (also for text that is no IP address)."""
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


def literal_refusal(host: str, networks: Iterable[Network], what: str = "host") -> str:
    """Why ``host`` written as an IP address is refused (``""``: it is allowed, or it is a name, which the
    resolver checks). Twisted connects to an IP address without asking the resolver, so these are checked
    before the download."""
    host = host.strip("[]").rstrip(".").lower()
    if not host or not (host[0].isdigit() or ":" in host):
        return ""
    net = denied(host, networks)
    return f"{what} {host} is in denied network {net}" if net is not None else ""


def request_refusal(request: Request, networks: Sequence[Network]) -> str:
    """Why ``request`` is refused before any DNS: its host, or the host of its ``meta["proxy"]``, is an IP
    address in ``networks`` (``""``: not refused here)."""
    if not networks:
        return ""
    why = literal_refusal(urlparse_cached(request).hostname or "", networks)
    proxy = request.meta.get("proxy")
    if not why and isinstance(proxy, str) and proxy:
        why = literal_refusal(proxy_host(proxy), networks, "proxy")
    return why


def checked_request(request: Request, networks: Sequence[Network], stats: Any = None) -> Request:
    """``request``, read from the queue, unless :func:`request_refusal` refuses it: then it is counted
    (``deny_networks/refused``) and :class:`RejectedEntry` (``denied_network``) is raised, so the frontier
    moves the entry to its rejected list."""
    why = request_refusal(request, networks)
    if not why:
        return request
    if stats is not None:
        stats.inc_value("deny_networks/refused")
    raise RejectedEntry("denied_network", why)


def proxy_host(proxy: str) -> str:
    """The host of a proxy URL as Scrapy's ``HttpProxyMiddleware`` reads it (a scheme is optional)."""
    from urllib.parse import urlsplit

    try:
        return urlsplit(proxy if "://" in proxy else f"http://{proxy}").hostname or ""
    except ValueError:
        return ""
