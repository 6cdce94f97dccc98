"""scrapy-dist: run any Scrapy project on many hosts sharing one frontier in Redis.

Enable it with ``ADDONS = {"scrapy_dist.Addon": 0}`` (or set ``SCHEDULER`` and ``DUPEFILTER_CLASS``).
Importing this package stays cheap: the Scrapy components are imported on first attribute access."""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from scrapy_dist.exceptions import RedisUnavailable, ScrapyDistError
from scrapy_dist.redis.keys import CrawlKeys

if TYPE_CHECKING:
    from scrapy_dist.addon import Addon
    from scrapy_dist.dupefilter import BloomDupeFilter
    from scrapy_dist.frontier.scheduler import Scheduler

try:
    __version__ = version("scrapy-dist")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = ["Addon", "BloomDupeFilter", "CrawlKeys", "RedisUnavailable", "Scheduler", "ScrapyDistError",
           "__version__"]

_LAZY = {"Addon": "scrapy_dist.addon", "BloomDupeFilter": "scrapy_dist.dupefilter",
         "Scheduler": "scrapy_dist.frontier.scheduler"}


def __getattr__(name: str) -> Any:
    if (module := _LAZY.get(name)) is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(import_module(module), name)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
