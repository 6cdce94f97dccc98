"""The spider `scrapy-dist demo` runs: follows every link of the generated local site.

Seeds come from Redis (``demo:start_urls``; the demo pushes ``/page/0`` with ``LPUSH``, exactly as
``redis-cli lpush demo:start_urls http://127.0.0.1:<port>/page/0`` would), so several workers -- and
workers started later -- all take their requests from the one shared frontier.
"""

from __future__ import annotations

from scrapy_dist.spiders import RedisSpider


class DemoSpider(RedisSpider):
    """One item per page; every link followed (the crawl-wide bloom filter drops the ones seen before)."""

    name = "demo"
    custom_settings = {
        # The site is local: no politeness delay, and enough concurrency to keep a worker busy.
        "ROBOTSTXT_OBEY": False,
        "CONCURRENT_REQUESTS": 16,
        "CONCURRENT_REQUESTS_PER_DOMAIN": 16,
        "DOWNLOAD_DELAY": 0,
        # Scrapy starts CONCURRENT_ITEMS tasks (default 100) per response to process its output; a page
        # here yields 11 things, so most of those tasks would only cost CPU.
        "CONCURRENT_ITEMS": 16,
        # Close a few seconds after the whole crawl ran out of work.
        "SCHEDULER_IDLE_BEFORE_CLOSE": 3,
        # Requests leased by a killed worker come back to the queue after 10 s instead of a minute.
        "SCHEDULER_LEASE_SECONDS": 10,
        # 503 answers are retried through the frontier after 0.5-0.75 s, then 1-1.5 s.
        "RETRY_BACKOFF_BASE": 0.5,
        # A heartbeat (pages, leases, rate) every second, for the demo's live view.
        "CLUSTERSTATS_INTERVAL": 1.0,
    }

    def parse(self, response):
        yield {"url": response.url, "title": response.css("title::text").get()}
        yield from response.follow_all(css="a")
