"""Items/s through scrapy-dist's RedisPipeline vs scrapy-redis's RedisPipeline, in one run.

Both pipelines get the same items (a typical scraped record: URL, title, price as ``Decimal``, date, a
few hundred characters of text), through their own ``process_item``, with 100 items in flight at a time
-- Scrapy's default ``CONCURRENT_ITEMS`` -- on Scrapy's asyncio reactor with a minimal crawler
(``scrapy.utils.test.get_crawler``). Time runs from the first ``process_item`` until every call has
returned (for scrapy-dist: the item is in Redis; ``close_spider`` is included, it writes the last batch).

* scrapy-redis 0.9.1: one ``RPUSH`` per item from Twisted's thread pool (10 threads, Scrapy's default
  ``REACTOR_THREADPOOL_MAXSIZE``), one round trip each;
* scrapy-dist: batches (``REDIS_ITEMS_BATCH_SIZE`` = 100) written in one ``MULTI``/``EXEC`` round trip each,
  LIST (``RPUSH``) and STREAM (``XADD``) modes.

Networks: a loopback ``redis-server``, and the same server behind ``benchmarks.proxy`` adding 1 ms of
round-trip time (a Redis in the same data centre), whose counters give the round trips per item.
Every configuration runs in a fresh child process (a Twisted reactor cannot be restarted).

``python -m benchmarks.items [--quick] [--items-count N]`` prints the figures; ``run(args)`` is the
harness entry point.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

TITLE = "Item pipeline: scrapy-dist RedisPipeline vs scrapy-redis RedisPipeline"
IN_FLIGHT = 100  # Scrapy's CONCURRENT_ITEMS
RTT_MS = 1.0
IMPLEMENTATIONS = [
    "scrapy-redis", "scrapy-dist list", "scrapy-dist stream", "scrapy-dist list riding acks",
    "scrapy-dist stream riding acks",
]
KEY = "bench:items"
REPO = Path(__file__).resolve().parent.parent


def make_item(i: int) -> dict[str, Any]:
    return {
        "url": f"https://books.example/catalogue/book-{i}/index.html",
        "title": f"A Book Title Number {i}",
        "price": Decimal("19.99") + i % 100,
        "scraped": datetime.datetime(2025, 1, 1, 12, 0, 0) + datetime.timedelta(seconds=i),
        "in_stock": i % 3 != 0,
        "tags": ["fiction", "classics", f"shelf-{i % 40}"],
        "description": "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 5,
    }


# -- child: one measurement on Scrapy's reactor --------------------------------------------------
async def _drive(process: Any, count: int) -> None:
    """``process`` every item, ``IN_FLIGHT`` at a time; finished tasks are dropped at once (20,000 live
    tasks would make the garbage collector, not the pipeline, the bottleneck)."""
    sem = asyncio.Semaphore(IN_FLIGHT)
    running: set[asyncio.Future[None]] = set()
    errors: list[BaseException] = []

    async def one(i: int) -> None:
        try:
            await process(make_item(i))
        except Exception as exc:
            errors.append(exc)
        finally:
            sem.release()

    for i in range(count):
        await sem.acquire()
        task = asyncio.ensure_future(one(i))
        running.add(task)
        task.add_done_callback(running.discard)
    await asyncio.gather(*running)
    if errors:
        raise errors[0]


async def _measure(impl: str, url: str, count: int) -> dict[str, Any]:
    import redis
    import scrapy
    from scrapy.utils.defer import maybe_deferred_to_future
    from scrapy.utils.test import get_crawler

    class BenchSpider(scrapy.Spider):
        name = "bench"

    stream = "stream" in impl
    settings = {"REDIS_URL": url, "REDIS_ITEMS_KEY": KEY, "REDIS_ITEMS_STREAM": stream}
    crawler = get_crawler(BenchSpider, settings)
    if impl.endswith("riding acks"):
        elapsed = await _ride_acks(crawler, url, count, stream)
    elif impl == "scrapy-redis":
        from scrapy_redis.pipelines import RedisPipeline as ScrapyRedisPipeline

        spider = BenchSpider()
        pipe = ScrapyRedisPipeline.from_crawler(crawler)

        async def process(item: Any) -> Any:
            return await maybe_deferred_to_future(pipe.process_item(item, spider))

        start = time.perf_counter()
        await _drive(process, count)
        elapsed = time.perf_counter() - start
    else:
        from scrapy_dist.pipelines import RedisPipeline

        pipe = RedisPipeline.from_crawler(crawler)
        await pipe.open_spider()
        start = time.perf_counter()
        await _drive(pipe.process_item, count)
        await pipe.close_spider()
        elapsed = time.perf_counter() - start
    client = redis.Redis.from_url(url)
    stored = client.xlen(KEY) if stream else client.llen(KEY)
    client.close()
    return {"seconds": elapsed, "stored": stored, "stats": crawler.stats.get_stats()}


async def _ride_acks(crawler: Any, url: str, count: int, stream: bool) -> float:
    """The exactly-once path: ``count`` pages of one item each, leased beforehand (not timed); each item
    goes through ``process_item`` and the ``item_scraped`` staging, and every ``IN_FLIGHT`` pages are
    acknowledged with their items in one ``sync`` call, as a worker's round does."""
    from types import SimpleNamespace

    import redis.asyncio

    from scrapy_dist.frontier.engine import ItemOutbox
    from scrapy_dist.frontier.shard import Frontier, ItemRoute, SyncBatch
    from scrapy_dist.pipelines import RedisPipeline
    from scrapy_dist.redis.keys import CrawlKeys

    client = redis.asyncio.Redis.from_url(url)
    frontier = Frontier(client, CrawlKeys("bench"), "bench:1:w", None,
                        items=ItemRoute(KEY, "stream" if stream else "list"))
    for first in range(0, count, 500):
        last = min(count, first + 500)
        pages = [("", "", float(i), b"\x01page-%d" % i, "", "") for i in range(first, last)]
        await frontier.sync(SyncBatch(enqueue=pages))
    leases: list[bytes] = []
    while len(leases) < count:
        got = await frontier.sync(SyncBatch(lease=min(1000, count - len(leases))))
        leases += [m for m, _ in got.leased]
    pipe = RedisPipeline.from_crawler(crawler)
    await pipe.open_spider()
    pipe.outbox = outbox = ItemOutbox()
    start = time.perf_counter()
    for first in range(0, count, IN_FLIGHT):
        batch = SyncBatch()
        for i in range(first, min(count, first + IN_FLIGHT)):
            response = SimpleNamespace(request=object())
            item = await pipe.process_item(make_item(i))
            pipe.item_scraped(item, response)
            batch.ack.append(leases[i])
            batch.items += [(leases[i], data) for data in outbox.take(response.request)]
        await frontier.sync(batch)
    elapsed = time.perf_counter() - start
    await pipe.close_spider()
    await client.aclose()
    return elapsed


