"""Item output: ``ITEM_PIPELINES = {"scrapy_dist.pipelines.RedisPipeline": 300}`` and its batched writer.

May import: ``settings``, ``redis``, ``wire``, ``frontier``, ``utils`` and the root's exceptions.
"""

from __future__ import annotations

from scrapy_dist.pipelines.pipeline import RedisPipeline

__all__ = ["RedisPipeline"]
