"""Redis clients built from Scrapy settings (plain, Sentinel or Cluster; which Redis is
:mod:`scrapy_dist.redis.target`) and the start-up check that Redis answers."""

from __future__ import annotations

import asyncio
import socket
import weakref
from collections import namedtuple
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

import redis
import redis.asyncio.cluster
import redis.asyncio.retry
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.connection import parse_url
from redis.maint_notifications import MaintNotificationsConfig
from redis.retry import Retry
from scrapy import signals
from scrapy.utils.misc import load_object

from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.redis.outage import READ_ERRORS as CONNECT_ERRORS  # what "Redis did not answer" looks like
from scrapy_dist.redis.target import RedisTarget, resolve_target, resolve_url  # noqa: F401 - re-exported
from scrapy_dist.settings import DistSettings, mask_url  # noqa: F401 - re-exported
from scrapy_dist.settings.reader import refuse_start

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

    from scrapy_dist.redis.target import SettingsLike

#: Client options REDIS_PARAMS may override (socket_timeout: long for a big call, short for a silent split)
DEFAULT_CLIENT_PARAMS: dict[str, Any] = {"socket_connect_timeout": 5.0, "socket_timeout": 15.0,
                                         "socket_keepalive": True, "health_check_interval": 15}
_TCP_ONLY = ("socket_keepalive", "socket_keepalive_options")  # refused by a unix-socket connection
_RETRIES, _BACKOFF = 3, ExponentialWithJitterBackoff(cap=1.0, base=0.05)  # a stateless backoff: shared
_cluster_detected: dict[str, bool] = {}
_tls_checked: set[str] = set()  # rediss:// URLs whose port did not answer plain text


