"""scrapy-dist's Scrapy middlewares, one module each; names are imported on first use only, so a missing
or broken module does not break the others."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scrapy_dist.middlewares.cookies import SharedCookiesMiddleware
    from scrapy_dist.middlewares.httperror import HttpErrorMiddleware
    from scrapy_dist.middlewares.networks import DenyNetworksMiddleware
    from scrapy_dist.middlewares.retry import RetryMiddleware, RetryScheduled
    from scrapy_dist.wire.credentials import AddedCredentialsMiddleware, ScheduledHeadersMiddleware

#: public name -> module under scrapy_dist.middlewares, or a full module path (add one line per middleware)
_EXPORTS = {
    "SharedCookiesMiddleware": "cookies",
    "RetryMiddleware": "retry",
    "RetryScheduled": "retry",
    "HttpErrorMiddleware": "httperror",
    "ScheduledHeadersMiddleware": "scrapy_dist.wire.credentials",
    "AddedCredentialsMiddleware": "scrapy_dist.wire.credentials",
    "DenyNetworksMiddleware": "networks",
}

# keep in step with _EXPORTS
__all__ = [
    "SharedCookiesMiddleware",
    "RetryMiddleware",
    "RetryScheduled",
    "HttpErrorMiddleware",
    "ScheduledHeadersMiddleware",
    "AddedCredentialsMiddleware",
    "DenyNetworksMiddleware",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(module if "." in module else f"{__name__}.{module}"), name)
