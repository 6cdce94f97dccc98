"""The redis-py options a user writes (``REDIS_PARAMS``, a ``REDIS_URL``'s query), checked when the settings
are read rather than with a traceback when a client is built. Lenient on purpose: a keyword is known if
any client scrapy-dist may build (sync or asyncio, plain or cluster, TCP, TLS or unix socket) takes it.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from scrapy_dist.settings.values import SettingsError

__all__ = ["check_client_options"]

#: options that are numbers of seconds (or None)
_SECONDS = ("socket_timeout", "socket_connect_timeout", "health_check_interval")
#: options that are whole numbers (or None), with their least value; REDIS_PARAMS' host, port and db are
#: read (and checked) as scrapy-redis reads them: settings.reader.redis_location
_INTEGERS = {"max_connections": 1}
#: read by scrapy-dist itself, not by a client
_OURS = frozenset({"sentinel_kwargs"})


@lru_cache(maxsize=1)
def known_options() -> frozenset[str]:
    """Every keyword one of the clients scrapy-dist builds accepts."""
    import redis
    import redis.asyncio
    import redis.asyncio.cluster
    import redis.cluster
    import redis.connection

    names: set[str] = set(_OURS)
    conn = redis.connection
    for cls in (redis.Redis, redis.asyncio.Redis, redis.cluster.RedisCluster,
                redis.asyncio.cluster.RedisCluster, conn.AbstractConnection, conn.Connection,
                conn.SSLConnection, conn.UnixDomainSocketConnection, redis.ConnectionPool):
        names.update(p.name for p in inspect.signature(cls.__init__).parameters.values()
                     if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self")
    return frozenset(names)


def _refuse(name: str, value: Any, option: str, problem: str, expected: str) -> SettingsError:
    where = f"{name}[{option!r}]" if name == "REDIS_PARAMS" else name
    return SettingsError(where, value, problem, expected)


def _check(name: str, value: Any, options: Mapping[str, Any]) -> None:
    known = known_options()
    for option, given in options.items():
        if option not in known:
            close = difflib.get_close_matches(str(option), sorted(known), n=1, cutoff=0.7)
            shown = value if name != "REDIS_PARAMS" else f"{{{option!r}: ...}}"  # a value may be secret
            raise SettingsError(name, shown, f"{option!r} is not a redis-py client option",
                                f"did you mean {close[0]}?" if close
                                else "expected keywords of redis.Redis, e.g. socket_timeout")
        if given is None or option not in (*_SECONDS, *_INTEGERS):
            continue
        low = _INTEGERS.get(option, 0)
        whole = option in _INTEGERS
        ok = (not isinstance(given, bool) and isinstance(given, int if whole else (int, float))
              and given >= low)
        if not ok:
            shown = value if name != "REDIS_PARAMS" else given
            kind = "a whole number" if whole else "a number of seconds"
            raise _refuse(name, shown, str(option), f"{option} is {given!r}, not {kind} >= {low}",
                          f"expected e.g. {option}={max(low, 5)}")


def check_client_options(url: str | None, params: Mapping[str, Any]) -> None:
    """Raise :class:`SettingsError` (one line) if ``params`` (``REDIS_PARAMS``) or the query of ``url``
    (``REDIS_URL``) holds an option no client takes, or a timeout or pool size that is not a number."""
    query = url.rpartition("@")[2].partition("?")[2] if url else ""  # a password may hold '?' or '/'
    if query:
        from redis.connection import parse_url

        try:
            parsed = parse_url(f"redis://localhost?{query}")  # as redis-py reads the query of any URL
        except ValueError as exc:
            raise SettingsError("REDIS_URL", url, f"bad query option ({exc})",
                                "expected options like ?socket_timeout=5") from None
        _check("REDIS_URL", url, {k: v for k, v in parsed.items() if k != "host"})
    _check("REDIS_PARAMS", params, params)
