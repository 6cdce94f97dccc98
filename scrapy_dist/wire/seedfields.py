"""The checks every field of a seed (or a queue entry's header, priority, cookies) must pass: what the
parser of :mod:`scrapy_dist.seeds` applies to each field; each raises
:class:`~scrapy_dist.exceptions.RejectedEntry` with the field's reason (``bad_method``, ``bad_headers``,
``bad_priority``, ``bad_callback``, ``bad_cookies``...)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from scrapy_dist.exceptions import RejectedEntry

_PRIORITY_RANGE = (-(2**31), 2**31 - 1)
_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def check_text(s: str, reason: str, what: str) -> None:
    """Strings from JSON may hold lone surrogates (``"\\ud800"``), which no encoder accepts later."""
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise RejectedEntry(reason, f"{what} holds a lone surrogate") from None


def json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


def check_method(method: Any) -> str:
    """An HTTP method must be a token (RFC 9110), at most 32 characters; returned upper-cased."""
    if not isinstance(method, str) or not method or len(method) > 32 or not set(method) <= _TOKEN_CHARS:
        raise RejectedEntry("bad_method", f"method {str(method)[:40]!r} is not an HTTP token")
    return method.upper()


def _check_header_text(text: str, what: str) -> None:
    if "\r" in text or "\n" in text or "\0" in text:
        raise RejectedEntry("header_injection", f"CR/LF/NUL in {what} {text[:40]!r}")


def check_headers(headers: Any) -> dict[str, list[str]]:
    """``{"Name": "value" | ["v1", "v2"]}``; names are tokens, values hold no CR/LF/NUL."""
    if not isinstance(headers, dict):
        raise RejectedEntry("bad_headers", f"headers is a {json_type(headers)}, expected an object")
    if len(headers) > 100:
        raise RejectedEntry("bad_headers", f"{len(headers)} headers (at most 100)")
    out: dict[str, list[str]] = {}
    for name, values in headers.items():
        _check_header_text(name, "header name")
        if not name or not set(name) <= _TOKEN_CHARS:
            raise RejectedEntry("bad_headers", f"header name {name[:40]!r} is not a token")
        if isinstance(values, str):
            values = [values]
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise RejectedEntry("bad_headers", f"header {name[:40]!r}: values must be strings")
        for v in values:
            _check_header_text(v, f"header {name[:40]!r} value")
            check_text(v, "bad_headers", "header value")
            if any(ord(c) < 32 and c != "\t" or ord(c) == 127 for c in v):
                raise RejectedEntry("bad_headers", f"header {name[:40]!r} value has control characters")
        out[name] = values
    return out


def check_priority(priority: Any) -> int:
    """An integer (not a boolean, not a float) in the 32-bit range."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise RejectedEntry("bad_priority", f"priority is a {json_type(priority)}, expected an integer")
    if not _PRIORITY_RANGE[0] <= priority <= _PRIORITY_RANGE[1]:
        raise RejectedEntry("bad_priority", "priority out of the 32-bit range")
    return priority


def priority_from_score(score: float) -> int:
    """A ZSET score as a request priority (rounded, clamped to the 32-bit range, NaN -> 0)."""
    if math.isnan(score):
        return 0
    return round(max(_PRIORITY_RANGE[0], min(_PRIORITY_RANGE[1], score)))


def check_callback_name(name: Any, what: str, has_callback: Callable[[str], bool] | None = None) -> str:
    """A public method name (identifier, no leading underscore) the spider has, if ``has_callback`` can
    tell."""
    if not isinstance(name, str) or not name.isidentifier() or not name.isascii() or name.startswith("_"):
        raise RejectedEntry(f"bad_{what}", f"{what} {str(name)[:40]!r} is not a public method name")
    if has_callback is not None and not has_callback(name):
        raise RejectedEntry(f"bad_{what}", f"the spider has no callback method {name!r}")
    return name


_COOKIE_KEYS = frozenset({"name", "value", "domain", "path", "secure", "expires"})


def _check_cookie_text(value: Any, what: str) -> None:
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise RejectedEntry("bad_cookies", f"cookie {what} is a {json_type(value)}")
    if isinstance(value, str):
        _check_header_text(value, f"cookie {what}")
        check_text(value, "bad_cookies", f"cookie {what}")
        if ";" in value:
            raise RejectedEntry("bad_cookies", f"';' in cookie {what} {value[:40]!r}")
    elif isinstance(value, float) and not math.isfinite(value):
        raise RejectedEntry("bad_cookies", f"cookie {what} is not finite")


def check_cookies(cookies: Any) -> dict[str, Any] | list[dict[str, Any]]:
    """``{"name": "value"}`` or ``[{"name": ..., "value": ..., "domain": ..., "path": ...}]``."""
    if isinstance(cookies, dict):
        for name, value in cookies.items():
            _check_cookie_text(name, "name")
            if not name or "=" in name:
                raise RejectedEntry("bad_cookies", f"cookie name {name[:40]!r}")
            _check_cookie_text(value, "value")
        return cookies
    if isinstance(cookies, list):
        for c in cookies:
            if not isinstance(c, dict) or "name" not in c or "value" not in c or set(c) - _COOKIE_KEYS:
                raise RejectedEntry(
                    "bad_cookies", "each cookie must be an object with name, value (domain, path, ...)"
                )
            for key, value in c.items():
                if key == "secure":
                    if not isinstance(value, bool):
                        raise RejectedEntry("bad_cookies", "cookie secure must be true/false")
                else:
                    _check_cookie_text(value, key)
            if not isinstance(c["name"], str) or not c["name"] or "=" in c["name"]:
                raise RejectedEntry("bad_cookies", f"cookie name {str(c['name'])[:40]!r}")
        return cookies
    raise RejectedEntry("bad_cookies", f"cookies is a {json_type(cookies)}, expected an object or an array")
