"""Seeing and steering a running cluster: Scrapy extensions for crawl-wide stats and worker heartbeats
(:class:`ClusterStats`), closing every worker together when the crawl runs out of work
(:class:`IdleMonitor`) and crawl-wide error thresholds (:class:`ErrorMonitor`); and
``STATS_CLASS = "scrapy_dist.stats.RedisStatsCollector"`` (:class:`RedisStatsCollector`), which keeps
Scrapy's in-memory collector and turns on :class:`ClusterStats` instead of writing every increment through
to Redis as scrapy-redis does; ``STATS_KEY`` is not read.

Enable them all with ``ADDONS = {"scrapy_dist.Addon": 0}``, or one by one::

    EXTENSIONS = {
        "scrapy_dist.extensions.ClusterStats": 500,
        "scrapy_dist.extensions.IdleMonitor": 500,
        "scrapy_dist.extensions.ErrorMonitor": 500,
    }
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from scrapy.statscollectors import MemoryStatsCollector
from scrapy.utils.misc import load_object

from scrapy_dist.extensions.clusterstats import ClusterStats
from scrapy_dist.extensions.errors import ErrorMonitor
from scrapy_dist.extensions.idle import IdleMonitor
from scrapy_dist.redis import connection
from scrapy_dist.redis.keys import crawler_keys
from scrapy_dist.redis.scripts import text

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

__all__ = ["ClusterStats", "ErrorMonitor", "IdleMonitor", "RedisStatsCollector"]


logger = logging.getLogger(__name__)

#: The extension that writes the crawl-wide stats (enabled by this collector if the project has not).
CLUSTER_STATS = "scrapy_dist.extensions.ClusterStats"
#: Its order among extensions when this collector enables it (the add-on's value).
CLUSTER_STATS_ORDER = 500


class RedisStatsCollector(MemoryStatsCollector):
    """Scrapy's in-memory stats for this worker, plus crawl-wide stats in Redis (see the module
    docstring). Enables :class:`~scrapy_dist.extensions.ClusterStats` unless the project disabled it
    (``EXTENSIONS = {"scrapy_dist.extensions.ClusterStats": None}``, which is then logged)."""

    def __init__(self, crawler: Crawler) -> None:
        super().__init__(crawler)
        self.crawler = crawler
        enable_cluster_stats(crawler)

    def crawl_stats(self) -> dict[str, str]:
        """The crawl-wide merged stats (every worker's, as last flushed): one ``HGETALL``."""
        raw = connection.ClientPool.of(self.crawler).sync_client().hgetall(crawler_keys(self.crawler).stats)
        return {text(k): text(v) for k, v in raw.items()}


def enable_cluster_stats(crawler: Crawler) -> bool:
    """Add ClusterStats to the crawler's ``EXTENSIONS`` unless it is there (enabled: nothing to do;
    disabled with ``None``: respected, with a WARNING). True if it will run. Settings must not be frozen
    yet (a stats collector is built before they are)."""
    settings = crawler.settings
    for path, order in settings.getwithbase("EXTENSIONS").items():
        try:
            cls = load_object(path) if isinstance(path, str) else path
        except (ImportError, NameError, ValueError):
            continue
        if cls is ClusterStats:
            if order is None:
                logger.warning(
                    "scrapy-dist: STATS_CLASS=RedisStatsCollector keeps no crawl-wide stats because"
                    " EXTENSIONS disables %s; enable it to get them in Redis", CLUSTER_STATS,
                )
                return False
            return True
    if getattr(settings, "frozen", False):
        return False
    settings["EXTENSIONS"].set(CLUSTER_STATS, CLUSTER_STATS_ORDER, priority="addon")
    return True
