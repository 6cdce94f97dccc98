"""What an untrusted entry may carry: the entry policy and the crawl's secret telling its own entries from
others', credential headers a middleware added (never stored), seed field checks. A tag is the keyed BLAKE2b
of crawl, key kind, nonce and body: copied to another crawl, or from dead letters to the queue, it fails."""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import hmac
import itertools
import logging
import math
import os
import secrets
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from scrapy_dist.exceptions import RejectedEntry
from scrapy_dist.redis.target import embedded_secret
from scrapy_dist.settings import DistSettings

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.crawler import Crawler

#: version bytes: unauthenticated, tag of the body only (read as untrusted), signed (crawl, kind and nonce)
VERSION, VERSION_BODY_TAG, VERSION_SIGNED = 1, 2, 3
TAG_BYTES, NONCE_BYTES = 16, 8
SIGNED_HEAD = 1 + TAG_BYTES + NONCE_BYTES  #: bytes before the msgpack body of a version-3 payload
FRONTIER, DEAD = "frontier", "dead"  #: the kinds of key an entry is signed for
_VERSION_BYTE, _SIGNED_BYTE = bytes([VERSION]), bytes([VERSION_SIGNED])


def _fresh_nonces() -> None:
    """Nonces from a random 64-bit start, one more per entry; a forked child must not repeat its parent's."""
    global _NONCES
    _NONCES = itertools.count(int.from_bytes(secrets.token_bytes(8), "big"))


_NONCES: itertools.count[int]
_fresh_nonces()
os.register_at_fork(after_in_child=_fresh_nonces)

#: Meta keys an untrusted entry may set only if SEEDS_META_ALLOWED names them exactly: they route the
#: request, carry credentials, switch safety checks off or reach into Scrapy's state (retry counters...).
DANGEROUS_META = ("proxy", "_*", "bindaddress", "download_slot", "ftp_*", "cookiejar",
                  "handle_httpstatus_all", "dont_*", "allow_offsite", "download_maxsize", "download_warnsize",
                  "download_timeout", "max_retry_times", "retry_times", "priority_adjust",
                  "give_up_log_level", "redirect_times", "redirect_ttl", "redirect_urls", "redirect_reasons",
                  "splash", "playwright*", "zyte_api*", "impersonate", "is_start_request", "depth",
                  "revisit_after")
#: Headers an untrusted entry may never set: they frame the message or route it.
FORBIDDEN_HEADERS = ("host", "content-length", "transfer-encoding", "connection", "proxy-*", "te", "upgrade",
                     "keep-alive", "trailer", "expect", "x-forwarded-*", "forwarded")
CREDENTIAL_HEADERS = ("authorization", "cookie")  #: an entry's only if SEEDS_HEADERS_ALLOWED names them


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def check_meta_keys(meta: dict[Any, Any], allowed: Iterable[str]) -> None:
    """Refuse a meta key matching no pattern of ``allowed``, or a :data:`DANGEROUS_META` one it lacks."""
    allowed = tuple(allowed)
    for key in meta:
        name = str(key)
        if not _matches(name, allowed) or (_matches(name, DANGEROUS_META) and name not in allowed):
            raise RejectedEntry("meta_not_allowed", f"meta key {name[:40]!r} is not allowed"
                                                    " (SEEDS_META_ALLOWED)")


def check_header_names(names: Iterable[Any], allowed: Iterable[str]) -> None:
    """Refuse (``header_not_allowed``) framing/routing headers, and credential ones ``allowed`` lacks."""
    allowed_l = {a.lower() for a in allowed}
    for raw in names:
        name = (raw.decode("latin-1") if isinstance(raw, bytes) else str(raw)).lower()
        if _matches(name, FORBIDDEN_HEADERS) or (name in CREDENTIAL_HEADERS and name not in allowed_l):
            raise RejectedEntry("header_not_allowed", f"header {name[:40]!r} may not come from an entry")


