"""``SCHEDULER_QUEUE_CLASS = "scrapy_dist.queue.PriorityQueue"`` (or ``FifoQueue``, ``LifoQueue`` and
scrapy-redis's ``SpiderQueue``, ``SpiderStack``, ``SpiderPriorityQueue``): the public names of
:mod:`scrapy_dist.frontier.orders`."""

from __future__ import annotations

from scrapy_dist.frontier.orders import (
    FifoQueue,
    LifoQueue,
    PriorityQueue,
    SpiderPriorityQueue,
    SpiderQueue,
    SpiderStack,
)

__all__ = ["FifoQueue", "LifoQueue", "PriorityQueue", "SpiderPriorityQueue", "SpiderQueue", "SpiderStack"]
