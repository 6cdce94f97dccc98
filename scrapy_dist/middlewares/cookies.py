"""A crawl-wide cookie jar: Scrapy's cookies middleware with its jars in Redis, one HASH per jar, one JSON
record per cookie (docs/items.md, "SharedCookiesMiddleware"). Records read back are untrusted: checked field
by field, and with the crawl's secret sealed (:class:`RecordSeal`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.cookiejar import Cookie
from typing import TYPE_CHECKING, Any

from scrapy import signals
from scrapy.downloadermiddlewares.cookies import CookiesMiddleware
from scrapy.exceptions import NotConfigured
from scrapy.http.cookies import CookieJar
from scrapy.utils.conf import build_component_list
from scrapy.utils.misc import load_object

from scrapy_dist.redis import scripts
from scrapy_dist.redis.connection import ClientPool, send_calls
from scrapy_dist.redis.keys import crawler_keys
from scrapy_dist.redis.outage import BatchWriter, Outage
from scrapy_dist.redis.scripts import text
from scrapy_dist.settings import CookieSettings, DistSettings
from scrapy_dist.settings.reader import refusing
from scrapy_dist.utils import RateLimitedLog, inc_stat
from scrapy_dist.wire.entrypolicy import entry_policy

if TYPE_CHECKING:
    import redis.asyncio
    from scrapy import Request
    from scrapy.crawler import Crawler
    from scrapy.http import Response
    from scrapy.statscollectors import StatsCollector
    from typing_extensions import Self

    from scrapy_dist.redis.keys import CrawlKeys

logger = logging.getLogger(__name__)

_WRITE_BATCH = 1000  # cookie changes per write (one script call); a backlog after an outage goes in several
READ_LIMIT = 1000  #: changes read per refresh of a jar at most (a bigger backlog: over the next ones)

_BOOL_FIELDS = ("port_specified", "domain_specified", "domain_initial_dot", "path_specified", "secure",
                "discard", "rfc2109")
#: the type each field of a record must have (a missing boolean reads as False, any other as None)
_FIELD_TYPES: dict[str, tuple[Any, str]] = {
    **dict.fromkeys(("name", "domain", "path"), (str, "a string")),
    **dict.fromkeys(("value", "port", "comment", "comment_url"), ((str, type(None)), "a string or null")),
    **dict.fromkeys(_BOOL_FIELDS, (bool, "a boolean"))}

CookieIdent = tuple[str, str, str]


def jar_name(cookiejar: Any) -> str:
    if cookiejar is None:
        return "default"
    return cookiejar if isinstance(cookiejar, str) else repr(cookiejar)


def cookie_field(ident: CookieIdent) -> str:
    """The HASH field of a cookie: JSON ``[domain, path, name]``."""
    return json.dumps(list(ident), separators=(",", ":"))


#: A cookie's attributes in the order its record lists them (``rest`` comes before the last one).
_RECORD_FIELDS = ("version", "name", "value", "port", "port_specified", "domain", "domain_specified",
                  "domain_initial_dot", "path", "path_specified", "secure", "expires", "discard", "comment",
                  "comment_url")


def cookie_record(cookie: Cookie) -> dict[str, Any]:
    """Everything needed to rebuild ``cookie`` on another worker, as a JSON-able dict."""
    record = {name: getattr(cookie, name) for name in _RECORD_FIELDS}
    record["rest"] = dict(cookie._rest)  # type: ignore[attr-defined]  # the only way to read all of them
    record["rfc2109"] = cookie.rfc2109
    return record


def cookie_from_record(data: bytes | str) -> Cookie:
    """Rebuild a cookie from its stored JSON record; ``ValueError`` says what is wrong (untrusted input)."""
    try:
        rec = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(rec, dict):
        raise ValueError("not a JSON object")
    for name, (types_, expected) in _FIELD_TYPES.items():
        if not isinstance(rec.get(name, False if name in _BOOL_FIELDS else None), types_):
            raise ValueError(f"{name!r} must be {expected}")
    if not rec["name"]:
        raise ValueError("empty cookie name")
    version = rec.get("version", 0)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError("'version' must be a non-negative integer")
    expires = rec.get("expires")
    if expires is not None and (isinstance(expires, bool) or not isinstance(expires, int)):
        raise ValueError("'expires' must be an integer or null")
    rest = rec.get("rest") or {}
    if not isinstance(rest, dict) or not all(isinstance(k, str) and isinstance(v, (str, type(None)))
                                             for k, v in rest.items()):
        raise ValueError("'rest' must map strings to strings or null")
    attributes = {name: rec.get(name, False if name in _BOOL_FIELDS else None) for name in _RECORD_FIELDS}
    return Cookie(**{**attributes, "version": version, "rest": rest, "rfc2109": rec.get("rfc2109", False)})


@dataclass(frozen=True)
class RecordSeal:
    """Which records a worker believes: all without a ``secret``, else tagged ones that verify (and untagged
    ones if ``unsigned_ok``: ``SEEDS_HEADERS_ALLOWED`` names ``Cookie``)."""

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
        if (tag := rec.pop("tag", None)) is None:
            if self.unsigned_ok:
                return cookie
            raise ValueError(
                "no tag: a record the crawl's workers did not write (with SCHEDULER_ENTRY_SECRET set,"
                " cookies may come from elsewhere only if SEEDS_HEADERS_ALLOWED names Cookie)")
        body = json.dumps(rec, separators=(",", ":"))
        if not isinstance(tag, str) or not hmac.compare_digest(tag, self._tag(jar_key, field, body)):
            raise ValueError("its tag does not verify with the crawl's secret (SCHEDULER_ENTRY_SECRET)")
        return cookie


def snapshot(jar: CookieJar) -> dict[CookieIdent, dict[str, Any]]:
    return {(c.domain, c.path, c.name): cookie_record(c) for c in jar}


def apply_record(jar: CookieJar, field: str, record: str | None) -> None:
    """Apply one change to ``jar``: set the cookie of ``record``, or with ``None`` delete ``field``'s."""
    if record is None:
        with contextlib.suppress(ValueError, TypeError, KeyError):  # already gone, or not a field we write
            domain, path, cookie_name = json.loads(field)
            jar.clear(domain, path, cookie_name)
    else:
        jar.set_cookie(cookie_from_record(record))


