"""Redis clients built from Scrapy settings -- the one place every component gets its connection -- and
the start-up check that Redis answers.

Which Redis the settings point at is :mod:`scrapy_dist.redis.target` (:func:`resolve_target`, the order of
the settings is in its docstring); the clients and their outage options are :mod:`scrapy_dist.redis.clients`.
Both are re-exported here, the import path components and users have.

Unreachable Redis at start: :func:`check_reachable` raises :class:`RedisUnavailable` (one line naming the
masked URL and the setting to change); a component handed the crawler calls :func:`ensure_reachable`,
which refuses the crawl's start with it (:mod:`scrapy_dist.settings.reader`: one ERROR line, a clean
stop, exit status 1 for ``scrapy crawl``, no traceback and no process exit in a script).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.redis import outage
from scrapy_dist.redis.clients import (
    CONNECT_ERRORS,
    DEFAULT_CLIENT_PARAMS,
    build_sync,
    from_settings,
    get_async_redis,
    get_redis,
    get_redis_from_settings,
    is_cluster,
)
from scrapy_dist.redis.target import RedisTarget, resolve_target, resolve_url
from scrapy_dist.settings import DistSettings, mask_url
from scrapy_dist.settings.reader import refuse_start

if TYPE_CHECKING:
    from collections.abc import Mapping

    from scrapy.crawler import Crawler
    from scrapy.settings import BaseSettings

    SettingsLike = BaseSettings | Mapping[str, Any]

__all__ = [
    "DEFAULT_CLIENT_PARAMS",
    "OUTAGE_ERRORS",
    "RedisTarget",
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
