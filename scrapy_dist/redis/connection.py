"""Redis clients built from Scrapy settings -- the one place every component gets its connection -- and
the start-up check that Redis answers.

Which Redis is :mod:`scrapy_dist.redis.target`, the clients and their outage options
:mod:`scrapy_dist.redis.clients`; both are re-exported here, the import path components and users have.
An unreachable Redis at start is one ERROR line and :class:`CrawlAborted`, a ``SystemExit`` so that
``scrapy crawl`` exits 1 without Scrapy's clean-up tracebacks (why: docs/connection.md, "For component
authors"); the current asyncio task is marked as handled first, so asyncio does not print it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, NoReturn

from scrapy_dist.exceptions import RedisUnavailable
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
from scrapy_dist.settings import DistSettings, SettingsError, mask_url
from scrapy_dist.settings.reader import check_components

if TYPE_CHECKING:
    from collections.abc import Mapping

    from scrapy.settings import BaseSettings

    SettingsLike = BaseSettings | Mapping[str, Any]

__all__ = [
    "DEFAULT_CLIENT_PARAMS",
    "OUTAGE_ERRORS",
    "CrawlAborted",
    "RedisTarget",
    "abort_crawl",
    "check_reachable",
    "check_reachable_async",
    "ensure_components",
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


class CrawlAborted(SystemExit):  # noqa: N818 - it is an exit, not an error to catch
    """Stops ``scrapy crawl`` with exit status 1 after its cause (``error``) was logged as one line; a
    ``SystemExit`` because Scrapy's start-up only catches ``Exception`` (see the module docstring)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(1)
        self.error = error



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


def _mark_task_handled() -> None:
    """Keep asyncio from printing the crawl task that CrawlAborted ends ("exception never retrieved")."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running loop
        return
    if task is not None:
        task.add_done_callback(lambda t: t.cancelled() or t.exception())


def abort_crawl(error: Exception) -> NoReturn:
    """Log ``error`` as one ERROR line and raise :class:`CrawlAborted`, so that ``scrapy crawl`` exits with
    status 1. For a component's ``from_crawler()`` or ``open()`` only."""
    logger.error("%s", error)
    _mark_task_handled()
    raise CrawlAborted(error) from error


def ensure_reachable(client_or_settings: Any, settings: SettingsLike | DistSettings | None = None) -> None:
    """Start-up check for ``from_crawler()`` or ``open()`` (one round trip): if Redis does not answer (or
    the embedded server cannot start), :func:`abort_crawl` with the one line naming the masked URL and the
    setting, e.g. ``ensure_reachable(client, crawler.settings)`` or ``ensure_reachable(crawler.settings)``.
    """
    try:
        check_reachable(client_or_settings, settings)
    except (RedisUnavailable, SettingsError) as exc:
        abort_crawl(exc)


def ensure_components(settings: SettingsLike) -> None:
    """Start-up check for the components that run before Scrapy loads ``SCHEDULER`` and ``STATS_CLASS``
    (a spider's ``from_crawler``, the add-on): a misspelt scrapy-dist class path there is one ERROR line
    naming the setting and the closest name, and a non-zero exit, instead of Scrapy's traceback."""
    try:
        check_components(settings)
    except SettingsError as exc:
        abort_crawl(exc)