def check_cookies_allowed(allowed: Iterable[str]) -> None:
    """Refuse an untrusted entry's cookies unless ``allowed`` names ``Cookie`` (they join the crawl's jar)."""
    if "cookie" not in {a.lower() for a in allowed}:
        raise RejectedEntry("header_not_allowed", "cookies may not come from an entry"
                                                  " (SEEDS_HEADERS_ALLOWED: no Cookie)")


def check_no_userinfo(url: str) -> None:
    """Refuse an ``@`` in the authority: no credentials from an entry, and for ``a\\@b`` parsers disagree."""
    authority = url.partition("://")[2]
    for end in "/?#":
        authority = authority.partition(end)[0]
    if "@" in authority:
        raise RejectedEntry("bad_url", "'@' before the host: credentials may not come from an entry")


def keep_allowed_domains(spider: Any) -> Any:
    """The spider's ``allowed_domains``, an iterator kept as a list (exhausted, it would allow every host)."""
    if isinstance(domains := getattr(spider, "allowed_domains", None), str):
        return [domains]
    if domains is not None and not isinstance(domains, (list, tuple, set, frozenset)):
        domains = spider.allowed_domains = list(domains)
    return domains


def check_offsite(url: str, spider: Any) -> None:
    """Refuse (``offsite``) a host not in or below the spider's ``allowed_domains`` (``dont_filter`` too)."""
    domains = [d.lower().lstrip(".") for d in keep_allowed_domains(spider) or () if isinstance(d, str) and d]
    if not domains:  # most spiders: no URL parsed on the decode path
        return
    try:
        host = (urlsplit(url).hostname or "").rstrip(".")
    except ValueError:
        host = ""  # allowed nowhere
    if not any(host == d or host.endswith("." + d) for d in domains):
        raise RejectedEntry("offsite", f"host of {url[:80]!r} is not in the spider's allowed_domains")


@dataclass(frozen=True)
class EntryPolicy:
    """What an entry read from the queue must satisfy, and the secret that tells the crawl's own entries."""

    allowed_schemes: tuple[str, ...] = ("http", "https")
    max_bytes: int = 1024 * 1024
    meta_allowed: tuple[str, ...] = ("*",)  # fnmatch patterns of the meta keys an untrusted entry may set
    headers_allowed: tuple[str, ...] = ()  # credential headers (Authorization, Cookie) it may set
    secret: bytes | None = None  # the crawl's secret; None: every queue entry counts as the crawl's own
    crawl: str = ""  # the crawl the tags are bound to (shard 0's CrawlKeys.tag: <prefix>{<spider>})
    kind: str = FRONTIER  # the kind of key the entries are signed for: FRONTIER or DEAD

    @classmethod
    def from_dist(cls, ds: DistSettings) -> EntryPolicy:
        """The policy of a crawl's settings (without a secret, the embedded Redis's own)."""
        return cls(allowed_schemes=ds.scheduler.allowed_schemes, max_bytes=ds.scheduler.max_entry_bytes,
                   meta_allowed=ds.seeds.meta_allowed, headers_allowed=ds.seeds.headers_allowed,
                   secret=ds.scheduler.entry_secret or embedded_secret(ds))

    def bound(self, crawl: str | None = None, kind: str | None = None) -> EntryPolicy:
        """This policy signing and verifying for ``crawl`` and ``kind`` (None: unchanged)."""
        return dataclasses.replace(self, crawl=crawl or self.crawl, kind=kind or self.kind)

    @cached_property
    def _keyed(self) -> Any:
        assert self.secret is not None
        key = self.secret if len(self.secret) <= 64 else hashlib.blake2b(self.secret).digest()
        h = hashlib.blake2b(key=key, digest_size=TAG_BYTES)
        context = f"{self.kind}\0{self.crawl}".encode("utf-8", "surrogatepass")
        h.update(b"scrapy-dist entry\0" + len(context).to_bytes(4, "big") + context)
        return h

    def tag(self, nonce: bytes, body: bytes) -> bytes:
        """The tag of ``nonce`` and a msgpack body for this policy's crawl and kind (requires a secret)."""
        h = self._keyed.copy()
        h.update(nonce)
        h.update(body)  # not nonce + body: no copy of the body
        return h.digest()

    def seal(self, body: bytes, nonce: bytes | None = None) -> bytes:
        """A payload of ``body``: signed (with a fresh nonce unless given) if there is a secret, else v1."""
        if self.secret is None:
            return _VERSION_BYTE + body
        if nonce is None:
            nonce = (next(_NONCES) % 2**64).to_bytes(NONCE_BYTES, "big")
        return _SIGNED_BYTE + self.tag(nonce, body) + nonce + body

    def verify(self, data: bytes) -> bool:
        """Whether ``data`` is a version-3 payload whose tag verifies for this secret, crawl and kind."""
        if self.secret is None or len(data) < SIGNED_HEAD or data[0] != VERSION_SIGNED:
            return False
        nonce = data[1 + TAG_BYTES : SIGNED_HEAD]
        return hmac.compare_digest(data[1 : 1 + TAG_BYTES], self.tag(nonce, data[SIGNED_HEAD:]))

    def renew(self, data: bytes) -> bytes:
        """``data`` with a fresh nonce if this policy verifies it (a revisit is a new entry), else as is."""
        return self.seal(data[SIGNED_HEAD:]) if self.verify(data) else data


