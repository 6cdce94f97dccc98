"""Redis clients built from Scrapy settings -- the one place every component gets its connection (plain,
Sentinel or Cluster, with their outage options) -- and the start-up check that Redis answers.

Which Redis the settings point at is :mod:`scrapy_dist.redis.target` (re-exported here). Unreachable Redis
at start: :func:`check_reachable` raises :class:`RedisUnavailable` (one line naming the masked URL and the
setting to change); :func:`ensure_reachable` refuses the crawl's start with it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.retry
import redis.asyncio.sentinel
import redis.cluster
import redis.exceptions
import redis.sentinel
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.maint_notifications import MaintNotificationsConfig
from redis.retry import Retry

from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.redis import outage
from scrapy_dist.redis.target import RedisTarget, resolve_target, resolve_url
from scrapy_dist.settings import DistSettings, mask_url
from scrapy_dist.settings.reader import refuse_start

if TYPE_CHECKING:
    from collections.abc import Mapping

    from scrapy.crawler import Crawler
    from scrapy.settings import BaseSettings

    SettingsLike = BaseSettings | Mapping[str, Any]

__all__ = [
    "CONNECT_ERRORS", "DEFAULT_CLIENT_PARAMS", "OUTAGE_ERRORS", "ClientPool", "RedisTarget", "build_async",
    "build_sync", "check_reachable", "check_reachable_async", "ensure_reachable", "from_settings",
    "get_async_redis", "get_redis", "get_redis_from_settings", "is_cluster", "mask_url", "resolve_target",
    "resolve_url",
]


#: Client options applied before ``REDIS_PARAMS`` (which wins). Why these values: a dead host is
#: noticed within seconds (connect timeout, keepalive), a connection that sat idle across an outage is
#: checked before use (health check), and one dropped connection is retried instead of failing.
DEFAULT_CLIENT_PARAMS: dict[str, Any] = {
    "socket_connect_timeout": 5.0,
    # Long enough for a big pipeline or Lua call, short enough to notice a silent network split.
    "socket_timeout": 15.0,
    "socket_keepalive": True,
    "health_check_interval": 15,
}
# Options a unix-socket connection does not accept.
_TCP_ONLY_PARAMS = ("socket_keepalive", "socket_keepalive_options")
_RETRIES = 3

#: What "Redis did not answer" looks like; RedisClusterException is not a RedisError.
CONNECT_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)

_cluster_detected: dict[str, bool] = {}
#: rediss:// URLs whose port did not answer plain text (see _answers_plain)
_tls_checked: set[str] = set()


def _client_params(target: RedisTarget) -> dict[str, Any]:
    params = dict(DEFAULT_CLIENT_PARAMS)
    if target.is_unix:
        for name in _TCP_ONLY_PARAMS:
            params.pop(name, None)
    # redis-py 8 asks every new RESP3 connection to CLIENT MAINT_NOTIFICATIONS, which Redis < 8 refuses
    # with a DEBUG line per connection; the notifications serve managed Redis Enterprise only.
    params["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
    params.update(target.params)
    params.pop("sentinel_kwargs", None)  # for the Sentinels only, see _sentinel_kwargs()
    return params


def _detect_cluster(target: RedisTarget) -> bool:
    """Ask the server (``INFO cluster``) whether it runs in cluster mode; cached per URL.

    An unreachable server counts as "not a cluster" (and is not cached): the reachability check
    reports it properly. A server that accepts the connection but does not answer within
    ``socket_timeout`` raises :class:`~scrapy_dist.exceptions.RedisUnavailable` at once.
    """
    if target.cluster is not None:
        return target.cluster
    if target.is_unix:
        return False
    cached = _cluster_detected.get(target.url)
    if cached is not None:
        return cached
    params = _client_params(target)
    params["retry"] = Retry(_backoff(), 0)
    probe = redis.Redis.from_url(target.url, **params)
    try:
        enabled = bool(probe.info("cluster").get("cluster_enabled"))
    except (redis.exceptions.TimeoutError, TimeoutError) as exc:
        # Connected but no answer (a stopped server, a silent network split): the reachability check
        # would wait a socket_timeout more to say the same.
        raise target.unreachable(exc) from exc
    except (redis.RedisError, OSError):
        return False
    finally:
        probe.close()
    _cluster_detected[target.url] = enabled
    return enabled


#: how long the plain-text probe of a rediss:// port waits for an answer
PLAIN_PROBE_SECONDS = 1.0


def _answers_plain(target: RedisTarget) -> bool:
    """Whether the host and port of a ``rediss://`` URL answer a plain-text ``PING`` as Redis does: a TLS
    client there would wait for a handshake reply that never comes, timeout after timeout. A TLS port, or
    one silent for ``PLAIN_PROBE_SECONDS``, counts as "not plain" and is left to the real client."""
    parts = urlsplit(target.url)
    try:
        port = parts.port or 6379
    except ValueError:
        return False
    if not parts.hostname:
        return False
    try:
        with socket.create_connection((parts.hostname, port), timeout=PLAIN_PROBE_SECONDS) as sock:
            sock.sendall(b"PING\r\n")
            answer = sock.recv(64)
    except OSError:
        return False
    return answer.startswith((b"+PONG", b"-NOAUTH", b"-ERR", b"-WRONGPASS"))


def _sentinel_kwargs(target: RedisTarget, retry: Any) -> dict[str, Any]:
    """Options of the connections to the Sentinels themselves: the socket timeouts, plus
    ``REDIS_PARAMS["sentinel_kwargs"]`` (redis-py's name) for Sentinels that need a password or TLS.

    ``retry``: none by default -- there are other Sentinels to ask, and redis-py's default (up to ~10 s
    of backoff per Sentinel) would make a wrong Sentinel password take a minute to report.
    """
    params = _client_params(target)
    kwargs = {k: v for k, v in params.items() if k.startswith("socket_")}
    kwargs["retry"] = retry
    kwargs["maint_notifications_config"] = params["maint_notifications_config"]
    kwargs.update(target.params.get("sentinel_kwargs") or {})
    return kwargs


def _master_kwargs(target: RedisTarget) -> dict[str, Any]:
    parts = urlsplit(target.url)
    kwargs = _client_params(target)
    # percent-decoded, as redis-py's from_url() does for a URL with a host
    if parts.username:
        kwargs.setdefault("username", unquote(parts.username))
    if parts.password:
        kwargs.setdefault("password", unquote(parts.password))
    db = parts.path.lstrip("/")
    if db:
        kwargs.setdefault("db", int(db))
    if parts.scheme == "rediss":  # the master's host comes from the Sentinels, the scheme from the URL
        kwargs.setdefault("ssl", True)
    return kwargs


@dataclass(frozen=True)
class _Flavour:
    """The redis-py classes of one client flavour: sync or asyncio."""

    client: Any
    cluster: Any
    sentinel: Any
    retry: Any


_SYNC = _Flavour(redis.Redis, redis.cluster.RedisCluster, redis.sentinel.Sentinel, Retry)
_ASYNC = _Flavour(
    redis.asyncio.Redis, redis.asyncio.cluster.RedisCluster, redis.asyncio.sentinel.Sentinel,
    redis.asyncio.retry.Retry,
)


def _backoff() -> ExponentialWithJitterBackoff:
    return ExponentialWithJitterBackoff(cap=1.0, base=0.05)


def _retry(flavour: _Flavour) -> Any:
    """redis-py's retry of one command: ``_RETRIES`` times on a lost connection (refused, reset, closed),
    never on a timeout. A timeout has already waited ``socket_timeout``; retrying it (redis-py's default)
    kept a caller silent for four of them (a minute) behind a silent network split or a stopped server,
    and sent a write again that the server still executes when it wakes up (items written twice)."""
    return flavour.retry(_backoff(), _RETRIES, supported_errors=(redis.exceptions.ConnectionError,))


def _build(target: RedisTarget, flavour: _Flavour) -> Any:
    if target.sentinels:
        sentinel = flavour.sentinel(
            list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target, flavour.retry(NoBackoff(), 0))
        )
        kwargs = _master_kwargs(target)
        kwargs.setdefault("retry", _retry(flavour))
        return sentinel.master_for(target.sentinel_master, redis_class=flavour.client, **kwargs)
    if target.url.startswith("rediss:") and target.url not in _tls_checked:
        if _answers_plain(target):
            raise target.unreachable("the port speaks plain Redis, not TLS: use redis://")
        _tls_checked.add(target.url)
    params = _client_params(target)
    params.setdefault("retry", _retry(flavour))
    if _detect_cluster(target):
        try:
            return flavour.cluster.from_url(target.url, **params)
        except CONNECT_ERRORS as exc:
            # The sync cluster client connects when it is built (the asyncio one on first use).
            raise target.unreachable(exc) from exc
    return flavour.client.from_url(target.url, **params)


def build_sync(target: RedisTarget) -> redis.Redis:
    """A sync client for ``target``; a ``RedisCluster`` is typed as ``redis.Redis`` (the same command API),
    so callers need no union checks."""
    return cast("redis.Redis", _build(target, _SYNC))


def build_async(target: RedisTarget) -> redis.asyncio.Redis:
    """An asyncio client for ``target`` (see :func:`build_sync`)."""
    return cast("redis.asyncio.Redis", _build(target, _ASYNC))


class _SharedSync:
    """A client of a :class:`ClientPool`: ``close()`` leaves it open for the crawler's other components."""

    def close(self, *args: Any, **kwargs: Any) -> None:
        return None

    def close_shared(self) -> None:
        super().close()  # type: ignore[misc]


class _SharedAsync:
    """An asyncio client of a :class:`ClientPool`: ``aclose()`` leaves it open for the other components."""

    async def aclose(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def close(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def close_shared(self) -> None:
        await super().aclose()  # type: ignore[misc]


def _shared(flavour: _Flavour, mixin: type) -> _Flavour:
    def sub(cls: type) -> type:
        return type(f"Shared{cls.__name__}", (mixin, cls), {})

    return _Flavour(sub(flavour.client), sub(flavour.cluster), flavour.sentinel, flavour.retry)


_SHARED_SYNC = _shared(_SYNC, _SharedSync)
_SHARED_ASYNC = _shared(_ASYNC, _SharedAsync)
_POOLS: weakref.WeakKeyDictionary[Any, ClientPool] = weakref.WeakKeyDictionary()


class ClientPool:
    """One crawler's Redis clients -- one synchronous, one asyncio, each with its connection pool -- built
    on first use and shared by every component of the crawler (:meth:`of` in ``from_crawler``).

    Closing one of them is a no-op, so a component that closes what it was given (as scrapy-redis's do)
    cannot cut the others off; the pool closes both once the engine has stopped.
    """

    def __init__(self, target: RedisTarget) -> None:
        self.target = target
        self._sync: Any = None
        self._async: Any = None

    @classmethod
    def of(cls, crawler: Crawler) -> ClientPool:
        """The pool of ``crawler``, made on first use and closed when its engine stops."""
        pool = _POOLS.get(crawler)
        if pool is None:
            from scrapy import signals

            pool = _POOLS[crawler] = cls(resolve_target(DistSettings.for_crawler(crawler)))
            crawler.signals.connect(pool.close, signal=signals.engine_stopped)
        return pool

    def sync_client(self) -> redis.Redis:
        if self._sync is None:
            self._sync = _build(self.target, _SHARED_SYNC)
        return cast("redis.Redis", self._sync)

    def async_client(self) -> redis.asyncio.Redis:
        if self._async is None:
            self._async = _build(self.target, _SHARED_ASYNC)
        return cast("redis.asyncio.Redis", self._async)

    async def close(self) -> None:
        sync, self._sync = self._sync, None
        client, self._async = self._async, None
        if sync is not None:
            sync.close_shared()
        if client is not None:
            await client.close_shared()


def get_redis(settings: SettingsLike | DistSettings | None = None, /, **kwargs: Any) -> redis.Redis:
    """A synchronous client for the Redis the settings point at (a ``RedisCluster`` for a cluster, typed
    as ``redis.Redis``: :func:`is_cluster` tells). Does not check that Redis answers, except that a cluster
    client connects when built. scrapy-redis's keyword call works too (``url=``, ``host=``, ``port=``,
    ``db=``, ``redis_cls=`` builds exactly as scrapy-redis does); with nothing at all it is the Redis a
    crawl without settings uses, not ``localhost:6379`` (docs/connection.md, "For component authors").
    """
    if settings is not None and kwargs:
        raise TypeError("get_redis() takes settings or scrapy-redis keywords (url=, host=, ...), not both")
    if settings is None:
        return _redis_from_keywords(dict(kwargs))
    return build_sync(resolve_target(settings))


#: scrapy-redis's ``get_redis(**kwargs)`` keywords that name a setting here.
_KEYWORD_SETTINGS = {"url": "REDIS_URL", "host": "REDIS_HOST", "port": "REDIS_PORT"}


def _redis_from_keywords(kwargs: dict[str, Any]) -> redis.Redis:
    """scrapy-redis's ``get_redis(url=..., host=..., port=..., db=..., redis_cls=..., **params)``."""
    redis_cls = kwargs.pop("redis_cls", None)
    if isinstance(redis_cls, str):
        from scrapy.utils.misc import load_object

        redis_cls = load_object(redis_cls)
    if redis_cls is not None:
        # a client class of one's own: built exactly as scrapy-redis builds it, no options added
        url = kwargs.pop("url", None)
        return cast("redis.Redis", redis_cls.from_url(url, **kwargs) if url else redis_cls(**kwargs))
    settings: dict[str, Any] = {}
    for word, name in _KEYWORD_SETTINGS.items():
        if kwargs.get(word) not in (None, ""):
            settings[name] = kwargs.pop(word)
        kwargs.pop(word, None)
    db = kwargs.pop("db", None)
    if db is not None:
        if "REDIS_URL" in settings:
            kwargs["db"] = db  # redis-py: a db keyword wins over the URL's
        else:
            settings["REDIS_URL"] = _url_with_db(settings, db)
            settings.pop("REDIS_HOST", None)
            settings.pop("REDIS_PORT", None)
    settings["REDIS_PARAMS"] = kwargs
    return build_sync(resolve_target(settings))


def _url_with_db(settings: dict[str, Any], db: Any) -> str:
    host = settings.get("REDIS_HOST") or "localhost"
    port = settings.get("REDIS_PORT") or 6379
    host = f"[{host}]" if ":" in str(host) else host
    return f"redis://{host}:{int(port)}/{int(db)}"


def get_redis_from_settings(settings: SettingsLike | DistSettings) -> redis.Redis:
    """scrapy-redis's name for :func:`get_redis` called with settings."""
    return get_redis(settings)


#: scrapy-redis's other name for :func:`get_redis_from_settings`.
from_settings = get_redis_from_settings


def get_async_redis(settings: SettingsLike | DistSettings) -> redis.asyncio.Redis:
    """A ``redis.asyncio`` client with the same configuration as :func:`get_redis` (or a
    ``redis.asyncio.cluster.RedisCluster``). Connects lazily, on first use."""
    return build_async(resolve_target(settings))


def is_cluster(client: Any) -> bool:
    """Whether ``client`` (sync or async) is a Redis Cluster client."""
    return isinstance(client, (redis.cluster.RedisCluster, redis.asyncio.cluster.RedisCluster))


logger = logging.getLogger(__name__)

#: What a client raises while Redis is down, restarting or failing over: the one definition lives in
#: :mod:`scrapy_dist.redis.outage` (re-exported here for callers that imported it from this module).
OUTAGE_ERRORS = outage.OUTAGE_ERRORS


def _describe(client: Any) -> RedisTarget:
    """A best-effort target description of a client built elsewhere (for the error message)."""
    if is_cluster(client):
        node = client.get_default_node()
        url = f"redis://{node.host}:{node.port}/0" if node else "redis://<cluster>"
        return RedisTarget(url=url, setting="REDIS_URL")
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    userinfo = ""
    if kwargs.get("password"):
        userinfo = f"{kwargs.get('username') or ''}:{kwargs['password']}@"
    if kwargs.get("path"):
        url = f"unix://{userinfo}{kwargs['path']}?db={kwargs.get('db', 0)}"
    else:
        host, port = kwargs.get("host", "localhost"), kwargs.get("port", 6379)
        url = f"redis://{userinfo}{host}:{port}/{kwargs.get('db', 0)}"
    return RedisTarget(url=url, setting="REDIS_URL")


def _is_settings(obj: Any) -> bool:
    return isinstance(obj, DistSettings) or (not hasattr(obj, "ping") and hasattr(obj, "get"))


def check_reachable(client_or_settings: Any, settings: SettingsLike | DistSettings | None = None) -> None:
    """Raise :class:`RedisUnavailable` -- one line naming the masked URL and the setting to change --
    unless Redis answers ``PING`` (one round trip). Pass a sync client (and, for a precise message, the
    settings it came from), or just the settings."""
    if _is_settings(client_or_settings):
        target = resolve_target(client_or_settings)
        client = build_sync(target)
        owned = True
    else:
        client = client_or_settings
        target = resolve_target(settings) if settings is not None else _describe(client)
        owned = False
    try:
        answer = client.ping()
    except CONNECT_ERRORS as exc:
        raise target.unreachable(exc) from exc
    finally:
        if owned:
            client.close()
    if asyncio.iscoroutine(answer):
        answer.close()
        raise TypeError("check_reachable() got a redis.asyncio client; use check_reachable_async()")


async def check_reachable_async(client: Any, settings: SettingsLike | DistSettings | None = None) -> None:
    """:func:`check_reachable` for a ``redis.asyncio`` client."""
    target = resolve_target(settings) if settings is not None else _describe(client)
    try:
        await client.ping()
    except CONNECT_ERRORS as exc:
        raise target.unreachable(exc) from exc


def ensure_reachable(crawler: Crawler) -> bool:
    """Start-up check for a component handed the crawler (in ``from_crawler()`` or ``open()``): True if
    the crawl's Redis answers ``PING``; otherwise (or if the embedded server cannot start, or a setting is
    bad) the crawl's start is refused -- one ERROR line naming the masked URL and the setting, a clean
    stop, exit status 1 for ``scrapy crawl`` -- and False: the component then opens nothing. One round
    trip. Without a crawler, call :func:`check_reachable` and decide what its exception means."""
    try:
        check_reachable(DistSettings.for_crawler(crawler))
    except ScrapyDistError as exc:
        refuse_start(crawler, exc)
        return False
    return True
