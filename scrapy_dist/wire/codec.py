"""The wire format of a request in Redis (docs/frontier.md, "Wire format"): ``b"\x01" + msgpack(map)``, or
``b"\x03" + tag + nonce + msgpack(map)`` when signed (:mod:`scrapy_dist.wire.entrypolicy`). Decoding treats
the bytes as untrusted: any deviation is :class:`RejectedEntry` with a short reason, and nothing else."""

from __future__ import annotations

import base64
import codecs
import inspect
import json
import math
import re
import sys
import time
import types
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import msgpack
from scrapy import Request
from scrapy.http import Headers
from scrapy.spiders import CrawlSpider

from scrapy_dist.exceptions import RejectedEntry, UnserializableRequest
from scrapy_dist.wire.entrypolicy import (
    COOKIE_KEYS,
    DANGEROUS_META,  # noqa: F401 - re-exported (docs/security.md)
    DEFAULT_POLICY,
    PRIORITY_RANGE,
    EntryPolicy,
    added_by_middleware,
    check_cookies_allowed,
    check_header_names,
    check_meta_keys,
    check_no_userinfo,
    check_offsite,
    is_trusted,
    split_payload,
)

if TYPE_CHECKING:
    from scrapy import Spider


_CRAWLSPIDER_METHODS = frozenset({"_callback", "_errback"})  #: CrawlSpider's rule dispatchers (index in meta)
_RULE_METHODS = frozenset({"rule_callback", "rule_errback"})  #: ours (so not user-defined) in their place


def method_name(func: Any, spider: Spider | None, what: str) -> str | None:
    """The name stored for callback/errback ``func``: a method of ``spider``, or a name."""
    if func is None or isinstance(func, str):
        return func
    owner, name = getattr(func, "__self__", None), getattr(func, "__name__", None)
    bound_to_spider = owner is not None and (spider is None or owner is spider)
    if bound_to_spider and name and getattr(owner, name, None) == func:
        return str(name)
    raise UnserializableRequest(f"{what} {func!r} is not a method of the spider", what)


#: Scrapy's hooks and spider plumbing: never a callback, even where the spider's own code overrides them
HOOK_NAMES = frozenset({"start", "start_requests", "closed", "close", "log", "make_request_from_data",
                        "from_crawler", "update_settings", "handles_request", "set_crawler",
                        "make_requests_from_url", "parse_start_url", "process_results", "process_start",
                        "process_start_requests", "spider_opened", "spider_idle", "spider_closed",
                        "has_callback"})


def user_defined(cls: type, name: str) -> bool:
    """Whether ``name`` is a plain function of the user's classes, not a hook: all an entry may call."""
    if not isinstance(name, str) or name.startswith("_") or not name.isidentifier() or name in HOOK_NAMES:
        return False
    for klass in cls.__mro__:
        if name in vars(klass):
            module = klass.__module__
            framework = not isinstance(module, str) or module.split(".", 1)[0] in ("scrapy", "scrapy_dist")
            return isinstance(inspect.getattr_static(klass, name), types.FunctionType) and not framework
    return False


def spider_method(spider: Spider, name: Any, what: str) -> Any:
    """Resolve ``name`` to a public method of ``spider``; reject anything else (shared with seeds)."""
    if not isinstance(name, str):  # checked first: a list or map is not even hashable
        raise RejectedEntry(f"bad_{what}", f"{what} has type {type(name).__name__}")
    rule_dispatcher = name in _CRAWLSPIDER_METHODS and isinstance(spider, CrawlSpider)
    if not rule_dispatcher and (not name.isidentifier() or name.startswith("_")):
        raise RejectedEntry(f"bad_{what}", f"{what} {name[:40]!r} is not a public method name")
    method = getattr(spider, name, None)
    if method is None or not callable(method) or getattr(method, "__self__", None) is not spider:
        raise RejectedEntry(f"bad_{what}", f"spider has no method {name[:40]!r}")
    return method


def entry_callback(spider: Spider, name: Any, what: str) -> Any:
    """The callback/errback a queue entry names: a method of the spider's code, or a rule dispatcher."""
    method = spider_method(spider, name, what)
    rule_method = isinstance(spider, CrawlSpider) and (name in _CRAWLSPIDER_METHODS or name in _RULE_METHODS)
    if not rule_method and not user_defined(type(spider), name):
        raise RejectedEntry(f"bad_{what}", f"{name!r} is not a method defined by the spider's code")
    return method


