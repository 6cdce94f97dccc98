"""Seeds: the untrusted entries pushed to ``<spider>:start_urls``, parsed and validated for the spiders and
``scrapy-dist push`` alike (docs/seeds.md, "Accepted seeds"), and hints for seeds pushed to a key no crawl
reads; :mod:`.feed` reads them in a crawl. A bad seed raises :class:`~scrapy_dist.exceptions.RejectedEntry`
with a ``reason`` from :data:`REASONS`, never another exception, whatever the bytes.

May import: ``settings``, ``redis``, ``wire``, ``utils`` and the root's exceptions."""

from __future__ import annotations

import difflib
import json
import logging
import re
import unicodedata
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from scrapy_dist.exceptions import RejectedEntry
from scrapy_dist.redis.scripts import text
from scrapy_dist.wire import codec, entrypolicy
from scrapy_dist.wire.entrypolicy import check_text, json_type, priority_from_score

__all__ = ["DEFAULT_RULES", "FIELDS", "REASONS", "NearMiss", "Seed", "SeedRules", "candidates",
           "class_has_callback", "find", "find_async", "iter_lines", "parse_seed", "priority_from_score",
           "reason_slug", "resolve_callback", "seed_request", "spider_has_callback", "validate_url",
           "warn_at_start"]

if TYPE_CHECKING:
    from scrapy import Request, Spider

    from scrapy_dist.redis.keys import CrawlKeys
    from scrapy_dist.settings import DistSettings

logger = logging.getLogger(__name__)

#: Every rejection reason a seed can get (stats ``seeds/rejected/<reason>``, ``reason`` of the records);
#: docs/seeds.md, "Rejected seeds", says what each means.
REASONS = frozenset({
    "too_large", "not_utf8", "empty", "bad_url", "bad_scheme", "bad_json", "not_object", "missing_url",
    "bad_form_field", "bad_method", "bad_headers", "header_injection", "bad_body", "bad_meta",
    "meta_not_allowed", "header_not_allowed", "offsite", "bad_cb_kwargs", "bad_priority", "bad_callback",
    "bad_errback", "bad_dont_filter", "bad_cookies", "bad_request", "hook_error", "bad_hook_result"})

#: The fields a JSON seed may have.
FIELDS = frozenset(["url", "method", "headers", "body", "meta", "cb_kwargs", "priority", "callback",
                    "errback", "dont_filter", "cookies"])

MAX_DEPTH = 32  #: Nesting limit of JSON seeds (far below Python's and msgpack's recursion limits).
_WS = b" \t\r\n\x0b\x0c"
#: ``scheme://[user@]host[:port]`` then ``/``, ``?``, ``#`` or the end: read without urlsplit
_SIMPLE_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://(?:[^/?#@\[\]]*@)?([A-Za-z0-9.-]+)(?::(\d{1,5}))?(?=[/?#]|$)")


@dataclass(frozen=True)
class SeedRules:
    """The limits every seed is checked against (``REDIS_START_URLS_*``, ``SEEDS_*_ALLOWED``)."""

    max_bytes: int = 64 * 1024
    allowed_schemes: tuple[str, ...] = ("http", "https")
    meta_allowed: tuple[str, ...] = ("*",)
    headers_allowed: tuple[str, ...] = ()
    dedupe: bool = False  #: REDIS_START_URLS_DEDUPE: dedupe a seed that does not say ``dont_filter``

    @classmethod
    def from_dist(cls, ds: DistSettings) -> SeedRules:
        s = ds.seeds
        return cls(s.max_bytes, ds.scheduler.allowed_schemes, s.meta_allowed, s.headers_allowed, s.dedupe)


DEFAULT_RULES = SeedRules()


@dataclass
class Seed:
    """A validated seed: everything needed to build its request, nothing unchecked."""

    url: str
    method: str = "GET"
    headers: dict[str, list[str]] | None = None
    body: str | None = None
    meta: dict[str, Any] | None = None
    cb_kwargs: dict[str, Any] | None = None
    priority: int | None = None  #: ``None`` when the seed does not set it (a ZSET score may then give it)
    callback: str | None = None
    errback: str | None = None
    dont_filter: bool | None = None  #: ``None`` when the seed does not say (REDIS_START_URLS_DEDUPE decides)
    cookies: dict[str, Any] | list[dict[str, Any]] | None = None
    formdata: dict[str, str | list[str]] | None = None  #: fields outside FIELDS: form data (scrapy-redis)
    is_json: bool = field(default=False, compare=False)

    def to_json(self) -> str:
        """The seed as a JSON object holding only what differs from the defaults."""
        d: dict[str, Any] = {"url": self.url}
        for name in ("method", "headers", "body", "meta", "cb_kwargs", "priority", "callback", "errback",
                     "cookies", "dont_filter"):
            if (value := getattr(self, name)) is not None and (name, value) != ("method", "GET"):
                d[name] = value
        for name, value in (self.formdata or {}).items():
            d.setdefault(name, value)
        return json.dumps(d, ensure_ascii=False, separators=(",", ":"))