DEFAULT_POLICY = EntryPolicy()
_POLICIES: weakref.WeakKeyDictionary[Any, EntryPolicy] = weakref.WeakKeyDictionary()
_warned_unsigned: list[bool] = []


def entry_policy(crawler: Crawler | None) -> EntryPolicy:
    if crawler is None:
        return DEFAULT_POLICY
    if crawler in _POLICIES:
        return _POLICIES[crawler]
    ds = DistSettings.for_crawler(crawler)
    policy = _POLICIES[crawler] = EntryPolicy.from_dist(ds)
    if policy.secret is None and not _warned_unsigned:  # one WARNING per process
        _warned_unsigned.append(True)
        logging.getLogger(__name__).warning(
            "No SCHEDULER_ENTRY_SECRET (or SCRAPY_DIST_SECRET) set while using a shared Redis (from %s):"
            " anyone who can write to it can make the workers send requests through their proxy, with any"
            " Host header and your spider's Authorization header and cookies. Set the same secret on every"
            " worker, e.g. SCRAPY_DIST_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')"
            " (docs/security.md)", ds.connection.source)
    return policy


def is_trusted(data: bytes, policy: EntryPolicy) -> bool:
    """Whether an entry is the crawl's own (its tag verifies, or no secret); ``bad_tag`` if a tag fails."""
    if policy.secret is None:
        return True
    if data[:1] != _SIGNED_BYTE:
        return False
    if not policy.verify(data):
        raise RejectedEntry("bad_tag", "the entry's tag does not verify for this crawl"
                                       " (another secret, crawl or kind of key)")
    return True


def split_payload(data: bytes, max_bytes: int = 1024 * 1024) -> tuple[int, bytes]:
    """``(version, msgpack body)`` of an untrusted payload (size, version checked; tag not verified)."""
    if not isinstance(data, bytes):
        raise RejectedEntry("bad_payload", f"payload has type {type(data).__name__}")
    if len(data) > max_bytes:
        raise RejectedEntry("too_large", f"{len(data)} bytes")
    if (version := data[0] if data else None) == VERSION:
        return VERSION, data[1:]
    if version == VERSION_SIGNED and len(data) > SIGNED_HEAD:
        return VERSION_SIGNED, data[SIGNED_HEAD:]
    if version == VERSION_BODY_TAG and len(data) > 1 + TAG_BYTES:
        return VERSION_BODY_TAG, data[1 + TAG_BYTES :]
    raise RejectedEntry("bad_version", f"first byte {data[:1]!r}")


SECRET_HEADERS = (b"Authorization", b"Cookie", b"Proxy-Authorization")  #: a middleware's, never an entry's

