"""``SCHEDULER = "scrapy_dist.scheduler.Scheduler"``: the public name of the frontier's scheduler."""

from __future__ import annotations

from scrapy_dist.frontier.scheduler import Scheduler

__all__ = ["Scheduler"]