def _check_json_value(value: Any, reason: str, what: str, depth: int = 0) -> None:
    """Walk a JSON value (up to ``MAX_DEPTH``): strings encodable, integers storable."""
    if depth > MAX_DEPTH:
        raise RejectedEntry("bad_json", f"{what} nested deeper than {MAX_DEPTH}")
    if isinstance(value, str):
        check_text(value, reason, what)
    elif isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
        raise RejectedEntry(reason, f"{what} holds an integer out of range")  # msgpack's integer range
    elif isinstance(value, list):
        for v in value:
            _check_json_value(v, reason, what, depth + 1)
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(k, reason, what)
            _check_json_value(v, reason, what, depth + 1)


def validate_url(url: Any, rules: SeedRules = DEFAULT_RULES) -> str:
    """Validate an untrusted URL: ``wire.codec.check_url``'s rules, and what Scrapy's ``Request`` trips on."""
    if not isinstance(url, str):
        raise RejectedEntry("bad_url", f"url has type {type(url).__name__}")
    if not url or len(url) > 8192 or codec.BAD_URL_CHARS.search(url):
        raise RejectedEntry("bad_url", "empty, too long, or contains whitespace/control characters")
    if not url.isascii() and not url.isprintable():
        ch = next(c for c in url if not c.isprintable())
        raise RejectedEntry("bad_url", f"contains {unicodedata.category(ch)} character U+{ord(ch):04X}")
    if (simple := _SIMPLE_URL.match(url)) is not None:  # the common shape, without urlsplit (same answers)
        scheme, host, port = simple.group(1).lower(), simple.group(2), simple.group(3)
        if port is not None and int(port) > 65535:
            raise RejectedEntry("bad_url", "Port out of range 0-65535")
    else:
        try:
            parts = urlsplit(url)
            port = parts.port  # raises ValueError for a port out of range
        except ValueError as exc:
            raise RejectedEntry("bad_url", str(exc)[:100]) from None
        scheme, host = parts.scheme.lower(), parts.hostname
    if not scheme:
        raise RejectedEntry("bad_url", "not a URL (no scheme)")
    if scheme not in rules.allowed_schemes:
        raise RejectedEntry("bad_scheme", f"scheme {scheme!r} not allowed")
    if scheme in ("http", "https") and not host:
        raise RejectedEntry("bad_url", "no host")
    if "@" in url:
        codec.check_no_userinfo(url)
    return url