def write_calls(keys: CrawlKeys, ops: list[tuple[str, str, str | None]],
                now: str) -> tuple[list[tuple[list[str], list[str]]], int]:
    """The ``cookies_write`` calls (KEYS, ARGV) for ``ops``, one per jar (last change wins), and a count."""
    by_jar: dict[str, dict[str, str | None]] = {}
    for name, field, record in ops:
        by_jar.setdefault(name, {})[field] = record
    calls: list[tuple[list[str], list[str]]] = []
    for name, fields in by_jar.items():
        sets = [(f, r) for f, r in fields.items() if r is not None]
        args = [name, now, str(len(sets)), *(x for pair in sets for x in pair)]
        args += [f for f, r in fields.items() if r is None]
        calls.append(([keys.cookie_jar(name), keys.cookie_changes(name), keys.cookies], args))
    return calls, sum(len(f) for f in by_jar.values())


@dataclass(slots=True)
class _SharedJar:
    """This worker's copy of one shared jar, when it was last read and up to which version."""
    jar: CookieJar = dataclasses.field(default_factory=CookieJar)
    loaded_at: float | None = None
    loading: asyncio.Future[None] | None = None
    version: float = 0.0  #: the jar's changes up to this version are in the copy


class SharedCookiesMiddleware(CookiesMiddleware):
    """Drop-in for Scrapy's ``CookiesMiddleware`` (in its place, 700) whose jars all workers share. Redis
    cost: one ``cookies_read`` call per jar and worker every ``cache_seconds``; one ``cookies_write`` call per
    ``flush_interval`` and jar while cookies change. On Redis errors reads use the local copy and writes are
    retried. Stats: ``cookies/shared/{loads,written,rejected,redis_errors}``."""

    def __init__(self, server: redis.asyncio.Redis, keys: CrawlKeys, settings: CookieSettings | None = None,
                 *, stats: StatsCollector | None = None, monotonic: Callable[[], float] = time.monotonic,
                 wallclock: Callable[[], float] = time.time, outage: Outage | None = None,
                 read_limit: int = READ_LIMIT, seal: RecordSeal | None = None) -> None:
        self.settings = settings or CookieSettings()
        super().__init__(self.settings.debug)
        self.seal = seal or RecordSeal()
        self.server, self.keys, self.stats = server, keys, stats
        self._monotonic, self._wallclock = monotonic, wallclock
        #: meta["cookiejar"] -> this worker's copy (the same objects as in ``_shared``), as in Scrapy.
        self.jars: dict[Any, CookieJar] = {}  # type: ignore[assignment]
        self._shared: dict[str, _SharedJar] = {}
        self.read_limit = max(1, read_limit)
        self.outage = outage or Outage()
        self._read_guard = self.outage.guard("shared cookie jar (reading)", log=logger)
        self.writer: BatchWriter[tuple[str, str, str | None]] = BatchWriter(
            self._write, guard=self.outage.guard("shared cookie jar (writing)", log=logger),
            batch_size=_WRITE_BATCH, flush_interval=self.settings.flush_interval,
            on_failure=lambda exc: inc_stat(self.stats, "cookies/shared/redis_errors"))
        self._read_script = scripts.register(server, "cookies_read")
        self._write_script = scripts.register(server, "cookies_write")
        self._reject_log = RateLimitedLog(logger)

    @classmethod
    @refusing
    def from_crawler(cls, crawler: Crawler) -> Self:
        if not (ds := DistSettings.for_crawler(crawler)).cookies.enabled:
            raise NotConfigured
        scrapy_mw = "scrapy.downloadermiddlewares.cookies.CookiesMiddleware"
        enabled = build_component_list(
            crawler.settings.get_component_priority_dict_with_base("DOWNLOADER_MIDDLEWARES"))
        if any(load_object(path) is CookiesMiddleware for path in enabled):
            logger.warning(
                "SharedCookiesMiddleware is enabled together with %s: the two overwrite each other's Cookie"
                " headers. Disable Scrapy's: DOWNLOADER_MIDDLEWARES = {%r: None, ...}", scrapy_mw, scrapy_mw)
        policy = entry_policy(crawler)  # its secret, and whether untrusted entries may set cookies
        seal = RecordSeal(policy.secret, "cookie" in {h.lower() for h in policy.headers_allowed})
        o = cls(ClientPool.of(crawler).async_client(), crawler_keys(crawler), ds.cookies, stats=crawler.stats,
                outage=Outage.for_crawler(crawler), seal=seal)
        o.crawler = crawler
        crawler.signals.connect(o.spider_closed, signal=signals.spider_closed)
        return o

    async def process_request(self, request: Request) -> None:  # type: ignore[override]
        """Add the shared jar's cookies to ``request`` (reading the jar if the copy is stale)."""
        if request.meta.get("dont_merge_cookies", False):
            return None
        name, state = self._state(request.meta.get("cookiejar"))
        await self._fresh(name, state)
        before = snapshot(state.jar) if request.cookies else None  # they join the jar, crawl-wide
        super().process_request(request)  # Scrapy's, on the jar _state() put in self.jars
        if before is not None:  # written in the background
            self._record_changes(name, before, state.jar)

    async def process_response(self, request: Request, response: Response) -> Response:  # type: ignore[override]
        """Store the cookies ``response`` sets; return once they are in Redis (if it set any)."""
        if request.meta.get("dont_merge_cookies", False) or not response.headers.getlist("Set-Cookie"):
            return response
        name, state = self._state(request.meta.get("cookiejar"))
        before = snapshot(state.jar)
        super().process_response(request, response)  # make_cookies also deletes the cookies it expires
        if (written := self._record_changes(name, before, state.jar)) is not None:
            await asyncio.shield(written)  # held until written: what the callback yields finds them in Redis
        return response

    async def spider_closed(self) -> None:
        await self.writer.close()
        await self.server.aclose()

    def _state(self, cookiejar: Any) -> tuple[str, _SharedJar]:
        name = jar_name(cookiejar)
        if (state := self._shared.get(name)) is None:
            state = self._shared[name] = _SharedJar()
        self.jars[cookiejar] = state.jar
        return name, state

    async def _fresh(self, name: str, state: _SharedJar) -> None:
        if state.loaded_at is not None and self._monotonic() - state.loaded_at < self.settings.cache_seconds:
            return
        if state.loading is None:
            state.loading = asyncio.ensure_future(self._load(name, state))
        await asyncio.shield(state.loading)

    async def _load(self, name: str, state: _SharedJar) -> None:
        """Apply jar ``name``'s changes since the last read (at most ``read_limit``), then ours unwritten."""
        try:
            try:
                jar_keys = [self.keys.cookie_jar(name), self.keys.cookie_changes(name)]
                raw = await self._read_script(keys=jar_keys, args=[repr(state.version), self.read_limit])
            except Exception as exc:
                inc_stat(self.stats, "cookies/shared/redis_errors")
                self._read_guard.failed(exc, self._monotonic())
                state.loaded_at = self._monotonic()  # try again after cache_seconds, not on every request
                return
            self._read_guard.succeeded(self._monotonic())
            inc_stat(self.stats, "cookies/shared/loads")
            latest = _number(raw[0])
            if latest < state.version:  # the keys were deleted and written again: start afresh
                state.jar.clear()
            now, jar = int(self._wallclock()), state.jar
            version = 0.0 if latest < state.version else state.version
            expired: list[str] = []
            for i in range(1, len(raw) - 2, 3):
                field, version, data = text(raw[i]), _number(raw[i + 1]), raw[i + 2]
                if data is None:  # deleted
                    apply_record(jar, field, None)
                    continue
                try:
                    cookie = self.seal.open(self.keys.cookie_jar(name), field, data)
                except ValueError as exc:
                    inc_stat(self.stats, "cookies/shared/rejected")
                    self._reject_log.log(logging.WARNING, "Skipped an invalid record in %s: %s",
                                         self.keys.cookie_jar(name), exc)
                    continue
                if cookie.is_expired(now):
                    expired.append(field)
                    apply_record(jar, field, None)
                else:
                    jar.set_cookie(cookie)
            state.version = version
            # Changes of this worker that Redis may not hold yet stay in the copy.
            for jar_name_, field, record in self.writer.pending():
                if jar_name_ == name:
                    apply_record(jar, field, record)
            # more changes than one read takes: the copy is not fresh yet, the next request reads on
            state.loaded_at = self._monotonic() if version >= latest else None
            if expired:  # housekeeping: nobody will send them again
                self._queue(name, dict.fromkeys(expired))
        finally:
            state.loading = None

    def _record_changes(self, name: str, before: dict[CookieIdent, dict[str, Any]],
                        jar: CookieJar) -> asyncio.Future[None] | None:
        """Queue the difference between ``before`` and the jar; the future resolves once it is written."""
        after, jar_key = snapshot(jar), self.keys.cookie_jar(name)
        ops: dict[str, str | None] = {(f := cookie_field(ident)): self.seal.seal(jar_key, f, rec)
                                      for ident, rec in after.items() if before.get(ident) != rec}
        ops.update((cookie_field(ident), None) for ident in before.keys() - after.keys())
        return self._queue(name, ops) if ops else None

    def _queue(self, name: str, ops: dict[str, str | None]) -> asyncio.Future[None]:
        written = [self.writer.add((name, field, record)) for field, record in ops.items()]
        return written[-1]  # batches are written in order: the last one written means all are

    async def _write(self, ops: list[tuple[str, str, str | None]]) -> None:
        """Write every changed cookie, one ``cookies_write`` call per jar, pipelined (the writer retries)."""
        calls, written = write_calls(self.keys, ops, repr(self._wallclock()))
        writes = [functools.partial(self._write_script, keys=k, args=a) for k, a in calls]
        await send_calls(self.server, writes)
        inc_stat(self.stats, "cookies/shared/written", written)


def _number(value: Any) -> float:
    with contextlib.suppress(TypeError, ValueError):
        return float(value)
    return 0.0
