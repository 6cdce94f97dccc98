"""Spiders fed from Redis: ``redis-cli lpush <spider>:start_urls <url-or-json>`` and the running crawl
requests the seed at once (docs/seeds.md). :class:`RedisSpider` and :class:`RedisCrawlSpider` read seeds in
``async def start()`` through :class:`scrapy_dist.seeds.feed.SeedFeed`, which owns the seed protocol.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from scrapy import Request, Spider, signals
from scrapy.spiders import CrawlSpider

from scrapy_dist.seeds import SeedRules, parse_seed, seed_request, spider_has_callback
from scrapy_dist.seeds.feed import SeedFeed, SeedReader, TakeResult
from scrapy_dist.settings import SettingsError
from scrapy_dist.settings.reader import refuse_misspelt_components, refuse_start, start_error
from scrapy_dist.spiders.args import apply_spider_arguments
from scrapy_dist.wire.entrypolicy import keep_allowed_domains

if TYPE_CHECKING:
    from scrapy.crawler import Crawler
    from typing_extensions import Self

# SeedFeed, SeedReader and TakeResult live in scrapy_dist.seeds.feed; re-exported for imports from here
__all__ = ["RedisCrawlSpider", "RedisMixin", "RedisSpider", "SeedFeed", "SeedReader", "TakeResult"]


class RedisMixin:
    """Reads the spider's seeds from Redis in ``async def start()`` (see the module docstring).

    Attributes: ``redis_key`` (the seeds key, ``%(name)s`` replaced by the spider name; default
    ``REDIS_START_URLS_KEY``), ``redis_batch_size`` (seeds per round trip; default
    ``REDIS_START_URLS_BATCH_SIZE``, else ``CONCURRENT_REQUESTS``), ``max_idle_time`` (seconds without
    work before the worker closes; sets ``SCHEDULER_IDLE_BEFORE_CLOSE``). All three may be given as
    ``-a name=value`` (see :mod:`scrapy_dist.spiders.args`). Override
    :meth:`make_request_from_data` to read another seed format.
    """

    redis_key: str | None = None
    redis_batch_size: int | None = None
    #: seconds without work before the worker closes (scrapy-redis's; sets SCHEDULER_IDLE_BEFORE_CLOSE)
    max_idle_time: float | None = None
    #: scrapy-redis's, for make_request_from_data overrides that decode with it: seeds are UTF-8 (another
    #: value is warned about and not applied)
    redis_encoding: str = "utf-8"

    name: str
    crawler: Crawler
    _seed_feed: SeedFeed | None = None

    @classmethod
    def from_crawler(cls, crawler: Crawler, *args: Any, **kwargs: Any) -> Self:
        refuse_misspelt_components(crawler)  # before Scrapy loads SCHEDULER, which would fail noisily
        spider = super().from_crawler(crawler, *args, **kwargs)  # type: ignore[misc]
        keep_allowed_domains(spider)  # an iterator (scrapy-redis's example) must outlive Scrapy's reads
        try:
            apply_spider_arguments(spider, crawler)  # -a values are strings: converted as scrapy-redis does
        except SettingsError as exc:
            refuse_start(crawler, exc)
        crawler.signals.connect(spider._close_seed_feed, signal=signals.spider_closed)
        return spider

    async def start(self) -> AsyncIterator[Any]:
        """Yield requests for the seeds pushed to the seeds key, as they arrive (see :class:`SeedFeed`).

        Ends only when ``SCHEDULER_IDLE_BEFORE_CLOSE`` (or scrapy-redis's ``MAX_IDLE_TIME_BEFORE_CLOSE``)
        is above 0 and neither a seed arrived nor the frontier held anything for that long.
        """
        if start_error(self.crawler) is not None:  # the crawl stops as it opens: no seed is taken
            return
        feed = self._seed_feed = SeedFeed.from_spider(self)
        async for request in feed.requests():
            yield request

    def make_request_from_data(self, data: bytes) -> Request | None:
        """The request for one raw seed (or ``None`` to skip it). Raise
        :class:`~scrapy_dist.exceptions.RejectedEntry` (``reason``, ``detail``) to reject it; any other
        exception rejects it as ``hook_error``. The default accepts a plain URL or a JSON object (see
        :mod:`scrapy_dist.seeds`)."""
        feed = self._seed_feed
        rules = feed.rules if feed is not None else SeedRules()
        seed = parse_seed(data, rules, has_callback=spider_has_callback(self))  # type: ignore[arg-type]
        return seed_request(seed, self, dedupe=rules.dedupe)  # type: ignore[arg-type]

    async def _close_seed_feed(self, spider: Spider, reason: str) -> None:
        if spider is self and self._seed_feed is not None:
            await self._seed_feed.close()


class RedisSpider(RedisMixin, Spider):
    """A :class:`scrapy.Spider` whose start requests come from Redis (``<name>:start_urls``)."""


class RedisCrawlSpider(RedisMixin, CrawlSpider):
    """A :class:`scrapy.spiders.CrawlSpider` (rules followed from every seed without a callback) whose
    start requests come from Redis."""

    def _build_request(self, rule_index: int, link: Any) -> Request:
        # CrawlSpider aims rule requests at its private _callback/_errback, and the frontier's wire format
        # refuses private method names (a name read from Redis must not reach private methods): the
        # requests name these public stand-ins instead
        request = super()._build_request(rule_index, link)
        return request.replace(callback=self.rule_callback, errback=self.rule_errback)

    def rule_callback(self, response: Any, **cb_kwargs: Any) -> Any:
        """The callback of requests made by ``rules`` (CrawlSpider's own, under a public name)."""
        return self._callback(response, **cb_kwargs)

    def rule_errback(self, failure: Any) -> Any:
        """The errback of requests made by ``rules`` (CrawlSpider's own, under a public name)."""
        return self._errback(failure)
