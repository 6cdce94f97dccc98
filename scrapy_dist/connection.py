"""Redis clients built from Scrapy settings (placeholder: the foundation work completes this module).

Public API (kept stable for every component):

* ``resolve_url(settings) -> str``
* ``get_redis(settings) -> redis.Redis``
* ``get_async_redis(settings) -> redis.asyncio.Redis``
* ``mask_url(url) -> str``
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio

from scrapy_dist import defaults


def mask_url(url: str) -> str:
    """``url`` with its password replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def resolve_url(settings: Any) -> str:
    url = settings.get("REDIS_URL", defaults.REDIS_URL)
    if url:
        return str(url)
    host = settings.get("REDIS_HOST", defaults.REDIS_HOST)
    port = settings.get("REDIS_PORT", defaults.REDIS_PORT)
    if host or port:
        return f"redis://{host or 'localhost'}:{int(port or 6379)}/0"
    raise NotImplementedError("embedded Redis not implemented yet")


def _params(settings: Any) -> dict[str, Any]:
    return dict(settings.get("REDIS_PARAMS", defaults.REDIS_PARAMS) or {})


def get_redis(settings: Any) -> redis.Redis:
    return redis.Redis.from_url(resolve_url(settings), **_params(settings))


def get_async_redis(settings: Any) -> redis.asyncio.Redis:
    return redis.asyncio.Redis.from_url(resolve_url(settings), **_params(settings))
