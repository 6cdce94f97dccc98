"""``RedisSpider`` and ``RedisCrawlSpider``: spiders that read their seeds from Redis, and the checks of
the arguments scrapy-redis spiders take.

May import: ``settings``, ``redis``, ``wire``, ``seeds``, ``frontier``, ``utils`` and the root's exceptions.
"""

from __future__ import annotations

from scrapy_dist.spiders.mixin import RedisCrawlSpider, RedisMixin, RedisSpider

__all__ = ["RedisCrawlSpider", "RedisMixin", "RedisSpider"]