def _child(spec: dict[str, Any]) -> None:
    from scrapy.utils.defer import deferred_from_coro
    from scrapy.utils.reactor import install_reactor

    install_reactor("twisted.internet.asyncioreactor.AsyncioSelectorReactor")
    from twisted.internet import reactor

    reactor.suggestThreadPoolSize(10)  # type: ignore[attr-defined]  # Scrapy's REACTOR_THREADPOOL_MAXSIZE
    out: dict[str, Any] = {}

    def start() -> None:
        d = deferred_from_coro(_measure(spec["impl"], spec["url"], spec["count"]))
        d.addCallbacks(out.update, lambda f: out.update(error=f.getTraceback()))
        d.addBoth(lambda _: reactor.stop())  # type: ignore[attr-defined]

    reactor.callWhenRunning(start)  # type: ignore[attr-defined]
    reactor.run()  # type: ignore[attr-defined]
    print(json.dumps(out, default=str))


def _run_child(impl: str, url: str, count: int) -> dict[str, Any]:
    spec = json.dumps({"impl": impl, "url": url, "count": count})
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.items", "--child", spec],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        raise RuntimeError(f"{impl} run failed:\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1])
    if "error" in result:
        raise RuntimeError(f"{impl} run failed:\n{result['error']}")
    return result