def _client_params(target: RedisTarget) -> dict[str, Any]:
    params = {k: v for k, v in DEFAULT_CLIENT_PARAMS.items() if not (target.is_unix and k in _TCP_ONLY)}
    # redis-py 8 asks every new RESP3 connection to CLIENT MAINT_NOTIFICATIONS, which Redis < 8 refuses
    # with a DEBUG line per connection; the notifications serve managed Redis Enterprise only.
    params["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
    params.update(target.params)
    params.pop("sentinel_kwargs", None)  # for the Sentinels only, see _sentinel_kwargs()
    return params


def _detect_cluster(target: RedisTarget) -> bool:
    """Whether the server runs in cluster mode (cached per URL; an unreachable one is not)."""
    if target.cluster is not None or target.is_unix:
        return bool(target.cluster)
    if target.url in _cluster_detected:
        return _cluster_detected[target.url]
    probe = redis.Redis.from_url(target.url, **{**_client_params(target), "retry": Retry(_BACKOFF, 0)})
    try:
        enabled = bool(probe.info("cluster").get("cluster_enabled"))
    except (redis.exceptions.TimeoutError, TimeoutError) as exc:  # a stopped server, a silent split
        raise target.unreachable(exc) from exc
    except (redis.RedisError, OSError):
        return False
    finally:
        probe.close()
    _cluster_detected[target.url] = enabled
    return enabled


def _answers_plain(target: RedisTarget) -> bool:
    """Whether a ``rediss://`` URL's port answers a plain-text ``PING`` (TLS would wait for ever)."""
    parts = urlsplit(target.url)
    try:
        if not parts.hostname:
            return False
        with socket.create_connection((parts.hostname, parts.port or 6379), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            answer = sock.recv(64)
    except (OSError, ValueError):  # ValueError: a port out of range
        return False
    return answer.startswith((b"+PONG", b"-NOAUTH", b"-ERR", b"-WRONGPASS"))


def _sentinel_kwargs(target: RedisTarget, retry: Any) -> dict[str, Any]:
    """Options of the connections to the Sentinels, plus ``REDIS_PARAMS["sentinel_kwargs"]``."""
    params = _client_params(target)
    kwargs = {k: v for k, v in params.items() if k.startswith("socket_")}
    kwargs.update(retry=retry, maint_notifications_config=params["maint_notifications_config"])
    kwargs.update(target.params.get("sentinel_kwargs") or {})
    return kwargs


def _master_kwargs(target: RedisTarget) -> dict[str, Any]:
    kwargs = _client_params(target)
    parsed = parse_url(target.url)  # credentials percent-decoded, as from_url() does
    kwargs.update({k: parsed[k] for k in ("username", "password", "db") if parsed.get(k) and k not in kwargs})
    if target.url.startswith("rediss:"):  # the master's host is the Sentinels' answer, its scheme the URL's
        kwargs.setdefault("ssl", True)
    return kwargs


class AsyncRedisCluster(redis.asyncio.cluster.RedisCluster):
    """redis-py's asyncio cluster client, reading an FCALL's slot from its keys, not COMMAND GETKEYS."""

    async def _determine_slot(self, *args: Any) -> Any:
        if (len(args) > 2 and str(args[0]).upper() in ("FCALL", "FCALL_RO")
                and len(slots := {self.keyslot(key) for key in args[3:3 + int(args[2])]}) == 1):
            return slots.pop()
        return await super()._determine_slot(*args)  # keys of several slots are refused there, as before


_Flavour = namedtuple("_Flavour", "client cluster sentinel retry")  #: redis-py's classes, sync or asyncio
_SYNC = _Flavour(redis.Redis, redis.cluster.RedisCluster, redis.sentinel.Sentinel, Retry)
_ASYNC = _Flavour(redis.asyncio.Redis, AsyncRedisCluster, redis.asyncio.sentinel.Sentinel,
                  redis.asyncio.retry.Retry)


def _retry(flavour: _Flavour) -> Any:
    """Retry a command on a lost connection, never on a timeout (a write the server may still run)."""
    return flavour.retry(_BACKOFF, _RETRIES, supported_errors=(redis.exceptions.ConnectionError,))


def _build(target: RedisTarget, flavour: _Flavour) -> Any:
    if target.sentinels:
        retry = flavour.retry(NoBackoff(), 0)  # none for the Sentinels: there are others to ask
        sentinel = flavour.sentinel(list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target, retry))
        kwargs = {"retry": _retry(flavour), **_master_kwargs(target)}  # REDIS_PARAMS may set its own
        return sentinel.master_for(target.sentinel_master, redis_class=flavour.client, **kwargs)
    if target.url.startswith("rediss:") and target.url not in _tls_checked:
        if _answers_plain(target):
            raise target.unreachable("the port speaks plain Redis, not TLS: use redis://")
        _tls_checked.add(target.url)
    params = {"retry": _retry(flavour), **_client_params(target)}
    if _detect_cluster(target):
        try:  # the sync cluster client connects when it is built
            return flavour.cluster.from_url(target.url, **params)
        except CONNECT_ERRORS as exc:
            raise target.unreachable(exc) from exc
    return flavour.client.from_url(target.url, **params)


def build_sync(target: RedisTarget) -> redis.Redis:
    """A sync client for ``target`` (a ``RedisCluster`` is typed as ``redis.Redis``: the same command API)."""
    return cast("redis.Redis", _build(target, _SYNC))


def build_async(target: RedisTarget) -> redis.asyncio.Redis:
    return cast("redis.asyncio.Redis", _build(target, _ASYNC))


async def _keep_open_async(*args: Any, **kwargs: Any) -> None:
    """``close()`` and ``aclose()`` of a :class:`ClientPool`'s client: a no-op, the pool closes it for all."""


def _shared(flavour: _Flavour, **no_ops: Any) -> _Flavour:
    client, cluster = (type(f"Shared{c.__name__}", (c,), no_ops) for c in (flavour.client, flavour.cluster))
    return flavour._replace(client=client, cluster=cluster)


_SHARED_SYNC = _shared(_SYNC, close=lambda *args, **kwargs: None)  # as _keep_open_async, sync
_SHARED_ASYNC = _shared(_ASYNC, close=_keep_open_async, aclose=_keep_open_async)
_POOLS: weakref.WeakKeyDictionary[Any, ClientPool] = weakref.WeakKeyDictionary()


class ClientPool:
    """One crawler's Redis clients, one sync and one asyncio, shared by its components (:meth:`of`);
    closing one is a no-op: the pool closes both when the engine stops."""

    def __init__(self, target: RedisTarget) -> None:
        self.target = target
        self._sync: Any = None
        self._async: Any = None

    @classmethod
    def of(cls, crawler: Crawler) -> ClientPool:
        """The pool of ``crawler``, made on first use and closed when its engine stops."""
        if (pool := _POOLS.get(crawler)) is None:
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
        sync, client, self._sync, self._async = self._sync, self._async, None, None
        if sync is not None:  # the client's own close, past the no-op
            super(type(sync), sync).close()  # type: ignore[misc]
        if client is not None:
            await super(type(client), client).aclose()  # type: ignore[misc]


def get_redis(settings: SettingsLike | DistSettings | None = None, /, **kwargs: Any) -> redis.Redis:
    """A sync client for the Redis the settings point at (not checked to answer), or scrapy-redis's keyword
    call (``url=``, ``host=``, ``port=``, ``db=``, ``redis_cls=``); with nothing, a crawl's default Redis."""
    if settings is not None and kwargs:
        raise TypeError("get_redis() takes settings or scrapy-redis keywords (url=, host=, ...), not both")
    return _redis_from_keywords(dict(kwargs)) if settings is None else build_sync(resolve_target(settings))


def _redis_from_keywords(kwargs: dict[str, Any]) -> redis.Redis:
    """scrapy-redis's ``get_redis(url=..., host=..., port=..., db=..., redis_cls=..., **params)``."""
    if (redis_cls := kwargs.pop("redis_cls", None)) is not None:  # built as scrapy-redis does it
        redis_cls = load_object(redis_cls) if isinstance(redis_cls, str) else redis_cls
        url = kwargs.pop("url", None)
        return cast("redis.Redis", redis_cls.from_url(url, **kwargs) if url else redis_cls(**kwargs))
    given = {word: kwargs.pop(word, None) for word in ("url", "host", "port")}  # REDIS_URL, REDIS_HOST, ...
    settings: dict[str, Any] = {f"REDIS_{w.upper()}": v for w, v in given.items() if v not in (None, "")}
    if (db := kwargs.pop("db", None)) is not None and "REDIS_URL" in settings:
        kwargs["db"] = db  # redis-py: a db keyword wins over the URL's
    elif db is not None:
        host, port = settings.get("REDIS_HOST") or "localhost", settings.get("REDIS_PORT") or 6379
        host = f"[{host}]" if ":" in str(host) else host
        settings = {"REDIS_URL": f"redis://{host}:{int(port)}/{int(db)}"}
    settings["REDIS_PARAMS"] = kwargs
    return build_sync(resolve_target(settings))


get_redis_from_settings = from_settings = get_redis  #: scrapy-redis's names for it, called with settings


def get_async_redis(settings: SettingsLike | DistSettings) -> redis.asyncio.Redis:
    """A ``redis.asyncio`` client configured as :func:`get_redis`'s; connects on first use."""
    return build_async(resolve_target(settings))


def is_cluster(client: Any) -> bool:
    return isinstance(client, (redis.cluster.RedisCluster, redis.asyncio.cluster.RedisCluster))


async def send_calls(server: Any, calls: Sequence[Callable[..., Any]], transaction: bool = False) -> None:
    """``call(client=...)`` for each of ``calls`` in one pipeline; sent apart, together, if there is one or on
    a cluster (several slots share no MULTI, and a redis.asyncio cluster pipeline does not load scripts)."""
    if len(calls) == 1 or is_cluster(server):
        await asyncio.gather(*(call(client=server) for call in calls))
        return
    async with server.pipeline(transaction=transaction) as pipe:
        for call in calls:
            if asyncio.iscoroutine(queued := call(client=pipe)):  # a script call queues when awaited
                await queued
        await pipe.execute()


def _describe(client: Any, settings: SettingsLike | DistSettings | None) -> RedisTarget:
    """The target of ``settings``, else a best-effort one of a client built elsewhere (for the error)."""
    if settings is not None:
        return resolve_target(settings)
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    userinfo = f"{kwargs.get('username') or ''}:{kwargs['password']}@" if kwargs.get("password") else ""
    db = kwargs.get("db", 0)
    if is_cluster(client):
        node = client.get_default_node()
        url = f"redis://{node.host}:{node.port}/0" if node else "redis://<cluster>"
    elif kwargs.get("path"):
        url = f"unix://{userinfo}{kwargs['path']}?db={db}"
    else:
        url = f"redis://{userinfo}{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}/{db}"
    return RedisTarget(url=url, setting="REDIS_URL")


def check_reachable(client_or_settings: Any, settings: SettingsLike | DistSettings | None = None) -> None:
    """Raise :class:`RedisUnavailable` unless Redis answers ``PING`` (a sync client, or settings)."""
    obj = client_or_settings
    owned = isinstance(obj, DistSettings) or (not hasattr(obj, "ping") and hasattr(obj, "get"))
    target = resolve_target(obj) if owned else _describe(obj, settings)
    client = build_sync(target) if owned else obj
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
    target = _describe(client, settings)
    try:
        await client.ping()
    except CONNECT_ERRORS as exc:
        raise target.unreachable(exc) from exc


def ensure_reachable(crawler: Crawler) -> bool:
    """Start-up check: True if the crawl's Redis answers ``PING``; else the crawl's start is refused (one
    ERROR line, a clean stop, exit status 1) and False: the component then opens nothing."""
    try:
        check_reachable(DistSettings.for_crawler(crawler))
    except ScrapyDistError as exc:
        refuse_start(crawler, exc)
        return False
    return True
