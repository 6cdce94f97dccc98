"""scrapy-redis's ``connection`` names (``get_redis``, ``get_redis_from_settings``, ``from_settings``) for
scripts and pipelines that build their own client: the public face of :mod:`scrapy_dist.redis.connection`."""

from __future__ import annotations

from scrapy_dist.redis.connection import (
    from_settings,
    get_async_redis,
    get_redis,
    get_redis_from_settings,
    resolve_target,
)

__all__ = ["from_settings", "get_async_redis", "get_redis", "get_redis_from_settings", "resolve_target"]
