"""The entry policy: what an entry read from the queue may ask for, and the crawl's secret that tells
its own entries from anyone else's.

Payloads are sealed here (:meth:`EntryPolicy.seal`: ``b"\\x01" + body``, or with a secret
``b"\\x02" + tag + body``, ``tag`` the 16-byte keyed BLAKE2b of the body) and read by
:mod:`scrapy_dist.wire.codec`, which applies this policy to every entry it decodes: an untrusted entry (no tag
that verifies, while the crawl has a secret) must pass the rules for seeds -- meta keys allowed by
``SEEDS_META_ALLOWED``, no framing or routing headers, the spider's ``allowed_domains``.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import logging
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from scrapy_dist.exceptions import RejectedEntry

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

__all__ = [
    "CREDENTIAL_HEADERS",
    "DANGEROUS_META",
    "DEFAULT_POLICY",
    "FORBIDDEN_HEADERS",
    "EntryPolicy",
    "check_cookies_allowed",
    "check_no_userinfo",
    "check_header_names",
    "check_meta_keys",
    "check_offsite",
    "entry_policy",
    "host_allowed",
    "keep_allowed_domains",
    "is_trusted",
]

#: version byte of an unauthenticated payload
VERSION = 1
#: version byte of a payload carrying a tag made with the crawl's secret
VERSION_SIGNED = 2
TAG_BYTES = 16
_VERSION_BYTE = bytes([VERSION])
_SIGNED_BYTE = bytes([VERSION_SIGNED])

#: Meta keys an untrusted entry may set only if SEEDS_META_ALLOWED names them exactly (a wildcard is not
#: enough): they route the request (proxy, source address, slot), carry credentials, switch Scrapy's
#: safety checks off or reach into its private state. The retry and redirect counters are Scrapy's
#: state too: ``retry_times`` / ``redirect_times`` of -1e9 (with ``redirect_ttl`` 1e9) made a failing
#: URL retried, or a redirect cycle followed, without end.
DANGEROUS_META = (
    "proxy", "_*", "bindaddress", "download_slot", "ftp_*", "cookiejar", "handle_httpstatus_all",
    "dont_*", "allow_offsite", "download_maxsize", "download_warnsize", "download_timeout",
    "max_retry_times", "retry_times", "priority_adjust", "give_up_log_level", "redirect_times",
    "redirect_ttl", "redirect_urls", "redirect_reasons", "splash", "playwright*", "zyte_api*",
    "impersonate", "is_start_request", "depth",
)
#: Headers an untrusted entry may never set: they frame the message or route it.
FORBIDDEN_HEADERS = (
    "host", "content-length", "transfer-encoding", "connection", "proxy-*", "te", "upgrade", "keep-alive",
    "trailer", "expect", "x-forwarded-*", "forwarded",
)
#: Headers an untrusted entry may set only if SEEDS_HEADERS_ALLOWED names them.
CREDENTIAL_HEADERS = ("authorization", "cookie")


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def check_meta_keys(meta: dict[Any, Any], allowed: Iterable[str]) -> None:
    """Refuse (``meta_not_allowed``, naming the key) a meta key of an untrusted entry that matches no
    pattern of ``allowed``, or one of :data:`DANGEROUS_META` that ``allowed`` does not name exactly."""
    allowed = tuple(allowed)
    for key in meta:
        name = str(key)
        if not _matches(name, allowed) or (_matches(name, DANGEROUS_META) and name not in allowed):
            raise RejectedEntry(
                "meta_not_allowed", f"meta key {name[:40]!r} is not allowed (SEEDS_META_ALLOWED)"
            )


def check_header_names(names: Iterable[Any], allowed: Iterable[str]) -> None:
    """Refuse (``header_not_allowed``) framing/routing headers, and credential headers ``allowed`` does not
    name (case-insensitive)."""
    allowed_l = {a.lower() for a in allowed}
    for raw in names:
        name = (raw.decode("latin-1") if isinstance(raw, bytes) else str(raw)).lower()
        if _matches(name, FORBIDDEN_HEADERS) or (name in CREDENTIAL_HEADERS and name not in allowed_l):
            raise RejectedEntry("header_not_allowed", f"header {name[:40]!r} may not come from an entry")


def check_cookies_allowed(allowed: Iterable[str]) -> None:
    """Refuse (``header_not_allowed``) the cookies of an untrusted entry unless ``allowed`` names the
    ``Cookie`` header: Scrapy's cookies middleware stores a request's cookies in the crawl's cookie jar,
    which sends them with every later request to that site -- a seed could otherwise set (or replace) the
    crawl's session cookie, which it may not do with a ``Cookie`` header."""
    if "cookie" not in {a.lower() for a in allowed}:
        raise RejectedEntry(
            "header_not_allowed", "cookies may not come from an entry (SEEDS_HEADERS_ALLOWED: no Cookie)"
        )


