"""Keep credentials out of Redis: what a request looked like when the scheduler handed it out
(docs/security.md, "No credentials written to Redis").

:class:`ScheduledHeadersMiddleware` (first in the downloader chain) remembers the credential headers a
request had when it entered the downloader, and :func:`as_scheduled` gives the copy a retry or dead letter
persists (without the middleware, no credential header at all). :class:`AddedCredentialsMiddleware` (last)
remembers the credential values the middlewares added, which
:func:`scrapy_dist.wire.codec.encode_request` leaves out of every payload (a redirect's new request).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scrapy import Request

#: headers only a middleware (or the spider itself) may put on a request, never an entry from Redis
CREDENTIAL_HEADERS = (b"Authorization", b"Cookie", b"Proxy-Authorization")

#: request -> its credential headers when it entered the downloader (only requests that had some)
_scheduled: weakref.WeakKeyDictionary[Request, dict[bytes, list[bytes]]] = weakref.WeakKeyDictionary()
#: requests seen by the middleware (with or without credentials)
_seen: weakref.WeakSet[Request] = weakref.WeakSet()
#: (lower-case header name, value) pairs downloader middlewares added to requests, newest last
_added: OrderedDict[tuple[bytes, bytes], None] = OrderedDict()
ADDED_LIMIT = 1000


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


class AddedCredentialsMiddleware:
    """Downloader middleware (last in the chain) remembering the credential header values the
    middlewares before it added, so that no payload carries them (see the module docstring)."""

    def process_request(self, request: Request) -> None:
        own = _scheduled.get(request, {}) if request in _seen else {}
        for name in CREDENTIAL_HEADERS:
            for value in request.headers.getlist(name):
                if value not in own.get(name, ()):
                    key = (name.lower(), bytes(value))
                    _added[key] = None
                    _added.move_to_end(key)
        while len(_added) > ADDED_LIMIT:
            _added.popitem(last=False)
        return None


def added_by_middleware(name: bytes, value: bytes) -> bool:
    """Whether a downloader middleware added header ``name: value`` to a request of this process."""
    return bool(_added) and (name.lower(), value) in _added
