"""The wire format of a request in Redis: versioned msgpack, never pickle.

An encoded request (a *payload*) is ``b"\\x01" + msgpack(map)``: one version byte, then a msgpack map
holding only the fields that differ from a plain ``Request``'s defaults, under short keys:

=====  ================================  =========================================
key    field                             type
=====  ================================  =========================================
``u``  url                               str (required)
``m``  method                            str, omitted when ``GET``
``h``  headers                           list of ``[name: bytes, [value: bytes, ...]]``
``b``  body                              bytes
``c``  cookies                           map or list of maps
``M``  meta                              map (str keys, msgpack-encodable values)
``k``  cb_kwargs                         map (str keys)
``p``  priority                          int
``d``  dont_filter                       bool
``cb`` callback: spider method name      str
``eb`` errback: spider method name       str
``f``  flags                             list of str
``e``  encoding                          str, omitted when ``utf-8``
``C``  Request subclass, ``module.Name``  str, omitted for ``scrapy.Request``
=====  ================================  =========================================

Decoding treats the bytes as untrusted: any deviation raises :class:`RejectedEntry` with a short reason,
callbacks must name public methods of the spider, and a request subclass is only accepted when its module
is already imported (nothing is imported on behalf of data read from Redis).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import msgpack
from scrapy import Request
from scrapy.http import Headers
from scrapy.spiders import CrawlSpider

from scrapy_dist.exceptions import RejectedEntry, UnserializableRequest

if TYPE_CHECKING:
    from scrapy import Spider

VERSION = 1
_VERSION_BYTE = bytes([VERSION])
_PLAIN_TYPES = (str, bytes, int, float, bool, type(None))
_ALLOWED_KEYS = frozenset(["u", "m", "h", "b", "c", "M", "k", "p", "d", "cb", "eb", "f", "e", "C"])
_BAD_URL_CHARS = re.compile(r"[\x00-\x20\x7f]")
#: private dispatchers of CrawlSpider rules: rule requests name them, with the rule index in meta
_CRAWLSPIDER_METHODS = frozenset({"_callback", "_errback"})


def _check_encodable(value: Any, path: str) -> None:
    """Raise :class:`UnserializableRequest` naming the first part of ``value`` msgpack cannot hold."""
    if isinstance(value, _PLAIN_TYPES):
        if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
            raise UnserializableRequest(f"{path}: integer out of range", path)
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_encodable(v, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, bytes, int)):
                raise UnserializableRequest(f"{path}: key {k!r} is a {type(k).__name__}", path)
            _check_encodable(v, f"{path}.{k}" if isinstance(k, str) else f"{path}[{k!r}]")
        return
    raise UnserializableRequest(f"{path} holds a {type(value).__name__}, which cannot be encoded", path)


def _method_name(func: Any, spider: Spider | None, what: str) -> str | None:
    if func is None:
        return None
    if isinstance(func, str):
        return func
    owner = getattr(func, "__self__", None)
    name = getattr(func, "__name__", None)
    bound_to_spider = owner is not None and (spider is None or owner is spider)
    if bound_to_spider and name and getattr(owner, name, None) == func:
        return str(name)
    raise UnserializableRequest(f"{what} {func!r} is not a method of the spider", what)


def encode_request(request: Request, spider: Spider | None = None) -> bytes:
    """Encode ``request`` as a versioned msgpack payload.

    Raises :class:`UnserializableRequest` (with ``.key`` naming the field or meta key) when a callback is
    not a spider method or meta / cb_kwargs / cookies hold values msgpack cannot represent.
    """
    d: dict[str, Any] = {"u": request.url}
    if request.method != "GET":
        d["m"] = request.method
    if request.headers:
        d["h"] = [[bytes(k), [bytes(v) for v in vs]] for k, vs in request.headers.items()]
    if request.body:
        d["b"] = request.body
    if request.cookies:
        d["c"] = request.cookies
    if request.meta:
        d["M"] = request.meta
    if request.cb_kwargs:
        d["k"] = request.cb_kwargs
    if request.priority:
        d["p"] = request.priority
    if request.dont_filter:
        d["d"] = True
    cb = _method_name(request.callback, spider, "callback")
    if cb is not None:
        d["cb"] = cb
    eb = _method_name(request.errback, spider, "errback")
    if eb is not None:
        d["eb"] = eb
    if request.flags:
        d["f"] = list(request.flags)
    if request.encoding != "utf-8":
        d["e"] = request.encoding
    cls = type(request)
    if cls is not Request:
        d["C"] = f"{cls.__module__}.{cls.__qualname__}"
    try:
        return _VERSION_BYTE + msgpack.packb(d, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        for field, label in (("M", "meta"), ("k", "cb_kwargs"), ("c", "cookies")):
            if field in d:
                _check_encodable(d[field], label)
        raise UnserializableRequest("request cannot be encoded", "request") from None


# -- decoding (untrusted input) -----------------------------------------------------------------


def _expect(value: Any, types: type | tuple[type, ...], reason: str, field: str) -> Any:
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        raise RejectedEntry(reason, f"{field} has type {type(value).__name__}")
    return value


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def spider_method(spider: Spider, name: Any, what: str) -> Any:
    """Resolve ``name`` to a public method of ``spider``; reject anything else (shared with seeds)."""
    if name in _CRAWLSPIDER_METHODS and isinstance(spider, CrawlSpider):
        pass  # CrawlSpider routes rule requests through these two
    elif not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        raise RejectedEntry(f"bad_{what}", f"{what} {name!r} is not a public method name")
    method = getattr(spider, name, None)
    if method is None or not callable(method) or getattr(method, "__self__", None) is not spider:
        raise RejectedEntry(f"bad_{what}", f"spider has no method {name!r}")
    return method


def check_url(url: Any, allowed_schemes: Iterable[str]) -> str:
    """Validate an untrusted URL string: type, length, scheme, host, no whitespace/control chars."""
    if not isinstance(url, str):
        raise RejectedEntry("bad_url", f"url has type {type(url).__name__}")
    if not url or len(url) > 8192 or _BAD_URL_CHARS.search(url):
        raise RejectedEntry("bad_url", "empty, too long, or contains whitespace/control characters")
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise RejectedEntry("bad_url", str(exc)) from None
    if parts.scheme.lower() not in set(allowed_schemes):
        raise RejectedEntry("bad_scheme", f"scheme {parts.scheme!r} not allowed")
    if parts.scheme.lower() in ("http", "https") and not parts.hostname:
        raise RejectedEntry("bad_url", "no host")
    return url


def _headers(raw: Any) -> Headers:
    _expect(raw, list, "bad_headers", "headers")
    headers = Headers()
    for pair in raw:
        if not isinstance(pair, list) or len(pair) != 2:
            raise RejectedEntry("bad_headers", "header entry is not [name, values]")
        name, values = pair
        _expect(name, bytes, "bad_headers", "header name")
        _expect(values, list, "bad_headers", "header values")
        if not name or any(c in b"\r\n:" or c < 33 or c > 126 for c in name):
            raise RejectedEntry("header_injection", f"header name {name[:40]!r}")
        for v in values:
            _expect(v, bytes, "bad_headers", "header value")
            if b"\r" in v or b"\n" in v or b"\0" in v:
                raise RejectedEntry("header_injection", f"header {name[:40]!r} value has CR/LF/NUL")
        headers.setlist(name, values)
    return headers


def _request_class(path: Any) -> type[Request]:
    _expect(path, str, "bad_class", "class")
    module_name, _, name = path.rpartition(".")
    module = sys.modules.get(module_name)  # never import on behalf of untrusted data
    cls = getattr(module, name, None) if module is not None and "." not in name else None
    if not isinstance(cls, type) or not issubclass(cls, Request):
        raise RejectedEntry("bad_class", f"{path!r} is not a loaded Request subclass")
    return cls


def load_payload(data: bytes, max_bytes: int = 1024 * 1024) -> dict[str, Any]:
    """The field map of an untrusted payload: size, version byte, msgpack and field names checked
    (values are checked by :func:`decode_request`). Raises :class:`RejectedEntry`."""
    if len(data) > max_bytes:
        raise RejectedEntry("too_large", f"{len(data)} bytes")
    if not data or data[0] != VERSION:
        raise RejectedEntry("bad_version", f"first byte {data[:1]!r}")
    try:
        d = msgpack.unpackb(data[1:], raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage input
        raise RejectedEntry("bad_msgpack", type(exc).__name__) from None
    if not isinstance(d, dict):
        raise RejectedEntry("bad_payload", f"payload is a {type(d).__name__}")
    unknown = set(d) - _ALLOWED_KEYS
    if unknown:
        raise RejectedEntry("bad_payload", f"unknown fields {sorted(map(str, unknown))[:5]}")
    return d


def decode_request(
    data: bytes,
    spider: Spider,
    allowed_schemes: Iterable[str] = ("http", "https"),
    max_bytes: int = 1024 * 1024,
) -> Request:
    """Turn an untrusted payload back into a :class:`~scrapy.Request` bound to ``spider``'s methods.

    Raises :class:`RejectedEntry` with a short ``reason`` for anything that is not a valid payload.
    """
    d = load_payload(data, max_bytes)
    kw: dict[str, Any] = {"url": check_url(d.get("u"), allowed_schemes)}
    if "m" in d:
        method = _expect(d["m"], str, "bad_method", "method")
        if not method or len(method) > 32 or not all(c.isalnum() or c in "!#$%&'*+-.^_`|~" for c in method):
            raise RejectedEntry("bad_method", f"method {method[:40]!r} is not a token")
        kw["method"] = method
    if "h" in d:
        kw["headers"] = _headers(d["h"])
    if "b" in d:
        kw["body"] = _expect(d["b"], bytes, "bad_body", "body")
    if "c" in d:
        kw["cookies"] = _expect(d["c"], (dict, list), "bad_cookies", "cookies")
    if "M" in d:
        meta = _expect(d["M"], dict, "bad_meta", "meta")
        if not all(isinstance(k, str) for k in meta):
            raise RejectedEntry("bad_meta", "meta keys must be strings")
        kw["meta"] = meta
    if "k" in d:
        cbk = _expect(d["k"], dict, "bad_cb_kwargs", "cb_kwargs")
        if not all(isinstance(k, str) and k.isidentifier() for k in cbk):
            raise RejectedEntry("bad_cb_kwargs", "cb_kwargs keys must be identifiers")
        kw["cb_kwargs"] = cbk
    if "p" in d:
        kw["priority"] = _expect(d["p"], int, "bad_priority", "priority")
    if "d" in d:
        kw["dont_filter"] = _expect(d["d"], bool, "bad_dont_filter", "dont_filter")
    if "cb" in d:
        kw["callback"] = spider_method(spider, d["cb"], "callback")
    if "eb" in d:
        kw["errback"] = spider_method(spider, d["eb"], "errback")
    if "f" in d:
        flags = _expect(d["f"], list, "bad_flags", "flags")
        if not all(isinstance(f, str) for f in flags):
            raise RejectedEntry("bad_flags", "flags must be strings")
        kw["flags"] = flags
    if "e" in d:
        kw["encoding"] = _expect(d["e"], str, "bad_encoding", "encoding")
    cls = _request_class(d["C"]) if "C" in d else Request
    try:
        return cls(**kw)
    except Exception as exc:  # the Request constructor validates too (URL, encoding, ...)
        raise RejectedEntry("bad_request", f"{type(exc).__name__}: {exc}"[:200]) from None
