"""Where a worker may connect: the networks of ``SCHEDULER_DENY_NETWORKS`` and the DNS resolver that refuses
them on the address each connection uses (:class:`DenyNetworksResolver`, Scrapy's ``TWISTED_DNS_RESOLVER``).

The scheduler and the add-on's middleware put the policy in force with :func:`enforce`; the check itself
sits in the resolver the download connects through, so a name that answers differently from one lookup
to the next (DNS rebinding) meets the check on the answer that is used.
May import: ``utils`` and the root's exceptions.
"""

from __future__ import annotations

from scrapy_dist.egress.networks import (
    POLICY,
    DeniedNetwork,
    DenyNetworksResolver,
    DenyPolicy,
    checked_request,
    denied,
    enforce,
    install,
    literal_refusal,
    parse_networks,
    request_refusal,
)

__all__ = [
    "POLICY",
    "DeniedNetwork",
    "DenyNetworksResolver",
    "DenyPolicy",
    "checked_request",
    "denied",
    "enforce",
    "install",
    "literal_refusal",
    "parse_networks",
    "request_refusal",
]