_PLAIN_TYPES = (str, bytes, int, float, bool, type(None))
_ALLOWED_KEYS = frozenset(["u", "m", "h", "b", "c", "M", "k", "p", "d", "cb", "eb", "f", "e", "C"])
BAD_URL_CHARS = re.compile(r"[\x00-\x20\x7f]")  #: whitespace and controls: in no URL of an entry or seed
MAX_HEADERS = 100


def _check_encodable(value: Any, path: str) -> None:
    """Raise :class:`UnserializableRequest` naming the first part of ``value`` msgpack cannot hold."""
    if isinstance(value, _PLAIN_TYPES):
        if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
            raise UnserializableRequest(f"{path}: integer out of range", path)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_encodable(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, bytes, int)):
                raise UnserializableRequest(f"{path}: key {k!r} is a {type(k).__name__}", path)
            _check_encodable(v, f"{path}.{k}" if isinstance(k, str) else f"{path}[{k!r}]")
    else:
        raise UnserializableRequest(f"{path} holds a {type(value).__name__}, which cannot be encoded", path)


def encode_request(request: Request, spider: Spider | None = None, policy: EntryPolicy | None = None
                   ) -> bytes:
    """``request`` as a payload (signed when ``policy`` has a secret), or :class:`UnserializableRequest`."""
    headers = [[bytes(k), [bytes(v) for v in vs if not added_by_middleware(k, v)]]  # a middleware's stay out
               for k, vs in request.headers.items()]
    cls = type(request)
    fields = {  # in this order; an empty, false or default value is left out
        "u": request.url, "m": request.method if request.method != "GET" else None,
        "h": [pair for pair in headers if pair[1]], "b": request.body, "c": request.cookies,
        "M": request.meta, "k": request.cb_kwargs, "p": request.priority, "d": request.dont_filter,
        "cb": method_name(request.callback, spider, "callback"),
        "eb": method_name(request.errback, spider, "errback"),
        "f": list(request.flags), "e": request.encoding if request.encoding != "utf-8" else None,
        "C": f"{cls.__module__}.{cls.__qualname__}" if cls is not Request else None}
    d = {key: value for key, value in fields.items() if value}
    try:
        body = msgpack.packb(d, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        for field, label in (("M", "meta"), ("k", "cb_kwargs"), ("c", "cookies")):
            if field in d:
                _check_encodable(d[field], label)
        raise UnserializableRequest("request cannot be encoded", "request") from None
    return (policy or DEFAULT_POLICY).seal(body)


def _expect(value: Any, types_: type, reason: str, field: str) -> Any:
    """``value`` if it is a ``types_`` (a bool only where ``types_`` is bool), else :class:`RejectedEntry`."""
    if not isinstance(value, types_) or (isinstance(value, bool) and types_ is not bool):
        raise RejectedEntry(reason, f"{field} has type {type(value).__name__}")
    return value


def check_url(url: Any, allowed_schemes: Iterable[str]) -> str:
    """An untrusted URL string, checked: type, length, scheme, host, no whitespace/control chars."""
    if not isinstance(url, str):
        raise RejectedEntry("bad_url", f"url has type {type(url).__name__}")
    if not url or len(url) > 8192 or BAD_URL_CHARS.search(url):
        raise RejectedEntry("bad_url", "empty, too long, or contains whitespace/control characters")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError as exc:
        raise RejectedEntry("bad_url", str(exc)[:100]) from None
    if parts.scheme.lower() not in set(allowed_schemes):
        raise RejectedEntry("bad_scheme", f"scheme {parts.scheme[:20]!r} not allowed")
    if parts.scheme.lower() in ("http", "https") and not parts.hostname:
        raise RejectedEntry("bad_url", "no host")
    return url


def _headers(raw: Any) -> Headers:
    _expect(raw, list, "bad_headers", "headers")
    if len(raw) > MAX_HEADERS:
        raise RejectedEntry("bad_headers", f"{len(raw)} headers (at most {MAX_HEADERS})")
    headers = Headers()
    for pair in raw:
        if not isinstance(pair, list) or len(pair) != 2:
            raise RejectedEntry("bad_headers", "header entry is not [name, values]")
        name, values = pair
        _expect(name, bytes, "bad_headers", "header name")
        _expect(values, list, "bad_headers", "header values")
        if not name or any(c in b"\r\n:" or c < 33 or c > 126 for c in name):
            raise RejectedEntry("header_injection", f"header name {name[:40]!r}")
        if len(values) > MAX_HEADERS:
            raise RejectedEntry("bad_headers", f"header {name[:40]!r} has {len(values)} values")
        for v in values:
            _expect(v, bytes, "bad_headers", "header value")
            if b"\r" in v or b"\n" in v or b"\0" in v:
                raise RejectedEntry("header_injection", f"header {name[:40]!r} value has CR/LF/NUL")
        headers.setlist(name, values)
    return headers


def _cookie_text(value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (str, bytes, int, float)):
        raise RejectedEntry("bad_cookies", f"cookie {what} has type {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise RejectedEntry("bad_cookies", f"cookie {what} is not finite")
    if isinstance(value, (str, bytes)):
        text = value if isinstance(value, str) else value.decode("latin-1")
        if any(c in text for c in "\r\n\0;"):
            raise RejectedEntry("header_injection", f"cookie {what} holds CR/LF/NUL or ';'")


def _cookies(raw: Any) -> dict[str, Any] | list[dict[str, Any]]:
    """Cookies as Scrapy's ``Request`` takes them: ``{name: value}`` or a list of cookie maps."""
    if isinstance(raw, (dict, list)) and len(raw) > MAX_HEADERS:
        raise RejectedEntry("bad_cookies", f"{len(raw)} cookies (at most {MAX_HEADERS})")
    if isinstance(raw, dict):
        for name, value in raw.items():
            _cookie_text(name, "name")
            _cookie_text(value, "value")
        return raw
    if isinstance(raw, list):
        for c in raw:
            if not isinstance(c, dict) or "name" not in c or "value" not in c or not set(c) <= COOKIE_KEYS:
                raise RejectedEntry("bad_cookies", "each cookie must be a map with name, value (domain, ...)")
            for key, value in c.items():
                if key == "secure":
                    _expect(value, bool, "bad_cookies", "cookie secure")
                else:
                    _cookie_text(value, key)
        return raw
    raise RejectedEntry("bad_cookies", f"cookies has type {type(raw).__name__}")


def _request_class(path: Any) -> type[Request]:
    _expect(path, str, "bad_class", "class")
    module_name, _, name = path.rpartition(".")
    module = sys.modules.get(module_name)  # never import on behalf of untrusted data
    cls = getattr(module, name, None) if module is not None and "." not in name else None
    if not isinstance(cls, type) or not issubclass(cls, Request):
        raise RejectedEntry("bad_class", f"{path[:80]!r} is not a loaded Request subclass")
    return cls


def load_payload(data: bytes, max_bytes: int = 1024 * 1024) -> dict[str, Any]:
    """The field map of an untrusted payload: size, version, msgpack and field names checked, not values."""
    body = split_payload(data, max_bytes)[1]
    try:
        d = msgpack.unpackb(body, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage input
        raise RejectedEntry("bad_msgpack", type(exc).__name__) from None
    if not isinstance(d, dict):
        raise RejectedEntry("bad_payload", f"payload is a {type(d).__name__}")
    if unknown := [k for k in d if not isinstance(k, str) or k not in _ALLOWED_KEYS]:
        raise RejectedEntry("bad_payload", f"unknown fields {sorted(map(str, unknown))[:5]}"[:200])
    return d


def decode_request(data: bytes, spider: Spider, policy: EntryPolicy = DEFAULT_POLICY) -> Request:
    """An untrusted payload as a Request bound to ``spider``'s methods, else :class:`RejectedEntry` only."""
    try:
        return _decode(data, spider, policy)
    except RejectedEntry:
        raise
    except Exception as exc:  # a check we did not think of must still not stop a worker
        raise RejectedEntry("bad_entry", f"{type(exc).__name__}: {exc}"[:200]) from None


def _decode(data: bytes, spider: Spider, policy: EntryPolicy) -> Request:
    d = load_payload(data, policy.max_bytes)
    trusted = is_trusted(data, policy)
    url = check_url(d.get("u"), policy.allowed_schemes)
    if not trusted:
        check_no_userinfo(url)
    kw: dict[str, Any] = {"url": url}
    if "m" in d:
        kw["method"] = method = _expect(d["m"], str, "bad_method", "method")
        if not method or len(method) > 32 or not all(c.isalnum() or c in "!#$%&'*+-.^_`|~" for c in method):
            raise RejectedEntry("bad_method", f"method {method[:40]!r} is not a token")
    if "h" in d:
        kw["headers"] = _headers(d["h"])
        if not trusted:
            check_header_names(kw["headers"].keys(), policy.headers_allowed)
    if "b" in d:
        kw["body"] = _expect(d["b"], bytes, "bad_body", "body")
    if "c" in d:
        kw["cookies"] = _cookies(d["c"])
        if not trusted:
            check_cookies_allowed(policy.headers_allowed)
    if "M" in d:
        kw["meta"] = meta = _expect(d["M"], dict, "bad_meta", "meta")
        if not all(isinstance(k, str) for k in meta):
            raise RejectedEntry("bad_meta", "meta keys must be strings")
        if not trusted:
            check_meta_keys(meta, policy.meta_allowed)
    if "k" in d:
        kw["cb_kwargs"] = cbk = _expect(d["k"], dict, "bad_cb_kwargs", "cb_kwargs")
        if not all(isinstance(k, str) and k.isidentifier() for k in cbk):
            raise RejectedEntry("bad_cb_kwargs", "cb_kwargs keys must be identifiers")
    if "p" in d:
        kw["priority"] = priority = _expect(d["p"], int, "bad_priority", "priority")
        if not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
            raise RejectedEntry("bad_priority", "priority out of the 32-bit range")
    if "d" in d:
        kw["dont_filter"] = _expect(d["d"], bool, "bad_dont_filter", "dont_filter")
    if "cb" in d:
        kw["callback"] = entry_callback(spider, d["cb"], "callback")
    if "eb" in d:
        kw["errback"] = entry_callback(spider, d["eb"], "errback")
    if "f" in d:
        kw["flags"] = flags = _expect(d["f"], list, "bad_flags", "flags")
        if len(flags) > MAX_HEADERS or not all(isinstance(f, str) for f in flags):
            raise RejectedEntry("bad_flags", "flags must be at most 100 strings")
    if "e" in d:
        kw["encoding"] = encoding = _expect(d["e"], str, "bad_encoding", "encoding")
        try:
            known = codecs.lookup(encoding)._is_text_encoding  # type: ignore[attr-defined]
        except LookupError:
            known = False
        if not known:
            raise RejectedEntry("bad_encoding", f"{encoding[:40]!r} is not a text encoding")
    cls = _request_class(d["C"]) if "C" in d else Request
    if not trusted:
        check_offsite(url, spider)
    try:
        return cls(**kw)
    except Exception as exc:  # the Request constructor validates too (URL, encoding, ...)
        raise RejectedEntry("bad_request", f"{type(exc).__name__}: {exc}"[:200]) from None


def preview(raw: bytes | str, limit: int = 100, quote: bool = True) -> str:
    """At most ``limit`` characters of refused input for a log line, unprintable ones escaped."""
    text = raw[: limit * 4].decode("utf-8", "backslashreplace") if isinstance(raw, bytes) else raw
    cut = len(text) > limit or len(raw) > limit * 4
    shown = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"
                    for c in text[:limit])
    if quote:
        return "'" + shown.replace("'", "\\'") + ("'…" if cut else "'")
    return shown + ("…" if cut else "")


def rejection_record(reason: str, raw: bytes, worker: str, detail: str = "", now: float | None = None) -> str:
    """The JSON record pushed to a ``:rejected`` key."""
    head = raw[:1024]  # what a record keeps of a refused entry
    try:
        text, enc = head.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        text, enc = base64.b64encode(head).decode("ascii"), "base64"
    return json.dumps({"reason": reason, "detail": detail[:500], "raw": text, "raw_encoding": enc,
                       "raw_bytes": len(raw), "at": time.time() if now is None else now, "worker": worker})
