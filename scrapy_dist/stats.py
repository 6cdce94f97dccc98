"""``STATS_CLASS = "scrapy_dist.stats.RedisStatsCollector"``: the public name of
:class:`scrapy_dist.extensions.RedisStatsCollector`."""

from __future__ import annotations

from scrapy_dist.extensions import RedisStatsCollector

__all__ = ["RedisStatsCollector"]
