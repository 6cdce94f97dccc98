"""How many bytes of Redis memory a queued request, or a remembered URL, costs.

Each measurement starts a fresh, empty ``redis-server``, writes N entries through the contestant's own code,
and divides the growth of ``INFO memory`` ``used_memory`` by N. ``used_memory`` is what Redis's allocator
holds for data and overhead (not the process RSS), so it is what a user pays per entry at scale.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import redis
from scrapy import Request, Spider

from benchmarks.redis_server import RedisProcess, used_memory

#: URL pattern of the requests queued for the memory measurement (never fetched).
URL = "http://127.0.0.1:8080/page/{}"


def plain_requests(n: int) -> list[Request]:
    """N plain GET requests like a crawl of the benchmark site queues: no callback (the spider's
    ``parse``), priority 0, ``meta={"depth": d}`` as Scrapy's DepthMiddleware sets it."""
    return [Request(URL.format(i), meta={"depth": 1 + i % 20}) for i in range(n)]


def fingerprints(n: int) -> list[str]:
    """N distinct 40-character hex SHA1 digests, the type and length scrapy-redis's RFPDupeFilter stores
    (its own ``request_fingerprint`` is a SHA1 hexdigest too)."""
    return [hashlib.sha1(URL.format(i).encode()).hexdigest() for i in range(n)]


def bytes_per_entry(write: Callable[[redis.Redis], None], n: int) -> dict:
    """Run ``write(client)`` against a fresh Redis; ``used_memory`` growth per entry (and the keys made)."""
    server = RedisProcess().start()
    try:
        client = redis.Redis(port=server.port)
        client.flushall()
        # The slow log keeps copies (up to 32 args x 128 bytes, 128 entries) of slow calls' arguments --
        # a batched script call is "slow" -- which would be counted as the queue's memory.
        client.config_set("slowlog-log-slower-than", -1)
        before = used_memory(client)
        t = time.perf_counter()
        write(client)
        seconds = time.perf_counter() - t
        after = used_memory(client)
        keys = sorted(k.decode() if isinstance(k, bytes) else k for k in client.keys("*"))
        key_bytes = sum(client.memory_usage(k, samples=0) or 0 for k in keys)
        client.close()
    finally:
        server.stop()
    return {
        "n": n,
        "bytes_per_entry": (after - before) / n,
        "used_memory_delta": after - before,
        "key_memory_usage_per_entry": key_bytes / n,  # MEMORY USAGE of the keys, a cross-check
        "keys": keys[:20],
        "write_seconds": seconds,
        "method": getattr(write, "method", None),
    }


def _spider() -> Spider:
    return Spider(name="bench")


# -- scrapy-redis --------------------------------------------------------------------------------------
def scrapy_redis_queue(requests: list[Request]) -> Callable[[redis.Redis], None]:
    """Push through scrapy-redis's own ``PriorityQueue.push`` (pickle serializer, one ZADD each)."""

    def write(client: redis.Redis) -> None:
        from scrapy_redis import picklecompat
        from scrapy_redis.queue import PriorityQueue

        queue = PriorityQueue(
            server=client, spider=_spider(), key="%(spider)s:requests", serializer=picklecompat
        )
        for request in requests:
            queue.push(request)
        assert len(queue) == len(requests), "scrapy-redis queue lost entries"

    return write


def scrapy_redis_dupefilter(requests: list[Request]) -> Callable[[redis.Redis], None]:
    """Remember every request through ``RFPDupeFilter.request_seen`` (one SADD each)."""

    def write(client: redis.Redis) -> None:
        from scrapy_redis.dupefilter import RFPDupeFilter

        df = RFPDupeFilter(client, key="bench:dupefilter")
        for request in requests:
            df.request_seen(request)

    return write


# -- scrapy-dist ---------------------------------------------------------------------------------------
def scrapy_dist_queue(requests: list[Request]) -> Callable[[redis.Redis], None]:
    """HOOK (scrapy-dist frontier): write ``requests`` exactly as the scheduler queues them.

    Uses the scheduler's own path: ``scrapy_dist.wire.codec.encode_request`` payloads sent through
    ``Frontier.sync(SyncBatch(enqueue=...))`` (the ``sync`` Lua script) in batches of
    ``SCHEDULER_FLUSH_BATCH``, dedupe skipped (the dupefilter is measured separately), so the figure counts
    every key the real path writes. If that API changes, adapt :func:`_frontier_enqueue`; the
    ``{bench}:queue`` ZSET layout of singles (6-byte sequence + payload, score -priority; the real path
    packs them into chunks, see ``lua/sync.lua``) is the fallback, and
    ``write.method`` says which one was measured.
    """

    def write(client: redis.Redis) -> None:
        from scrapy_dist.wire.codec import encode_request

        spider = _spider()
        payloads = [(float(-r.priority), encode_request(r, spider)) for r in requests]
        try:
            _frontier_enqueue(client, payloads)
            write.method = "scrapy_dist.frontier.shard.Frontier.sync"  # type: ignore[attr-defined]
        except ImportError:
            _layout_enqueue(client, payloads)
            write.method = "documented ZSET layout (frontier API not importable)"  # type: ignore[attr-defined]
        from scrapy_dist.redis.keys import CrawlKeys

        queued = int(client.hget(CrawlKeys("bench").queue_tails, "count") or 0)  # members may be chunks
        assert queued == len(requests), "scrapy-dist queue lost entries"

    return write


def _frontier_enqueue(client: redis.Redis, payloads: list[tuple[float, bytes]]) -> None:
    import asyncio

    import redis.asyncio

    from scrapy_dist.frontier.shard import Frontier, SyncBatch
    from scrapy_dist.redis.keys import CrawlKeys
    from scrapy_dist.settings import defaults

    batch_size = defaults.SCHEDULER_FLUSH_BATCH
    kw = client.connection_pool.connection_kwargs

    async def push() -> None:
        aclient = redis.asyncio.Redis(host=kw.get("host", "127.0.0.1"), port=kw["port"])
        try:
            frontier = Frontier(aclient, CrawlKeys("bench"), "bench-worker", None)
            for i in range(0, len(payloads), batch_size):
                chunk = payloads[i : i + batch_size]
                await frontier.sync(SyncBatch(enqueue=[("", "", score, p, "", "") for score, p in chunk]))
        finally:
            await aclient.aclose()

    asyncio.run(push())


def _layout_enqueue(client: redis.Redis, payloads: list[tuple[float, bytes]]) -> None:
    from scrapy_dist.redis.keys import CrawlKeys

    key = CrawlKeys("bench").queue
    pipe = client.pipeline(transaction=False)
    for seq, (score, payload) in enumerate(payloads, start=1):
        pipe.zadd(key, {seq.to_bytes(6, "big") + payload: score})
        if seq % 1000 == 0:
            pipe.execute()
    pipe.execute()