def parse_seed(data: bytes, rules: SeedRules = DEFAULT_RULES,
               has_callback: Callable[[str], bool] | None = None) -> Seed:
    """Parse and validate one raw seed; raises :class:`RejectedEntry`, nothing else. ``has_callback(name)``
    says whether the spider has a public callback ``name`` (``None``: any public method name passes)."""
    if len(data) > rules.max_bytes:
        raise RejectedEntry("too_large", f"{len(data)} bytes > {rules.max_bytes}")
    try:
        text = data.strip(_WS).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RejectedEntry("not_utf8", f"invalid byte at {exc.start}") from None
    if not text:
        raise RejectedEntry("empty")
    json_like = text[0] in '{["-' or text[0].isdigit() or text in ("null", "true", "false")
    return _parse_json(text, rules, has_callback) if json_like else Seed(validate_url(text, rules))


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _parse_json(text: str, rules: SeedRules, has_callback: Callable[[str], bool] | None) -> Seed:
    try:
        obj = json.loads(text, parse_constant=_not_json)
    except RecursionError:
        raise RejectedEntry("bad_json", "nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, or int too long for the str -> int limit
        raise RejectedEntry("bad_json", str(exc)[:120]) from None
    if not isinstance(obj, dict):
        raise RejectedEntry("not_object", f"JSON {type(obj).__name__}, expected an object")
    if "url" not in obj:
        raise RejectedEntry("missing_url", "JSON seed without url")
    formdata = _form_fields(obj)
    if isinstance(url := obj["url"], str):
        check_text(url, "bad_url", "url")
    seed = Seed(validate_url(url, rules), is_json=True)
    if "method" in obj:
        seed.method = entrypolicy.check_method(obj["method"])
    if "headers" in obj:
        seed.headers = entrypolicy.check_headers(obj["headers"])
        codec.check_header_names(seed.headers, rules.headers_allowed)
    if "body" in obj:
        if not isinstance(body := obj["body"], str):
            raise RejectedEntry("bad_body", f"body is a {json_type(body)}, expected a string")
        check_text(body, "bad_body", "body")
        seed.body = body
    if "meta" in obj:
        if not isinstance(meta := obj["meta"], dict):
            raise RejectedEntry("bad_meta", f"meta is a {json_type(meta)}, expected an object")
        _check_json_value(meta, "bad_meta", "meta")
        codec.check_meta_keys(meta, rules.meta_allowed)
        seed.meta = meta
    if "cb_kwargs" in obj:
        if not isinstance(kw := obj["cb_kwargs"], dict) or not all(k.isidentifier() for k in kw):
            raise RejectedEntry("bad_cb_kwargs", "cb_kwargs must be an object with identifier keys")
        _check_json_value(kw, "bad_cb_kwargs", "cb_kwargs")
        seed.cb_kwargs = kw
    if "priority" in obj:
        seed.priority = entrypolicy.check_priority(obj["priority"])
    for what in ("callback", "errback"):
        if what in obj and obj[what] is not None:
            setattr(seed, what, entrypolicy.check_callback_name(obj[what], what, has_callback))
    if "dont_filter" in obj:
        if not isinstance(df := obj["dont_filter"], bool):
            raise RejectedEntry("bad_dont_filter", f"dont_filter is a {json_type(df)}, expected true/false")
        seed.dont_filter = df
    if "cookies" in obj:
        seed.cookies = entrypolicy.check_cookies(obj["cookies"])
        codec.check_cookies_allowed(rules.headers_allowed)
    if formdata:
        if seed.body is not None:
            raise RejectedEntry("bad_form_field", "form fields and body together (the form is the body)")
        seed.formdata = formdata
    return seed


def _form_fields(obj: dict[str, Any]) -> dict[str, str | list[str]]:
    """The fields of a JSON seed outside :data:`FIELDS`: form data."""
    out: dict[str, str | list[str]] = {}
    for name, value in obj.items():
        if name in FIELDS:
            continue
        check_text(name, "bad_form_field", "a form field name")
        if not (isinstance(value, str) or isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise RejectedEntry("bad_form_field", f"form field {name[:40]!r} is a {json_type(value)},"
                                " expected a string or a list of strings (a field outside url, method,"
                                " meta, ... is sent as form data)")
        _check_json_value(value, "bad_form_field", "a form field")
        out[name] = value
    return out


def class_has_callback(spidercls: type) -> Callable[[str], bool]:
    """``has_callback`` for :func:`parse_seed` from a spider class (what the CLI has)."""
    return lambda name: codec.user_defined(spidercls, name)


def spider_has_callback(spider: Spider) -> Callable[[str], bool]:
    """``has_callback`` for :func:`parse_seed` from a running spider."""
    def check(name: str) -> bool:
        try:
            return resolve_callback(spider, name, "callback") is not None
        except RejectedEntry:
            return False
    return check


def resolve_callback(spider: Spider, name: str, what: str) -> Any:
    """The bound method ``name`` of ``spider`` (validated as in :func:`spider_has_callback`)."""
    method = codec.spider_method(spider, name, what)
    if not codec.user_defined(type(spider), name):
        raise RejectedEntry(f"bad_{what}", f"{name!r} is not a callback method defined by the spider")
    return method


def seed_request(seed: Seed, spider: Spider | None = None, request_cls: type[Request] | None = None,
                 dedupe: bool = False) -> Request:
    """Build the request of ``seed``, callbacks resolved on ``spider``; raises :class:`RejectedEntry`. A seed
    without ``dont_filter`` bypasses the dupefilter unless ``dedupe`` (``REDIS_START_URLS_DEDUPE``)."""
    from scrapy import Request
    dont_filter = (not dedupe) if seed.dont_filter is None else seed.dont_filter
    kw: dict[str, Any] = {"url": seed.url, "method": seed.method, "dont_filter": dont_filter}
    for name in ("headers", "body", "meta", "cb_kwargs", "priority", "cookies"):  # unset: Request's default
        if (value := getattr(seed, name)) is not None:
            kw[name] = value
    if seed.formdata:
        from scrapy import FormRequest
        kw["formdata"] = seed.formdata
        if request_cls is None or not issubclass(request_cls, FormRequest):
            request_cls = FormRequest
    for what in ("callback", "errback"):
        if (name := getattr(seed, what)) is not None:
            if spider is None:
                raise RejectedEntry(f"bad_{what}", f"no spider to resolve {what} {name!r}")
            kw[what] = resolve_callback(spider, name, what)
    try:
        return (request_cls or Request)(**kw)
    except Exception as exc:  # Request validates too; it must never crash us
        raise RejectedEntry("bad_request", f"{type(exc).__name__}: {exc}"[:200]) from None


def reason_slug(reason: Any) -> str:
    """A rejection reason safe for a stats key: lowercase letters, digits and ``_``, at most 40."""
    return re.sub(r"[^a-z0-9_]", "_", str(reason).lower()[:40]) or "rejected"


def iter_lines(chunks: Iterable[bytes]) -> Iterable[bytes]:
    """Seeds of a file, one a line (blank lines and ``#`` comments skipped); used by the CLI."""
    for line in chunks:
        if (stripped := line.strip(_WS)) and not stripped.startswith(b"#"):
            yield stripped


# A near miss: a LIST, SET or ZSET with entries, named like the seeds key (within LENGTH_SLACK characters,
# a SequenceMatcher ratio of SIMILARITY, case-insensitively) but no crawl's seeds key by the template.
SCAN_COUNT, TOOL_SCAN_CALLS, MAX_HINTS = 1000, 10, 5  # keys per SCAN call, SCAN calls of the CLI, hints
SIMILARITY, LENGTH_SLACK = 0.85, 3
_KINDS = ["list", "set", "zset"]  # in the order of _lengths()


@dataclass(frozen=True)
class NearMiss:
    """A key holding seeds that no crawl reads, and the seeds key it was meant to be."""

    key: str
    type: str
    entries: int
    meant: str

    def hint(self) -> str:
        """``3 entries in 'site:start_url' (list) -- did you mean 'site:start_urls'?``"""
        plural = "entry" if self.entries == 1 else "entries"
        return f"{self.entries:,} {plural} in {self.key!r} ({self.type}) -- did you mean {self.meant!r}?"


def candidates(names: Iterable[bytes | str], keys: CrawlKeys, read: Iterable[str] = ()) -> list[str]:
    """Names like a misspelling of ``keys.start_urls``, most alike first (``read``: keys known to be read)."""
    meant = keys.start_urls
    # the seeds key of any crawl: %(name)s / %(spider)s as any text
    parts = re.split(r"%\((?:name|spider)\)s", keys.start_urls_template)
    literal = ".+".join(re.escape(p.replace("%%", "%")) for p in parts)
    other_crawl = re.compile(re.escape(keys.prefix) + literal + r"\Z", re.DOTALL)
    skip = {meant, *read}
    scored = []
    for raw in names:
        name = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        if abs(len(name) - len(meant)) > LENGTH_SLACK or name in skip:
            continue
        if other_crawl.match(name) and name.lower() != meant.lower():  # Site:start_urls is no other crawl
            continue
        if (ratio := difflib.SequenceMatcher(None, name.lower(), meant.lower()).ratio()) >= SIMILARITY:
            scored.append((-ratio, name))
    return [name for _, name in sorted(set(scored))]


def _lengths(client: Any, names: list[str]) -> Any:
    """A pipeline of each name's TYPE and its three length commands (the one of its type answers)."""
    p = client.pipeline(transaction=False)
    for name in names:
        p.type(name).llen(name).scard(name).zcard(name)
    return p


def _misses(names: list[str], replies: list[Any], meant: str) -> list[NearMiss]:
    out = []
    for i, name in enumerate(names):
        kind = text(replies[4 * i])
        n = replies[4 * i + 1 + _KINDS.index(kind)] if kind in _KINDS else None
        if isinstance(n, int) and n > 0:
            out.append(NearMiss(name, kind, n, meant))
    return out


def find(client: Any, keys: CrawlKeys, calls: int = TOOL_SCAN_CALLS) -> list[NearMiss]:
    """Near misses of ``keys.start_urls`` (at most ``calls`` ``SCAN`` calls, then one round trip)."""
    cursor, seen = 0, []
    for _ in range(calls):
        cursor, batch = client.scan(cursor, count=SCAN_COUNT)
        seen += batch
        if isinstance(cursor, dict) or not int(cursor):  # over (a Redis Cluster's cursors: one call there)
            break
    if not (names := candidates(seen, keys)[:MAX_HINTS]):
        return []
    return _misses(names, _lengths(client, names).execute(raise_on_error=False), keys.start_urls)


async def find_async(client: Any, keys: CrawlKeys) -> list[NearMiss]:
    """:func:`find` for a ``redis.asyncio`` client (a worker: one ``SCAN`` call)."""
    if not (names := candidates((await client.scan(0, count=SCAN_COUNT))[1], keys)[:MAX_HINTS]):
        return []
    return _misses(names, await _lengths(client, names).execute(raise_on_error=False), keys.start_urls)


async def warn_at_start(client: Any, keys: CrawlKeys) -> None:
    """Log one WARNING per near miss of the seeds key (an error is only logged at DEBUG)."""
    try:
        misses = await find_async(client, keys)
    except Exception:
        logger.debug("Looking for misspelt seeds keys failed", exc_info=True)
        return
    for miss in misses:
        logger.warning("%s This spider reads %r; seeds elsewhere are never crawled.", miss.hint(), miss.meant)
