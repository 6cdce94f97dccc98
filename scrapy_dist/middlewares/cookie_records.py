"""How a cookie is kept in Redis by :class:`~scrapy_dist.middlewares.cookies.SharedCookiesMiddleware`:
the jar's name, the HASH field of a cookie and its JSON record, which is untrusted when read back and
checked field by field (``ValueError`` says what is wrong).

With the crawl's secret (``SCHEDULER_ENTRY_SECRET``), a record is sealed as queue entries are: a ``"tag"``
member, the keyed BLAKE2b of the jar's key, the field and the record, so a record written by anyone without
the secret -- or copied to another jar, cookie or crawl -- does not verify (:class:`RecordSeal`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from http.cookiejar import Cookie
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scrapy.http.cookies import CookieJar

    from scrapy_dist.redis.keys import CrawlKeys

__all__ = [
    "CookieIdent",
    "RecordSeal",
    "apply_record",
    "cookie_field",
    "cookie_from_record",
    "cookie_record",
    "jar_name",
    "snapshot",
    "write_calls",
]

_BOOL_FIELDS = ("port_specified", "domain_specified", "domain_initial_dot", "path_specified", "secure")
_OPTIONAL_STR_FIELDS = ("value", "port", "comment", "comment_url")

CookieIdent = tuple[str, str, str]


def jar_name(cookiejar: Any) -> str:
    """Name of the shared jar for a ``meta["cookiejar"]`` value: ``None`` -> ``"default"``, text as is,
    anything else by ``repr`` (so ``1`` and ``"1"`` share a jar: ids are compared as text)."""
    if cookiejar is None:
        return "default"
    return cookiejar if isinstance(cookiejar, str) else repr(cookiejar)


def cookie_field(ident: CookieIdent) -> str:
    """The HASH field of a cookie: JSON ``[domain, path, name]``."""
    return json.dumps(list(ident), separators=(",", ":"))


def cookie_record(cookie: Cookie) -> dict[str, Any]:
    """Everything needed to rebuild ``cookie`` on another worker, as a JSON-able dict."""
    return {
        "version": cookie.version,
        "name": cookie.name,
        "value": cookie.value,
        "port": cookie.port,
        "port_specified": cookie.port_specified,
        "domain": cookie.domain,
        "domain_specified": cookie.domain_specified,
        "domain_initial_dot": cookie.domain_initial_dot,
        "path": cookie.path,
        "path_specified": cookie.path_specified,
        "secure": cookie.secure,
        "expires": cookie.expires,
        "discard": cookie.discard,
        "comment": cookie.comment,
        "comment_url": cookie.comment_url,
        "rest": dict(cookie._rest),  # type: ignore[attr-defined]  # the only way to read all of them
        "rfc2109": cookie.rfc2109,
    }


def cookie_from_record(data: bytes | str) -> Cookie:
    """Rebuild a cookie from its stored JSON record; ``ValueError`` says what is wrong (untrusted input)."""
    try:
        rec = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(rec, dict):
        raise ValueError("not a JSON object")
    for name in ("name", "domain", "path"):
        if not isinstance(rec.get(name), str):
            raise ValueError(f"{name!r} must be a string")
    if not rec["name"]:
        raise ValueError("empty cookie name")
    for name in _OPTIONAL_STR_FIELDS:
        if not isinstance(rec.get(name), (str, type(None))):
            raise ValueError(f"{name!r} must be a string or null")
    for name in (*_BOOL_FIELDS, "discard", "rfc2109"):
        if not isinstance(rec.get(name, False), bool):
            raise ValueError(f"{name!r} must be a boolean")
    version = rec.get("version", 0)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError("'version' must be a non-negative integer")
    expires = rec.get("expires")
    if expires is not None and (isinstance(expires, bool) or not isinstance(expires, int)):
        raise ValueError("'expires' must be an integer or null")
    rest = rec.get("rest") or {}
    if not isinstance(rest, dict) or not all(
        isinstance(k, str) and isinstance(v, (str, type(None))) for k, v in rest.items()
    ):
        raise ValueError("'rest' must map strings to strings or null")
    return Cookie(
        version=version,
        name=rec["name"],
        value=rec.get("value"),
        port=rec.get("port"),
        port_specified=rec.get("port_specified", False),
        domain=rec["domain"],
        domain_specified=rec.get("domain_specified", False),
        domain_initial_dot=rec.get("domain_initial_dot", False),
        path=rec["path"],
        path_specified=rec.get("path_specified", False),
        secure=rec.get("secure", False),
        expires=expires,
        discard=rec.get("discard", False),
        comment=rec.get("comment"),
        comment_url=rec.get("comment_url"),
        rest=rest,
        rfc2109=rec.get("rfc2109", False),
    )


@dataclass(frozen=True)
class RecordSeal:
    """Which records of a jar a worker believes: with a ``secret``, those whose tag verifies -- and, if
    ``unsigned_ok`` (the crawl lets untrusted entries set cookies: ``SEEDS_HEADERS_ALLOWED`` names
    ``Cookie``), also those without a tag; without a secret, every record, as every queue entry."""

    secret: bytes | None = None
    unsigned_ok: bool = True

    def _tag(self, jar_key: str, field: str, body: str) -> str:
        assert self.secret is not None
        key = self.secret if len(self.secret) <= 64 else hashlib.blake2b(self.secret).digest()
        message = b"\0".join((b"cookie", jar_key.encode(), field.encode(), body.encode()))
        return hashlib.blake2b(message, key=key, digest_size=16).hexdigest()

    def seal(self, jar_key: str, field: str, record: dict[str, Any]) -> str:
        """The JSON text of ``record`` to write at ``field`` of ``jar_key``, tagged if there is a secret."""
        body = json.dumps(record, separators=(",", ":"))
        if self.secret is None:
            return body
        return json.dumps({**record, "tag": self._tag(jar_key, field, body)}, separators=(",", ":"))

    def open(self, jar_key: str, field: str, data: bytes | str) -> Cookie:
        """The cookie of a record read from Redis; ``ValueError`` if it is invalid or not to be believed."""
        cookie = cookie_from_record(data)
        if self.secret is None:
            return cookie
        rec = json.loads(data)
        tag = rec.pop("tag", None)
        if tag is None:
            if self.unsigned_ok:
                return cookie
            raise ValueError(
                "no tag: a record the crawl's workers did not write (with SCHEDULER_ENTRY_SECRET set,"
                " cookies may come from elsewhere only if SEEDS_HEADERS_ALLOWED names Cookie)"
            )
        body = json.dumps(rec, separators=(",", ":"))
        if not isinstance(tag, str) or not hmac.compare_digest(tag, self._tag(jar_key, field, body)):
            raise ValueError("its tag does not verify with the crawl's secret (SCHEDULER_ENTRY_SECRET)")
        return cookie


def snapshot(jar: CookieJar) -> dict[CookieIdent, dict[str, Any]]:
    """Every cookie of ``jar`` as its record, by (domain, path, name)."""
    return {(c.domain, c.path, c.name): cookie_record(c) for c in jar}


def apply_record(jar: CookieJar, field: str, record: str | None) -> None:
    """Apply one change read from (or about to go to) Redis to ``jar``: set the cookie of ``record``, or
    with ``None`` delete the cookie of HASH ``field``."""
    if record is None:
        try:
            domain, path, cookie_name = json.loads(field)
            jar.clear(domain, path, cookie_name)
        except (ValueError, TypeError, KeyError):  # already gone, or not a field we write
            pass
    else:
        jar.set_cookie(cookie_from_record(record))


def write_calls(
    keys: CrawlKeys, ops: list[tuple[str, str, str | None]], now: str
) -> tuple[list[tuple[list[str], list[str]]], int]:
    """The ``cookies_write`` script calls (KEYS, ARGV) for ``ops`` (jar name, HASH field, record or
    ``None`` to delete): one per jar, the last change of a cookie winning; and how many cookies they write.
    """
    by_jar: dict[str, dict[str, str | None]] = {}
    for name, field, record in ops:
        by_jar.setdefault(name, {})[field] = record
    calls: list[tuple[list[str], list[str]]] = []
    for name, fields in by_jar.items():
        sets = [(f, r) for f, r in fields.items() if r is not None]
        args: list[str] = [name, now, str(len(sets))]
        for f, r in sets:
            args += [f, r]
        args += [f for f, r in fields.items() if r is None]
        calls.append(([keys.cookie_jar(name), keys.cookie_changes(name), keys.cookies], args))
    return calls, sum(len(f) for f in by_jar.values())