def check_no_userinfo(url: str) -> None:
    """Refuse (``bad_url``) a URL of an untrusted entry with an ``@`` in its authority (up to the first
    ``/``, ``?`` or ``#``): ``user[:password]@`` before the host -- credentials may not come from an entry,
    and Scrapy does not send them either (such a request failed at download, with a traceback, instead
    of being rejected with a reason) -- or ``a\\@b``, where parsers disagree on the host (``urlsplit``
    says ``b``, a browser ``a``)."""
    authority = url.partition("://")[2]
    for end in "/?#":
        authority = authority.partition(end)[0]
    if "@" in authority:
        raise RejectedEntry("bad_url", "'@' before the host: credentials may not come from an entry")


def host_allowed(url: str, allowed_domains: Iterable[str] | None) -> bool:
    """Whether the host of ``url`` is one of ``allowed_domains`` or a subdomain of one (``None`` or empty:
    every host), as Scrapy's offsite middleware reads the list."""
    domains = [d.lower().lstrip(".") for d in allowed_domains or () if isinstance(d, str) and d]
    if not domains:
        return True
    try:
        host = (urlsplit(url).hostname or "").rstrip(".")
    except ValueError:
        return False
    return any(host == d or host.endswith("." + d) for d in domains)


def keep_allowed_domains(spider: Any) -> Any:
    """The spider's ``allowed_domains``, an iterator among them read once and kept as a list.

    scrapy-redis's example spiders set ``filter(None, domain.split(","))``. Scrapy's offsite middleware
    reads the attribute twice when the spider opens (``list()`` it, then build its regex from it): from an
    iterator its regex matches no host; and a seed check reading the exhausted iterator then left ``[]``,
    which made the middleware allow every host -- the crawl left its domains. Called when a
    :class:`~scrapy_dist.spiders.RedisSpider` is built (before anything reads the attribute) and by every
    check."""
    domains = getattr(spider, "allowed_domains", None)
    if isinstance(domains, str):
        return [domains]
    if domains is not None and not isinstance(domains, (list, tuple, set, frozenset)):
        domains = spider.allowed_domains = list(domains)
    return domains


def check_offsite(url: str, spider: Any) -> None:
    """Refuse (``offsite``) a URL outside the spider's ``allowed_domains``, ``dont_filter`` or not."""
    domains = keep_allowed_domains(spider)
    if domains and not host_allowed(url, domains):
        raise RejectedEntry("offsite", f"host of {url[:80]!r} is not in the spider's allowed_domains")


def _secret_key(secret: bytes) -> bytes:
    # BLAKE2b keys are at most 64 bytes: a longer secret is hashed down to 64
    return secret if len(secret) <= 64 else hashlib.blake2b(secret).digest()


