"""Keep credentials out of Redis: what a request looked like when the scheduler handed it out.

Downloader middlewares add ``Authorization`` (``HttpAuthMiddleware``), ``Cookie`` (``CookiesMiddleware``)
and ``Proxy-Authorization`` (``HttpProxyMiddleware``) to the request object in place. A retry written to
``{spider}:delayed`` or a dead letter written to ``{spider}:deadletter`` must not carry them: Redis is
shared, ``scrapy-dist dead --json`` prints records, and the middlewares add them again on the next attempt.

:class:`ScheduledHeadersMiddleware` (first in the downloader chain; the add-on installs it) remembers the
credential headers a request had when it entered the downloader -- the ones the spider set -- and
:func:`as_scheduled` gives the copy to persist: credential headers as the spider set them, none added by a
middleware. Without the middleware, :func:`as_scheduled` drops every credential header.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scrapy import Request

#: headers only a middleware (or the spider itself) may put on a request, never an entry from Redis
CREDENTIAL_HEADERS = (b"Authorization", b"Cookie", b"Proxy-Authorization")

#: request -> its credential headers when it entered the downloader (only requests that had some)
_scheduled: weakref.WeakKeyDictionary[Request, dict[bytes, list[bytes]]] = weakref.WeakKeyDictionary()
#: requests seen by the middleware (with or without credentials)
_seen: weakref.WeakSet[Request] = weakref.WeakSet()


class ScheduledHeadersMiddleware:
    """Downloader middleware remembering the credential headers each request had as scheduled."""

    def process_request(self, request: Request) -> None:
        _seen.add(request)
        headers = request.headers
        own = {name: list(headers.getlist(name)) for name in CREDENTIAL_HEADERS if name in headers}
        if own:
            _scheduled[request] = own
        return None


def as_scheduled(request: Request, original: Request | None = None) -> Request:
    """``request`` with the credential headers of ``original`` (default: ``request``) as scheduled; the
    same object when there is nothing to change."""
    source = original if original is not None else request
    own = _scheduled.get(source, {}) if source in _seen else {}
    if all(list(request.headers.getlist(n)) == own.get(n, []) for n in CREDENTIAL_HEADERS):
        return request
    headers = request.headers.copy()
    for name in CREDENTIAL_HEADERS:
        headers.pop(name, None)
        if name in own:
            headers.setlist(name, own[name])
    return request.replace(headers=headers)
