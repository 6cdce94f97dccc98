"""Redis clients built from Scrapy settings -- the one place every component gets its connection.

Which Redis (first match wins):

1. ``REDIS_URL``: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://`` (TLS) or
   ``unix://[[user]:password@]/path/to/socket[?db=N]``;
2. ``REDIS_SENTINELS`` (``["host:port", ...]``) with ``REDIS_SENTINEL_MASTER``; user, password and db of
   the master then come from ``REDIS_URL`` if that is set as well;
3. ``REDIS_HOST`` / ``REDIS_PORT`` (scrapy-redis names, for people migrating);
4. the ``REDIS_URL`` environment variable;
5. nothing: the embedded Redis of this project (:mod:`scrapy_dist.embedded`), started on first use.

The settings are read and checked by :class:`scrapy_dist.settings.DistSettings` (every function here
takes one, or Scrapy settings / a dict it is built from).

``REDIS_PARAMS`` adds or overrides client keyword arguments. ``REDIS_CLUSTER`` (``None`` = ask the
server's ``INFO cluster``; ``True``/``False`` force it) makes :func:`get_redis` / :func:`get_async_redis`
return ``redis.cluster.RedisCluster`` / ``redis.asyncio.cluster.RedisCluster``.

Outages: clients get a connect timeout, a read timeout, TCP keepalive, a health check on connections
idle for a while and a short retry (with backoff) on connection errors and timeouts, so one dropped
connection heals by itself and a client keeps working once Redis is back. Longer outages surface as
``redis.ConnectionError`` / ``redis.TimeoutError``; callers wait and retry.

Unreachable Redis at start (the mechanism, found by experiment with Scrapy 2.19 and ``scrapy crawl``):
``scrapy crawl`` exits non-zero only when the crawl fails to start (``CrawlerProcess.bootstrap_failed``).
An ordinary exception raised from a scheduler's ``from_crawler()`` or ``open()`` gets there, but Scrapy's
clean-up of the half-opened engine then logs its own tracebacks ("Engine slot not assigned", "Scraper
slot not assigned", a CoreStats assertion), and the failed crawl task is logged again by asyncio ("Task
exception was never retrieved") or Twisted ("Unhandled error in Deferred"). Raising ``CloseSpider``
closes cleanly but exits 0. What works: log the one ERROR line, then raise a ``SystemExit`` subclass
(:class:`CrawlAborted`). Scrapy's start-up code only catches ``Exception``, so nothing half-open is torn
down noisily; ``SystemExit`` propagates out of the event loop (asyncio re-raises it; Twisted lets it
through) and ``scrapy crawl`` exits with status 1. The current asyncio task is marked as handled first,
so asyncio does not print it on the way out. :func:`ensure_reachable` does all of this; call it from the
component's ``from_crawler()`` or ``open()`` (both verified, with ``AsyncCrawlerProcess``, the default,
and with ``FORCE_CRAWLER_PROCESS``). With ``TWISTED_REACTOR_ENABLED = False`` aiohttp may add "Unclosed
client session" lines because the downloader is never opened far enough to be closed.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, cast
from urllib.parse import quote, unquote, urlsplit

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

from scrapy_dist import outage
from scrapy_dist.embedded import EmbeddedRedis
from scrapy_dist.exceptions import RedisUnavailable
from scrapy_dist.settings import ConnectionSettings, DistSettings, SettingsError, mask_url

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path

    from scrapy.settings import BaseSettings

    SettingsLike = BaseSettings | Mapping[str, Any]

__all__ = [
    "OUTAGE_ERRORS",
    "CrawlAborted",
    "RedisTarget",
    "abort_crawl",
    "check_reachable",
    "check_reachable_async",
    "ensure_reachable",
    "from_settings",
    "get_async_redis",
    "get_redis",
    "get_redis_from_settings",
    "is_cluster",
    "mask_url",
    "resolve_target",
    "resolve_url",
]

logger = logging.getLogger(__name__)

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


# What "Redis did not answer" looks like; RedisClusterException is not a RedisError.
_CONNECT_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)

#: What a client raises while Redis is down, restarting or failing over: the one definition lives in
#: :mod:`scrapy_dist.outage` (re-exported here for callers that imported it from this module).
OUTAGE_ERRORS = outage.OUTAGE_ERRORS

# A server that answers but will not let us in: wrong user or password, or an ACL without PING.
_LOGIN_ERRORS = (
    redis.exceptions.AuthenticationError,
    redis.exceptions.AuthenticationWrongNumberOfArgsError,
    redis.exceptions.NoPermissionError,
)
_NO_MASTER = (redis.sentinel.MasterNotFoundError, redis.asyncio.sentinel.MasterNotFoundError)
_ERROR_NAME = re.compile(r"\b(\w+(?:Error|Exception))\b")
_TLS_PROBLEM = re.compile(r"\bSSL\b|\bTLS\b|certificate", re.IGNORECASE)

_announced: set[Path] = set()
_announced_urls: set[str] = set()
_cluster_detected: dict[str, bool] = {}


class CrawlAborted(SystemExit):  # noqa: N818 - it is an exit, not an error to catch
    """Stops ``scrapy crawl`` with exit status 1 after its cause was logged as one line.

    A ``SystemExit`` on purpose: Scrapy's start-up only catches ``Exception``, see the module docstring.
    ``error`` is the :class:`RedisUnavailable` (or other ``ScrapyDistError``) that caused it.
    """

    def __init__(self, error: Exception) -> None:
        super().__init__(1)
        self.error = error


# -- URLs ----------------------------------------------------------------------------------------
def _dist(settings: SettingsLike | DistSettings) -> DistSettings:
    """The typed settings (a bad value raises :class:`~scrapy_dist.settings.SettingsError`, one line)."""
    return DistSettings.coerce(settings)


@dataclass(frozen=True)
class RedisTarget:
    """The Redis a set of settings points at, and the client options to use for it.

    ``url`` is what ``from_url`` gets (for Sentinel: the master's credentials and db); ``setting`` names
    the setting that chose it, for error messages.
    """

    url: str
    setting: str
    params: dict[str, Any] = field(default_factory=dict)
    cluster: bool | None = None
    sentinels: tuple[tuple[str, int], ...] = ()
    sentinel_master: str = "mymaster"
    embedded_dir: Path | None = None

    @property
    def display_url(self) -> str:
        """The URL as users should see it (for Sentinel: ``redis+sentinel://h1:p1,h2:p2/<master>/<db>``)."""
        if not self.sentinels:
            return self.url
        parts = urlsplit(self.url)
        userinfo = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
        hosts = ",".join(f"{h}:{p}" for h, p in self.sentinels)
        db = parts.path.lstrip("/") or "0"
        return f"redis+sentinel://{userinfo}{hosts}/{quote(self.sentinel_master)}/{db}"

    @property
    def masked_url(self) -> str:
        return mask_url(self.display_url)

    @property
    def is_unix(self) -> bool:
        return self.url.startswith("unix:")

    def unreachable(self, exc: BaseException | str) -> RedisUnavailable:
        """The one-line error for this target not answering (``exc`` is the underlying error)."""
        reason = " ".join(str(exc).split()) or type(exc).__name__
        if isinstance(exc, _LOGIN_ERRORS):
            if "must be called with the client already authenticated" in reason or "NOAUTH" in reason:
                reason = "authentication required, and the URL has no user or password"
            where = {
                "REDIS_HOST/REDIS_PORT": "REDIS_PARAMS (username, password)",
                "REDIS_SENTINELS": "REDIS_URL (the master's user and password)",
            }.get(self.setting, "REDIS_URL")
            return RedisUnavailable(
                f"Redis at {self.masked_url} refused the login ({reason}); check the user name and password"
                f" in {where} and the user's ACL"
            )
        if _TLS_PROBLEM.search(reason):
            return RedisUnavailable(
                f"Cannot reach Redis at {self.masked_url} over TLS ({reason}); check the certificate settings"
                " in REDIS_PARAMS (ssl_ca_certs, ssl_certfile, ssl_keyfile) and that the URL is rediss://"
                " only for a TLS port"
            )
        if self.setting == "embedded":
            hint = (
                f"the embedded Redis in {self.embedded_dir} is not answering (see its redis.log); "
                "set REDIS_URL to use another Redis"
            )
        elif self.setting == "REDIS_SENTINELS":
            hint = "check that the Sentinels are running or change REDIS_SENTINELS / REDIS_SENTINEL_MASTER"
            if isinstance(exc, _NO_MASTER):
                # redis-py's message holds the repr of every Sentinel client; keep the error kinds
                kinds = sorted(set(_ERROR_NAME.findall(str(exc).partition(" : ")[2])))
                reason = f"no Sentinel names a master {self.sentinel_master!r}"
                reason += f" ({', '.join(kinds)})" if kinds else ""
                if "AuthenticationError" in kinds:
                    hint = "check the Sentinels' password in REDIS_PARAMS['sentinel_kwargs']"
        elif self.setting == "REDIS_HOST/REDIS_PORT":
            hint = "check that Redis is running or change REDIS_HOST/REDIS_PORT (or set REDIS_URL)"
        else:
            hint = "check that Redis is running or change REDIS_URL"
        return RedisUnavailable(f"Cannot reach Redis at {self.masked_url} ({reason}); {hint}")


def resolve_target(settings: SettingsLike | DistSettings) -> RedisTarget:
    """Which Redis the settings point at (see the module docstring for the order); the one function
    workers and the ``scrapy-dist`` command use.

    The first time a process uses a Redis it logs one INFO line naming it (password masked) and the
    setting that chose it. With no Redis setting this joins -- or starts -- the embedded server; it
    raises :class:`RedisUnavailable` if that server cannot start.
    """
    conn = _dist(settings).connection
    params = dict(conn.params)
    if conn.sentinels:
        target = RedisTarget(
            url=conn.url or "redis:///0",
            setting="REDIS_SENTINELS",
            params=params,
            cluster=False,
            sentinels=conn.sentinels,
            sentinel_master=conn.sentinel_master,
        )
    elif conn.url:
        target = RedisTarget(url=conn.url, setting=conn.source, params=params, cluster=conn.cluster)
    elif conn.host or conn.port:
        target = RedisTarget(
            url=f"redis://{conn.host or 'localhost'}:{conn.port or 6379}/0",
            setting="REDIS_HOST/REDIS_PORT",
            params=params,
            cluster=conn.cluster,
        )
    else:
        return _embedded_target(conn, params)
    if target.masked_url not in _announced_urls:
        _announced_urls.add(target.masked_url)
        logger.info("Using Redis at %s (from %s)", target.masked_url, target.setting)
    return target


def _embedded_target(conn: ConnectionSettings, params: dict[str, Any]) -> RedisTarget:
    server = EmbeddedRedis.for_settings(
        {"REDIS_EMBEDDED_DIR": conn.embedded_dir, "REDIS_EMBEDDED_MAXMEMORY": conn.embedded_maxmemory}
    )
    directory = server.directory
    url, started = server.ensure_running()
    target = RedisTarget(url=url, setting="embedded", params=params, cluster=False, embedded_dir=directory)
    if directory not in _announced:
        _announced.add(directory)
        # WARNING: a user who meant to share one Redis between machines must not miss it.
        logger.warning(
            "No REDIS_URL set: this crawl is confined to this machine, using the embedded Redis at %s (%s; "
            "data in %s is kept between runs). Feed it seeds with: redis-cli -s %s lpush <spider>:start_urls "
            "URL (or scrapy-dist redis-cli ...). Set REDIS_URL to share one Redis between machines.",
            target.masked_url,
            "started it" if started else "already running",
            directory,
            server.socket_path,
        )
    return target


def resolve_url(settings: SettingsLike | DistSettings) -> str:
    """The Redis URL the settings point at (starting the embedded server if none is configured).

    For Sentinel it is the descriptive ``redis+sentinel://...`` form, not one ``from_url`` accepts.
    """
    return resolve_target(settings).display_url


# -- clients ------------------------------------------------------------------------------------
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


def _sync_retry() -> Retry:
    return Retry(ExponentialWithJitterBackoff(cap=1.0, base=0.05), _RETRIES)


def _async_retry() -> redis.asyncio.retry.Retry:
    return redis.asyncio.retry.Retry(ExponentialWithJitterBackoff(cap=1.0, base=0.05), _RETRIES)


def _detect_cluster(target: RedisTarget) -> bool:
    """Ask the server (``INFO cluster``) whether it runs in cluster mode; cached per URL.

    An unreachable server counts as "not a cluster" (and is not cached): the reachability check
    reports it properly.
    """
    if target.cluster is not None:
        return target.cluster
    if target.is_unix:
        return False
    cached = _cluster_detected.get(target.url)
    if cached is not None:
        return cached
    params = _client_params(target)
    params["retry"] = Retry(ExponentialWithJitterBackoff(cap=1.0, base=0.05), 0)
    probe = redis.Redis.from_url(target.url, **params)
    try:
        enabled = bool(probe.info("cluster").get("cluster_enabled"))
    except (redis.RedisError, OSError):
        return False
    finally:
        probe.close()
    _cluster_detected[target.url] = enabled
    return enabled


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


def _build_sync(target: RedisTarget) -> redis.Redis:
    if target.sentinels:
        sentinel = redis.sentinel.Sentinel(
            list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target, Retry(NoBackoff(), 0))
        )
        kwargs = _master_kwargs(target)
        kwargs.setdefault("retry", _sync_retry())
        return sentinel.master_for(target.sentinel_master, **kwargs)
    params = _client_params(target)
    params.setdefault("retry", _sync_retry())
    if _detect_cluster(target):
        try:
            cluster = redis.cluster.RedisCluster.from_url(target.url, **params)
        except _CONNECT_ERRORS as exc:
            # The sync cluster client connects when it is built.
            raise target.unreachable(exc) from exc
        # RedisCluster offers the same command API; typed as Redis so callers need no union checks.
        return cast("redis.Redis", cluster)
    return redis.Redis.from_url(target.url, **params)


def _build_async(target: RedisTarget) -> redis.asyncio.Redis:
    if target.sentinels:
        sentinel = redis.asyncio.sentinel.Sentinel(
            list(target.sentinels),
            sentinel_kwargs=_sentinel_kwargs(target, redis.asyncio.retry.Retry(NoBackoff(), 0)),
        )
        kwargs = _master_kwargs(target)
        kwargs.setdefault("retry", _async_retry())
        return sentinel.master_for(target.sentinel_master, **kwargs)
    params = _client_params(target)
    params.setdefault("retry", _async_retry())
    if _detect_cluster(target):
        return cast("redis.asyncio.Redis", redis.asyncio.cluster.RedisCluster.from_url(target.url, **params))
    return redis.asyncio.Redis.from_url(target.url, **params)


def get_redis(settings: SettingsLike | DistSettings | None = None, /, **kwargs: Any) -> redis.Redis:
    """A synchronous client for the Redis the settings point at.

    A ``redis.cluster.RedisCluster`` when the target is a cluster (typed as ``redis.Redis``; use
    :func:`is_cluster` to tell). Does not check that Redis answers (see :func:`ensure_reachable`), except
    that a cluster client connects when built and raises :class:`RedisUnavailable` if it cannot.

    scrapy-redis's keyword call works too: ``get_redis(url=...)``, ``get_redis(host=..., port=..., db=...)``,
    other keywords are client options (``REDIS_PARAMS``). With ``redis_cls`` (a class or its path) the
    client is built exactly as scrapy-redis builds it: ``redis_cls.from_url(url, **kw)`` or
    ``redis_cls(**kw)``, without scrapy-dist's timeouts and retries.
    ``get_redis()`` with nothing at all is the Redis a crawl without Redis settings uses (the
    ``REDIS_URL`` environment variable, else the embedded Redis) -- not scrapy-redis's ``localhost:6379``,
    so that a script and a crawl agree.
    """
    if settings is not None and kwargs:
        raise TypeError("get_redis() takes settings or scrapy-redis keywords (url=, host=, ...), not both")
    if settings is None:
        return _redis_from_keywords(dict(kwargs))
    return _build_sync(resolve_target(settings))


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
    return _build_sync(resolve_target(settings))


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
    return _build_async(resolve_target(settings))


def is_cluster(client: Any) -> bool:
    """Whether ``client`` (sync or async) is a Redis Cluster client."""
    return isinstance(client, (redis.cluster.RedisCluster, redis.asyncio.cluster.RedisCluster))


# -- reachability -------------------------------------------------------------------------------
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
    unless Redis answers ``PING``.

    Pass a sync client (and, for a precise message, the settings it came from), or just the settings.
    Costs one round trip.
    """
    if _is_settings(client_or_settings):
        target = resolve_target(client_or_settings)
        client = _build_sync(target)
        owned = True
    else:
        client = client_or_settings
        target = resolve_target(settings) if settings is not None else _describe(client)
        owned = False
    try:
        answer = client.ping()
    except _CONNECT_ERRORS as exc:
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
    except _CONNECT_ERRORS as exc:
        raise target.unreachable(exc) from exc


def _mark_task_handled() -> None:
    """Keep asyncio from printing the crawl task that CrawlAborted ends ("exception never retrieved")."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running loop
        return
    if task is not None:
        task.add_done_callback(lambda t: t.cancelled() or t.exception())


def abort_crawl(error: Exception) -> NoReturn:
    """Log ``error`` as one ERROR line and stop the crawl so that ``scrapy crawl`` exits with status 1.

    For a component's ``from_crawler()`` or ``open()`` only: it raises :class:`CrawlAborted`, a
    ``SystemExit`` (see the module docstring for why).
    """
    logger.error("%s", error)
    _mark_task_handled()
    raise CrawlAborted(error) from error


def ensure_reachable(client_or_settings: Any, settings: SettingsLike | DistSettings | None = None) -> None:
    """Start-up check for components: if Redis does not answer (or the embedded server cannot start),
    log one ERROR line naming the masked URL and the setting, and stop the crawl with a non-zero exit.

    Call it from ``from_crawler()`` or ``open()``, e.g. ``ensure_reachable(client, crawler.settings)``
    or ``ensure_reachable(crawler.settings)``. One round trip.
    """
    try:
        check_reachable(client_or_settings, settings)
    except (RedisUnavailable, SettingsError) as exc:
        abort_crawl(exc)
