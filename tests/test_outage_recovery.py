"""Redis back after an outage: every loop of the worker that is backing off tries again at once, woken by
the worker's :class:`Outage` as soon as a component that had failed gets an answer -- not each at the end
of its own backoff. A real redis-server is killed and started again on the same port."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis.asyncio
from helpers import run
from redis_servers import RedisProcess
from scrapy import Request
from scrapy.utils.test import get_crawler

from scrapy_dist.extensions.clusterstats import PeriodicTask
from scrapy_dist.middlewares.cookies import SharedCookiesMiddleware
from scrapy_dist.pipelines import RedisPipeline
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.redis.outage import Backoff, Outage
from scrapy_dist.settings import CookieSettings

HOUR = 3600.0


def test_redis_back_wakes_every_loop_backing_off(redis_servers: Any) -> None:
    """The item writer and a monitor fail during the outage and would wait an hour before trying again;
    once Redis is back, the first call that gets through (the cookie jar's read) has both try at once."""
    (server,) = redis_servers(1)
    logger = logging.getLogger("test.recovery")

    async def scenario() -> None:
        outage, stats = Outage(), get_crawler().stats
        client = redis.asyncio.Redis.from_url(server.url)
        pipeline = RedisPipeline(redis.asyncio.Redis.from_url(server.url), "books:items", flush_interval=0.01,
                                 stats=stats, outage=outage)
        pipeline.writer.guard.backoff = Backoff(HOUR, HOUR)
        await pipeline.open_spider()

        async def tick() -> None:
            await client.incr("ticks")

        monitor = PeriodicTask(tick, HOUR, "crawl-wide stats", logger, outage)
        cookies = SharedCookiesMiddleware(redis.asyncio.Redis.from_url(server.url), CrawlKeys("books"),
                                          CookieSettings(cache_seconds=0.0), outage=outage)
        server.kill()
        item = asyncio.ensure_future(pipeline.process_item({"n": 1}))
        while not stats.get_value("redis_items/redis_errors"):  # the writer failed: it backs off an hour
            await asyncio.sleep(0.01)
        assert not await monitor.run_once()  # failed: the monitor waits its interval (an hour) to retry
        monitor.start()
        await cookies.process_request(Request("http://shop.example/"))  # fails: the local copy is used
        assert outage.down and not item.done()

        revived = RedisProcess(port=server.port).start()
        try:
            # the first call that gets through: a component that had failed has an answer
            await cookies.process_request(Request("http://shop.example/"))
            await asyncio.wait_for(item, 20)  # written, long before the writer's hour
            while await client.get("ticks") is None:  # the monitor ran again, long before its hour
                await asyncio.sleep(0.01)
            assert pipeline.writer.guard.backoff.failures == monitor.guard.backoff.failures == 0
            assert not outage.down
            assert await client.llen("books:items") == 1
            await monitor.stop()
            await pipeline.close_spider()
            await cookies.spider_closed()
            await client.aclose()
        finally:
            revived.stop()

    run(scenario(), timeout=60)
