"""The crawl-wide duplicate filter in Redis: the bloom filter (with generations for ``DUPEFILTER_TTL``),
the exact set filter, and the Lua calls they share with the frontier.

``DUPEFILTER_CLASS = "scrapy_dist.dupefilter.BloomDupeFilter"`` names the class exported here.
May import: ``settings``, ``redis``, ``utils`` and the root's exceptions.
"""

from __future__ import annotations

from scrapy_dist.dupefilter.filters import BloomDupeFilter, RedisDupeFilter, RFPDupeFilter, SetDupeFilter

__all__ = ["BloomDupeFilter", "RFPDupeFilter", "RedisDupeFilter", "SetDupeFilter"]
