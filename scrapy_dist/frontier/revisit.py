"""Revisits: the frontier fetches a page again some time after it was fetched successfully
(docs/continuous.md, "Revisits" and "Conditional revisits").

``request.meta["revisit_after"]`` or a matching ``REVISIT_AFTER`` rule makes the request's ack also file
it again in the delayed set, in the same atomic sync call (``lua/sync_settle.lua``), so the ack and the
re-schedule land together or not at all. A chain goes on while each fetch succeeds (status below 400, or
a 304 of a conditional revisit) and its callback does not raise or set ``revisit_after = None``. With
``REVISIT_CONDITIONAL`` the entry carries the page's validators (:func:`validators_of`) in its payload.
:class:`Revisits` is what the scheduler's ledger asks when a request is finished (``Ledger.riders``).

A chain lives as one scheduled revisit in a shard's delayed set (delayed meta ``"<score> r"``) or as the
request a worker is fetching: ``scrapy-dist close`` and ``scrapy-dist forget URL`` remove the first kind
(:func:`end_chains`), a closing worker ends the second (:meth:`Revisits.stop`).
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

import msgpack
import redis
from scrapy import signals
from scrapy.utils.httpobj import urlparse_cached

from scrapy_dist.exceptions import RejectedEntry
from scrapy_dist.frontier.shard import PRIORITY_KEY_BYTES, SEQ_BYTES, lease_member
from scrapy_dist.settings.values import check_seconds
from scrapy_dist.wire.codec import load_payload
from scrapy_dist.wire.entrypolicy import DEFAULT_POLICY, entry_policy

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.crawler import Crawler
    from typing_extensions import Self

    from scrapy_dist.redis.keys import CrawlKeys
    from scrapy_dist.wire.entrypolicy import EntryPolicy

logger = logging.getLogger(__name__)

#: the meta key a request (or its callback) sets: seconds, or None to stop
META_KEY = "revisit_after"
#: validators longer than this are not stored (the page is revisited unconditionally)
MAX_VALIDATOR_BYTES = 256
VALIDATOR_HEADERS = (b"If-None-Match", b"If-Modified-Since")
_NOT_SET = object()


def _specificity(pattern: str) -> tuple[int, int]:
    wild = sum(pattern.count(c) for c in "*?[")
    return (0 if wild else 1, len(pattern) - wild)


class RevisitRules:
    """``REVISIT_AFTER`` rules: a glob with a ``/`` matches the whole URL, any other glob the host name
    (case-insensitive). URL rules are tried before host rules (they name paths: a site's default is a
    host rule, its exceptions URL rules); within each kind the most specific wins as for
    ``DOMAIN_LIMITS`` (no wildcard first, then the most literal characters)."""

    def __init__(self, rules: Mapping[str, float | None] | None = None) -> None:
        ordered = sorted(
            (rules or {}).items(), key=lambda kv: ("/" in kv[0], *_specificity(kv[0].lower())), reverse=True
        )
        self.rules = [(p.lower(), "/" in p, s) for p, s in ordered]

    def __bool__(self) -> bool:
        return bool(self.rules)

    def for_url(self, url: str, host: str) -> Any:
        """The delay of the most specific matching rule (None: no revisit), or ``_NOT_SET``."""
        low_url, low_host = url.lower(), host.lower()
        for pattern, on_url, seconds in self.rules:
            if fnmatch.fnmatchcase(low_url if on_url else low_host, pattern):
                return seconds
        return _NOT_SET


def validators_of(headers: Any) -> dict[bytes, bytes]:
    """The conditional request headers a response's ``ETag`` / ``Last-Modified`` allow (bounded, one line
    each, printable ASCII); a validator failing that is left out."""
    out = {}
    for source, target in ((b"ETag", b"If-None-Match"), (b"Last-Modified", b"If-Modified-Since")):
        value = headers.get(source)
        if not value or len(value) > MAX_VALIDATOR_BYTES or any(c < 32 or c > 126 for c in value):
            continue
        out[target] = bytes(value)
    return out


def with_validators(payload: bytes, validators: Mapping[bytes, bytes], policy: EntryPolicy) -> bytes:
    """``payload`` (an encoded request) with its conditional headers replaced by ``validators``; signed
    again only if it was signed (an untrusted entry stays untrusted). Raises RejectedEntry for a payload
    that does not decode (the caller keeps the old one)."""
    signed = policy.verify(payload)
    d = load_payload(payload, policy.max_bytes)
    drop = {h.lower() for h in VALIDATOR_HEADERS}
    headers = [pair for pair in d.get("h", []) if bytes(pair[0]).lower() not in drop]
    headers += [[k, [v]] for k, v in validators.items()]
    if headers:
        d["h"] = headers
    else:
        d.pop("h", None)
    body = msgpack.packb(d, use_bin_type=True)
    return policy.seal(body) if signed else DEFAULT_POLICY.seal(body)


def member_prefix(member: bytes, polite: bool) -> bytes:
    """The part of a queue member before its payload (seq, or domain, priority key and seq)."""
    if polite:
        return member[: member.index(b"\0") + 1 + PRIORITY_KEY_BYTES + SEQ_BYTES]
    return member[:SEQ_BYTES]


#: the downloader middleware that turns a conditional revisit's 304 into "not modified"
MIDDLEWARE = "scrapy_dist.middlewares.ConditionalRevisitMiddleware"


def _middleware_enabled(settings: Any) -> bool:
    """Whether DOWNLOADER_MIDDLEWARES enables the middleware (or a subclass of it)."""
    from scrapy.utils.misc import load_object

    for path, order in settings.getwithbase("DOWNLOADER_MIDDLEWARES").items():
        try:
            cls = load_object(path) if isinstance(path, str) else path
        except (ImportError, ValueError, NameError, AttributeError):
            continue
        if order is not None and getattr(cls, "turns_304_into_not_modified", False):
            return True
    return False


class Revisits:
    """Decides, when the engine has finished a request, whether and when the frontier fetches it again
    (see the module docstring). Reactor thread only; no I/O.

    Stats: ``revisit/scheduled``, ``revisit/stopped`` (the callback set ``revisit_after = None`` or
    raised), ``revisit/invalid`` (a ``revisit_after`` that is not a number of seconds: logged once),
    ``revisit/raised`` (a ``revisit_after`` below ``REVISIT_MIN_INTERVAL``, raised to it).
    """

    def __init__(
        self,
        rules: RevisitRules | None = None,
        conditional: bool = False,
        polite: bool = False,
        policy: EntryPolicy | None = None,
        stats: Any = None,
        min_interval: float = 0.0,
    ) -> None:
        self.rules = rules or RevisitRules()
        #: REVISIT_MIN_INTERVAL: a shorter ``revisit_after`` is raised to it
        self.min_interval = min_interval
        #: set by :meth:`stop`: the crawl was closed, no chain goes on
        self.stopped = False
        self.conditional = conditional
        self.polite = polite
        self.policy = policy
        self.stats = stats
        #: request -> True (fetched; its callback did not raise) / False (the chain stops)
        self.outcome: dict[Any, bool] = {}
        #: request -> validators to carry into its revisit (REVISIT_CONDITIONAL)
        self.validators: dict[Any, dict[bytes, bytes]] = {}
        self._warned = False

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        from scrapy_dist.settings import DistSettings

        cfg = DistSettings.for_crawler(crawler).scheduler
        o = cls(
            RevisitRules(cfg.revisit_after), cfg.revisit_conditional, cfg.politeness == "cluster",
            entry_policy(crawler), crawler.stats, cfg.revisit_min_interval,
        )
        crawler.signals.connect(o.response_received, signal=signals.response_received)
        crawler.signals.connect(o.spider_error, signal=signals.spider_error)
        if o.conditional and not _middleware_enabled(crawler.settings):
            logger.warning(
                "REVISIT_CONDITIONAL is on but %s is not in DOWNLOADER_MIDDLEWARES: revisits send"
                " If-None-Match / If-Modified-Since, and their 304 answers reach HttpErrorMiddleware instead"
                " of being counted as unchanged pages. Enable the add-on (ADDONS = {'scrapy_dist.Addon': 0})"
                " or add the middleware at 580", MIDDLEWARE,
            )
        return o

    def _refiled(self, member: bytes, validators: dict[bytes, bytes] | None) -> bytes:
        """The queue member a revisit files (b"": ``member`` itself): with the page's validators
        (``REVISIT_CONDITIONAL``), and signed afresh -- a new nonce, so that the acknowledged entry,
        remembered by the sync script, is not taken for its revisit."""
        policy = self.policy
        assert policy is not None
        try:
            prefix = member_prefix(member, self.polite)
            payload = member[len(prefix) :]
            if self.conditional and validators is not None:
                patched = with_validators(payload, validators, policy)
            else:
                patched = policy.renew(payload)
            if patched != payload and len(patched) <= policy.max_bytes:
                return prefix + patched
        except Exception:  # a member we cannot patch is revisited as it is  # noqa: BLE001
            pass
        return b""

    # -- signals -------------------------------------------------------------------------------------
    def response_received(self, response: Any, request: Request, spider: Any = None) -> None:
        if response.status < 400 and self.wanted(request):
            self.outcome.setdefault(request, True)
            if self.conditional and response.status != 304:
                self.validators[request] = validators_of(response.headers)

    def spider_error(self, failure: Any, response: Any, spider: Any = None) -> None:
        request = getattr(response, "request", None)
        if request is not None and request in self.outcome:
            self.outcome[request] = False

    def not_modified(self, request: Request) -> None:
        """A conditional revisit answered 304 (the middleware): the page counts as fetched, unchanged."""
        if self.wanted(request):
            self.outcome[request] = True

    # -- decisions -----------------------------------------------------------------------------------
    def delay_for(self, request: Request) -> float | None:
        """The revisit delay of ``request``: its meta's ``revisit_after`` if set (None: no revisit), else
        the most specific ``REVISIT_AFTER`` rule, else None."""
        if META_KEY in request.meta:
            try:
                seconds = check_seconds(request.meta[META_KEY])
                if seconds is not None and seconds < self.min_interval:
                    if self.stats is not None:
                        self.stats.inc_value("revisit/raised")
                    return self.min_interval
                return seconds
            except ValueError as exc:
                if self.stats is not None:
                    self.stats.inc_value("revisit/invalid")
                if not self._warned:
                    self._warned = True
                    logger.warning(
                        "meta['revisit_after'] of %s: %s; not revisited (logged once)", request, exc
                    )
                return None
        if not self.rules:
            return None
        seconds = self.rules.for_url(request.url, urlparse_cached(request).hostname or "")
        return None if seconds is _NOT_SET else seconds

    def stop(self) -> None:
        """End every chain this worker would go on with (``scrapy-dist close``): finished requests are
        acknowledged without being filed again."""
        self.stopped = True

    def wanted(self, request: Request) -> bool:
        """Whether ``request`` asked for a revisit (before its callback had a say)."""
        return META_KEY in request.meta or bool(self.rules)

    def plan(self, request: Request, lease: tuple[int, bytes]) -> tuple[float, bytes] | None:
        """The ledger's question when ``request`` (leased as ``lease``) is finished: ``(delay, new
        member or b"")`` to file it again, or None."""
        ok = self.outcome.pop(request, None) and not self.stopped
        validators = self.validators.pop(request, None)
        if not ok:
            if ok is False and self.stats is not None:
                self.stats.inc_value("revisit/stopped")
            return None
        delay = self.delay_for(request)
        if delay is None:
            if META_KEY in request.meta and self.stats is not None:
                self.stats.inc_value("revisit/stopped")
            return None
        new = b""
        if self.policy is not None and (self.policy.secret is not None or validators is not None):
            new = self._refiled(lease_member(lease[1]), validators)
        if self.stats is not None:
            self.stats.inc_value("revisit/scheduled")
        return delay, new


# -- ending chains from outside the workers -------------------------------------------------------
#: delayed meta fields read per HSCAN call
SCAN_COUNT = 1000


def entry_url(member: bytes, polite: bool) -> str | None:
    """The URL of a queue or delayed member (None if it does not decode: it names no URL)."""
    try:
        url = load_payload(member[len(member_prefix(member, polite)) :]).get("u")
    except (RejectedEntry, ValueError):
        return None
    return url if isinstance(url, str) else None


def end_chains(
    client: Any, shard_keys: list[CrawlKeys], polite: bool, urls: Collection[str] | None = None
) -> int:
    """Remove the scheduled revisits of ``urls`` (None: all of them) from every shard's delayed set;
    returns how many. Costs an HSCAN of each shard's delayed meta and one pipelined round trip per
    batch removed; a delayed meta of another Redis type holds no chain (the workers move it aside)."""
    ended = 0
    for keys in shard_keys:
        found: list[bytes] = []
        try:
            for member, meta in client.hscan_iter(keys.delayed_meta, count=SCAN_COUNT):
                if not (isinstance(meta, bytes) and meta.endswith(b" r")) or member == b"revisits":
                    continue
                if urls is None or entry_url(member, polite) in urls:
                    found.append(member)
        except redis.ResponseError:  # WRONGTYPE
            continue
        removed = 0
        for i in range(0, len(found), SCAN_COUNT):
            pipe = client.pipeline(transaction=False)
            for member in found[i : i + SCAN_COUNT]:
                pipe.zrem(keys.delayed, member)
                pipe.hdel(keys.delayed_meta, member)
            removed += sum(pipe.execute()[::2])
        if removed:
            _uncount(client, keys.delayed_meta, removed)
        ended += removed
    return ended


def _uncount(client: Any, key: str, n: int) -> None:
    """Take ``n`` off the scheduled revisit count (read as untrusted: garbage restarts at 0)."""
    raw = client.hget(key, "revisits")
    try:
        left = int(raw or 0)
    except ValueError:
        left = 0
    client.hset(key, "revisits", max(0, left - n))
