"""Which Redis a set of settings points at (:func:`resolve_target`): ``REDIS_URL``, ``REDIS_SENTINELS``,
``REDIS_HOST``/``REDIS_PORT``, the ``REDIS_URL`` environment variable, else the embedded Redis."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

import redis.asyncio.sentinel
import redis.sentinel

from scrapy_dist.exceptions import RedisUnavailable
from scrapy_dist.redis.embedded import EmbeddedRedis, embedded_dir, make_private_dir, private_secret
from scrapy_dist.settings import ConnectionSettings, DistSettings, mask_url

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path

    from scrapy.settings import BaseSettings
    SettingsLike = BaseSettings | Mapping[str, Any]

logger = logging.getLogger("scrapy_dist.redis.connection")

_LOGIN_ERRORS = (redis.exceptions.AuthenticationError, redis.exceptions.AuthenticationWrongNumberOfArgsError,
                 redis.exceptions.NoPermissionError)
_NO_MASTER = (redis.sentinel.MasterNotFoundError, redis.asyncio.sentinel.MasterNotFoundError)
_ERROR_NAME = re.compile(r"\b(\w+(?:Error|Exception))\b")
_TLS_PROBLEM = re.compile(r"\bSSL\b|\bTLS\b|certificate", re.IGNORECASE)

_announced: set[Path | str] = set()  # embedded directories and masked URLs logged once


@dataclass(frozen=True)
class RedisTarget:
    """The Redis a set of settings points at and its client options: ``url`` is what ``from_url`` gets (for
    Sentinel: the master's credentials and db), ``setting`` the setting that chose it."""

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
            where = {"REDIS_HOST/REDIS_PORT": "REDIS_PARAMS (username, password)", "REDIS_SENTINELS":
                     "REDIS_URL (the master's user and password)"}.get(self.setting, "REDIS_URL")
            return RedisUnavailable(f"Redis at {self.masked_url} refused the login ({reason}); check the user"
                                    f" name and password in {where} and the user's ACL")
        # rediss:// to a port without TLS: the handshake waits for an answer that never comes
        if _TLS_PROBLEM.search(reason) or (self.url.startswith("rediss:") and "Timeout" in reason):
            return RedisUnavailable(f"Cannot reach Redis at {self.masked_url} over TLS ({reason}); check the"
                                    " certificate settings in REDIS_PARAMS (ssl_ca_certs, ssl_certfile,"
                                    " ssl_keyfile) and that the URL is rediss:// only for a TLS port")
        hint = {
            "embedded": f"the embedded Redis in {self.embedded_dir} is not answering (see its redis.log); set"
                        " REDIS_URL to use another Redis",
            "REDIS_SENTINELS": "check that the Sentinels are running or change REDIS_SENTINELS /"
                               " REDIS_SENTINEL_MASTER",
            "REDIS_HOST/REDIS_PORT": "check that Redis is running or change REDIS_HOST/REDIS_PORT (or set"
                                     " REDIS_URL)",
        }.get(self.setting, "check that Redis is running or change REDIS_URL")
        if self.setting == "REDIS_SENTINELS" and isinstance(exc, _NO_MASTER):
            # redis-py's message holds the repr of every Sentinel client; keep the error kinds
            kinds = sorted(set(_ERROR_NAME.findall(str(exc).partition(" : ")[2])))
            reason = f"no Sentinel names a master {self.sentinel_master!r}"
            reason += f" ({', '.join(kinds)})" if kinds else ""
            if "AuthenticationError" in kinds:
                hint = "check the Sentinels' password in REDIS_PARAMS['sentinel_kwargs']"
        return RedisUnavailable(f"Cannot reach Redis at {self.masked_url} ({reason}); {hint}")


def resolve_target(settings: SettingsLike | DistSettings, *, notice: bool = True) -> RedisTarget:
    """Which Redis the settings point at (logged once at INFO); with no Redis setting, the embedded server,
    joined or started, with one WARNING (unless not ``notice``) that the crawl stays on this machine."""
    conn = DistSettings.coerce(settings).connection
    params = dict(conn.params)
    if not (conn.sentinels or conn.url or conn.host or conn.port):
        return _embedded_target(conn, params, notice)
    if conn.sentinels:
        target = RedisTarget(url=conn.url or "redis:///0", setting="REDIS_SENTINELS", params=params,
                             cluster=False, sentinels=conn.sentinels, sentinel_master=conn.sentinel_master)
    else:  # REDIS_HOST/REDIS_PORT: the db goes in the URL, as from_url() lets a URL's db win over the db
        # keyword, and scrapy-redis builds Redis(host=..., port=..., **REDIS_PARAMS) with REDIS_PARAMS["db"]
        url = conn.url or f"redis://{conn.host or 'localhost'}:{conn.port or 6379}/{params.get('db') or 0}"
        target = RedisTarget(url=url, setting=conn.source, params=params, cluster=conn.cluster)
    if target.masked_url not in _announced:
        _announced.add(target.masked_url)
        logger.info("Using Redis at %s (from %s)", target.masked_url, target.setting)
    return target


def _embedded_target(conn: ConnectionSettings, params: dict[str, Any], notice: bool) -> RedisTarget:
    server = EmbeddedRedis.for_settings({"REDIS_EMBEDDED_DIR": conn.embedded_dir,
                                         "REDIS_EMBEDDED_MAXMEMORY": conn.embedded_maxmemory})
    directory = server.directory
    url, started = server.ensure_running()
    if params.get("db"):  # from_url() lets the URL's ?db=0 win over the db keyword
        url = url.replace("?db=0", f"?db={params['db']}")
    target = RedisTarget(url=url, setting="embedded", params=params, cluster=False, embedded_dir=directory)
    if notice and directory not in _announced:
        _announced.add(directory)
        logger.warning(  # a WARNING: a user who meant to share one Redis between machines must not miss it
            "No REDIS_URL set: this crawl is confined to this machine, using the embedded Redis at %s (%s; "
            "data in %s is kept between runs). Feed it seeds with: redis-cli -s %s lpush <spider>:start_urls "
            "URL (or scrapy-dist redis-cli ...). Set REDIS_URL to share one Redis between machines.",
            target.masked_url, "started it" if started else "already running", directory, server.socket_path)
    return target


SECRET_FILE = "entry.secret"  #: The embedded Redis's entry secret, next to its other private files.


def embedded_secret(settings: SettingsLike | DistSettings) -> bytes | None:
    """The entry secret of the embedded Redis these settings use, or None for another Redis."""
    if (conn := DistSettings.coerce(settings).connection).source != "embedded":
        return None
    directory = embedded_dir({"REDIS_EMBEDDED_DIR": conn.embedded_dir})
    make_private_dir(directory)
    return private_secret(directory / SECRET_FILE)


def resolve_url(settings: SettingsLike | DistSettings) -> str:
    """The Redis URL the settings point at, as users read it (see :attr:`RedisTarget.display_url`)."""
    return resolve_target(settings).display_url