#: request -> its credential headers when it entered the downloader (only requests that had some)
_scheduled: weakref.WeakKeyDictionary[Request, dict[bytes, list[bytes]]] = weakref.WeakKeyDictionary()
#: (lower-case header name, value) pairs downloader middlewares added to requests, newest last
_added: OrderedDict[tuple[bytes, bytes], None] = OrderedDict()
ADDED_LIMIT = 1000


class ScheduledHeadersMiddleware:
    """Downloader middleware remembering the credential headers each request had as scheduled."""

    def process_request(self, request: Request) -> None:
        if own := {n: list(request.headers.getlist(n)) for n in SECRET_HEADERS if n in request.headers}:
            _scheduled[request] = own


def as_scheduled(request: Request, original: Request | None = None) -> Request:
    """``request`` with the credential headers ``original`` (default: itself) had as scheduled."""
    own = _scheduled.get(original if original is not None else request, {})
    if all(list(request.headers.getlist(n)) == own.get(n, []) for n in SECRET_HEADERS):
        return request
    headers = request.headers.copy()
    for name in SECRET_HEADERS:
        headers.pop(name, None)
        if name in own:
            headers.setlist(name, own[name])
    return request.replace(headers=headers)


class AddedCredentialsMiddleware:
    """Downloader middleware (last) remembering the credential headers the ones before it added."""

    def process_request(self, request: Request) -> None:
        own = _scheduled.get(request, {})
        for name in SECRET_HEADERS:
            for value in request.headers.getlist(name):
                if value not in own.get(name, ()):
                    key = (name.lower(), bytes(value))
                    _added[key] = None
                    _added.move_to_end(key)
        while len(_added) > ADDED_LIMIT:
            _added.popitem(last=False)


def added_by_middleware(name: bytes, value: bytes) -> bool:
    """Whether a downloader middleware added header ``name: value`` to a request of this process."""
    return bool(_added) and (name.lower(), value) in _added


PRIORITY_RANGE = (-(2**31), 2**31 - 1)
_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def check_text(s: str, reason: str, what: str) -> None:
    """Refuse a lone surrogate (JSON allows ``"\\ud800"``; no encoder accepts it later)."""
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise RejectedEntry(reason, f"{what} holds a lone surrogate") from None


_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}


def json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), "number")


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
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise RejectedEntry("bad_priority", f"priority is a {json_type(priority)}, expected an integer")
    if not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
        raise RejectedEntry("bad_priority", "priority out of the 32-bit range")
    return priority


def priority_from_score(score: float) -> int:
    """A ZSET score as a request priority (rounded, clamped to the 32-bit range, NaN -> 0)."""
    return 0 if math.isnan(score) else round(max(PRIORITY_RANGE[0], min(PRIORITY_RANGE[1], score)))


def check_callback_name(name: Any, what: str, has_callback: Callable[[str], bool] | None = None) -> str:
    """A public method name (identifier, no leading ``_``) the spider has, if ``has_callback`` can tell."""
    if not isinstance(name, str) or not name.isidentifier() or not name.isascii() or name.startswith("_"):
        raise RejectedEntry(f"bad_{what}", f"{what} {str(name)[:40]!r} is not a public method name")
    if has_callback is not None and not has_callback(name):
        raise RejectedEntry(f"bad_{what}", f"the spider has no callback method {name!r}")
    return name


COOKIE_KEYS = frozenset({"name", "value", "domain", "path", "secure", "expires"})


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
            if not isinstance(c, dict) or "name" not in c or "value" not in c or set(c) - COOKIE_KEYS:
                raise RejectedEntry("bad_cookies", "each cookie must be an object with name, value"
                                                   " (domain, path, ...)")
            for key, value in c.items():
                if key != "secure":
                    _check_cookie_text(value, key)
                elif not isinstance(value, bool):
                    raise RejectedEntry("bad_cookies", "cookie secure must be true/false")
            if not isinstance(c["name"], str) or not c["name"] or "=" in c["name"]:
                raise RejectedEntry("bad_cookies", f"cookie name {str(c['name'])[:40]!r}")
        return cookies
    raise RejectedEntry("bad_cookies", f"cookies is a {json_type(cookies)}, expected an object or an array")
