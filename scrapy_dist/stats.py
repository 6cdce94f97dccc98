"""``STATS_CLASS = "scrapy_dist.stats.RedisStatsCollector"``: the public name of
:mod:`scrapy_dist.extensions.stats`."""

from __future__ import annotations

from scrapy_dist.extensions.stats import RedisStatsCollector

__all__ = ["RedisStatsCollector"]