@dataclass(frozen=True)
class EntryPolicy:
    """What an entry read from the queue must satisfy, and the secret that tells the crawl's own entries
    from others. Built once per crawler (:func:`entry_policy`)."""

    allowed_schemes: tuple[str, ...] = ("http", "https")
    max_bytes: int = 1024 * 1024
    #: fnmatch patterns of the meta keys an untrusted entry may set (see :func:`check_meta_keys`)
    meta_allowed: tuple[str, ...] = ("*",)
    #: credential headers (Authorization, Cookie) an untrusted entry may set
    headers_allowed: tuple[str, ...] = ()
    #: the crawl's secret; ``None``: every queue entry is trusted as the crawl's own
    secret: bytes | None = None

    @classmethod
    def from_settings(cls, settings: Any) -> EntryPolicy:
        """The policy of a crawl's settings (Scrapy ``Settings``, a dict or a ``DistSettings``; the secret
        may come from the ``SCRAPY_DIST_SECRET`` environment variable, and on the embedded Redis, without
        either, is the one it keeps with its private files)."""
        from scrapy_dist.redis.target import embedded_secret
        from scrapy_dist.settings import DistSettings

        ds = DistSettings.coerce(settings)
        return cls(
            allowed_schemes=ds.scheduler.allowed_schemes,
            max_bytes=ds.scheduler.max_entry_bytes,
            meta_allowed=ds.seeds.meta_allowed,
            headers_allowed=ds.seeds.headers_allowed,
            secret=ds.scheduler.entry_secret or embedded_secret(ds),
        )

    def tag(self, body: bytes) -> bytes:
        """The tag of a msgpack body (requires a secret)."""
        assert self.secret is not None
        return hashlib.blake2b(body, key=_secret_key(self.secret), digest_size=TAG_BYTES).digest()

    def seal(self, body: bytes) -> bytes:
        """A payload of ``body``: signed with the secret if there is one, else version 1."""
        if self.secret is None:
            return _VERSION_BYTE + body
        return _SIGNED_BYTE + self.tag(body) + body

    def verify(self, data: bytes) -> bool:
        """Whether ``data`` is a version-2 payload whose tag verifies with this policy's secret."""
        if self.secret is None or len(data) < 1 + TAG_BYTES or data[0] != VERSION_SIGNED:
            return False
        return hmac.compare_digest(data[1 : 1 + TAG_BYTES], self.tag(data[1 + TAG_BYTES :]))


DEFAULT_POLICY = EntryPolicy()
_POLICIES: weakref.WeakKeyDictionary[Any, EntryPolicy] = weakref.WeakKeyDictionary()


def entry_policy(crawler: Crawler | None) -> EntryPolicy:
    """The :class:`EntryPolicy` of ``crawler``, built on first use and kept (one dict lookup after)."""
    if crawler is None:
        return DEFAULT_POLICY
    policy = _POLICIES.get(crawler)
    if policy is None:
        from scrapy_dist.settings import DistSettings

        ds = DistSettings.for_crawler(crawler)
        policy = _POLICIES[crawler] = EntryPolicy.from_settings(ds)
        if policy.secret is None:
            _warn_unsigned(ds.connection.source)
    return policy


_warned_unsigned: list[bool] = []


def _warn_unsigned(source: str) -> None:
    """One WARNING per process: a shared Redis and no secret."""
    if _warned_unsigned:
        return
    _warned_unsigned.append(True)
    logging.getLogger(__name__).warning(
        "No SCHEDULER_ENTRY_SECRET (or SCRAPY_DIST_SECRET) set while using a shared Redis (from %s): every"
        " entry in the crawl's queue counts as this crawl's own, so anyone who can write to that Redis can"
        " make the workers send requests through a proxy of theirs, with any Host header and with your"
        " spider's Authorization header and cookies. Set the same secret on every worker, e.g."
        " SCRAPY_DIST_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))') (docs/security.md)",
        source,
    )



def is_trusted(data: bytes, policy: EntryPolicy) -> bool:
    """Whether an entry counts as the crawl's own: its tag verifies, or the crawl has no secret.
    Raises :class:`RejectedEntry` (``bad_tag``) for a version-2 entry whose tag does not verify."""
    if policy.secret is None:
        return True
    if data[:1] != _SIGNED_BYTE:
        return False
    if not policy.verify(data):
        raise RejectedEntry("bad_tag", "the entry's tag does not verify with the crawl's secret")
    return True
