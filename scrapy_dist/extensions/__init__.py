"""Seeing and steering a running cluster: Scrapy extensions for crawl-wide stats and worker heartbeats
(:class:`ClusterStats`), closing every worker together when the crawl runs out of work
(:class:`IdleMonitor`) and crawl-wide error thresholds (:class:`ErrorMonitor`).

Enable them all with ``ADDONS = {"scrapy_dist.Addon": 0}``, or one by one::

    EXTENSIONS = {
        "scrapy_dist.extensions.ClusterStats": 500,
        "scrapy_dist.extensions.IdleMonitor": 500,
        "scrapy_dist.extensions.ErrorMonitor": 500,
    }
"""

from __future__ import annotations

from scrapy_dist.extensions.clusterstats import ClusterStats
from scrapy_dist.extensions.errors import ErrorMonitor
from scrapy_dist.extensions.idle import IdleMonitor

__all__ = ["ClusterStats", "ErrorMonitor", "IdleMonitor"]