# -- parent: servers, runs, table -----------------------------------------------------------------
def measure(count: int, repeat: int = 3, rtt_ms: float = RTT_MS) -> list[dict[str, Any]]:
    """One row per (network, implementation): the best of ``repeat`` runs, interleaved so that a burst of
    load from elsewhere on the machine does not favour one implementation."""
    import redis

    from benchmarks.proxy import ProxyProcess
    from benchmarks.redis_server import RedisProcess

    rows: dict[tuple[str, str], dict[str, Any]] = {}
    server = RedisProcess().start()
    proxy = ProxyProcess(server.port, rtt_ms).start()
    try:
        admin = redis.Redis(port=server.port)
        for network, url in (("loopback", server.url), (f"{rtt_ms:g} ms RTT", proxy.url)):
            for attempt in range(repeat):
                for impl in IMPLEMENTATIONS:
                    admin.flushall()
                    proxy.reset()
                    r = _run_child(impl, url, count)
                    trips = proxy.stats()["round_trips"] if url == proxy.url else None
                    rate = count / r["seconds"]
                    print(
                        f"{network:>10}  {impl:<19} run {attempt + 1}/{repeat} {rate:>10,.0f} items/s"
                        + (f"  {trips / count:.3f} round trips/item" if trips is not None else ""),
                        flush=True,
                    )
                    row = rows.setdefault(
                        (network, impl),
                        {
                            "network": network,
                            "pipeline": impl,
                            "items": count,
                            "runs_items_per_s": [],
                        },
                    )
                    row["runs_items_per_s"].append(rate)
                    if rate >= max(row["runs_items_per_s"]):
                        row.update(
                            stored=r["stored"],
                            seconds=r["seconds"],
                            items_per_s=rate,
                            round_trips=trips,
                            round_trips_per_item=trips / count if trips is not None else None,
                            batches=r["stats"].get("redis_items/batches"),
                        )
                    row["stored_min"] = min(row.get("stored_min", r["stored"]), r["stored"])
        admin.close()
    finally:
        proxy.stop()
        server.stop()
    return list(rows.values())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--items-count",
        type=int,
        metavar="N",
        help="items pushed through each pipeline (default 20,000; 2,000 with --quick)",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    count = getattr(args, "items_count", None) or (2_000 if getattr(args, "quick", False) else 20_000)
    repeat = getattr(args, "items_repeat", None) or (1 if getattr(args, "quick", False) else 3)
    rows = measure(count, repeat)
    lost = [r for r in rows if r["stored_min"] != r["items"]]
    by = {(r["network"], r["pipeline"]): r["items_per_s"] for r in rows}
    networks = list(dict.fromkeys(r["network"] for r in rows))
    speedups = {n: by[(n, "scrapy-dist list")] / by[(n, "scrapy-redis")] for n in networks}
    return {
        "title": TITLE,
        "summary": "; ".join(
            f"{n}: scrapy-dist (LIST) writes {s:.1f}x the items/s of scrapy-redis"
            for n, s in speedups.items()
        )
        + ".",
        "tables": [
            {
                "title": f"{count:,} items, {IN_FLIGHT} in flight, one process, best of {repeat} runs",
                "columns": ["network", "pipeline", "items/s", "round trips/item", "stored"],
                "rows": [
                    [
                        r["network"],
                        r["pipeline"],
                        round(r["items_per_s"]),
                        None if r["round_trips_per_item"] is None else round(r["round_trips_per_item"], 3),
                        r["stored"],
                    ]
                    for r in rows
                ],
                "notes": ["scrapy-dist returns each item only once it is in Redis (the batch is written)."],
            }
        ],
        "charts": [
            {
                "title": "Item pipeline throughput",
                "ylabel": "items/s",
                "categories": networks,
                "series": {impl: [by.get((n, impl)) for n in networks] for impl in IMPLEMENTATIONS},
            }
        ],
        "notes": [f"items missing in Redis: {[(r['network'], r['pipeline']) for r in lost]}"] if lost else [],
        "data": {"rows": rows, "speedup_list_vs_scrapy_redis": speedups},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=TITLE)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    add_arguments(parser)
    ns = parser.parse_args()
    if ns.child:
        _child(json.loads(ns.child))
    else:
        result = run(ns)
        print(result["summary"])
        print(json.dumps(result["data"], indent=2, default=str))
