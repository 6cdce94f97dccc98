"""RedisPipeline: batching, 'not scraped before written', LIST and STREAM modes, encoding errors, Redis
outages; end-to-end with two real ``scrapy crawl`` workers sharing the frontier."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import logging
import threading
import time
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
import scrapy
from crawlproject import make_project
from helpers import run
from redis_servers import RedisProcess
from scrapy.exceptions import DropItem, NotConfigured
from scrapy.utils.test import get_crawler
from zygote import Zygote

from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.pipelines import RedisPipeline, find_unencodable
from scrapy_dist.settings.reader import start_error

KEY = "books:items"


class Book(scrapy.Item):
    title = scrapy.Field()
    price = scrapy.Field()
    published = scrapy.Field()


@dataclasses.dataclass
class Page:
    url: str
    extra: Any = None


def make_pipeline(url: str, **kw: Any) -> RedisPipeline:
    kw.setdefault("stats", get_crawler().stats)
    return RedisPipeline(redis.asyncio.Redis.from_url(url), kw.pop("key", KEY), **kw)


class Clock:
    """The writer's monotonic clock, moved by hand (then ``writer.wake()`` makes it look again)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def settle() -> None:
    """Let the writer task run until it waits again: it decides without I/O whether a write is due."""
    for _ in range(10):
        await asyncio.sleep(0)


# -- batching and the "written before reported" guarantee ---------------------------------------
def test_items_are_not_returned_before_their_batch_is_written(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario() -> None:
        p = make_pipeline(redis_url, batch_size=100, flush_interval=3600)
        p.writer.clock = clock = Clock()
        await p.open_spider()
        tasks = [asyncio.ensure_future(p.process_item({"n": i})) for i in range(5)]
        await settle()
        clock.t += 3599
        p.writer.wake()
        await settle()
        # neither interval nor batch size reached: nothing written, nothing reported
        assert not any(t.done() for t in tasks)
        assert p.writer.buffered == 5 and p.writer.due_in(clock()) == 1.0
        assert redis_client.llen(KEY) == 0
        await p.close_spider()
        assert all(t.done() for t in tasks)
        assert [t.result() for t in tasks] == [{"n": i} for i in range(5)]
        assert [json.loads(v) for v in redis_client.lrange(KEY, 0, -1)] == [{"n": i} for i in range(5)]

    run(scenario())


def test_a_full_batch_is_written_without_waiting_for_the_interval(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario() -> None:
        stats = get_crawler().stats
        p = make_pipeline(redis_url, batch_size=10, flush_interval=3600, stats=stats)
        p.writer.clock = Clock()
        await p.open_spider()
        first = [asyncio.ensure_future(p.process_item({"n": i})) for i in range(10)]
        await asyncio.wait_for(asyncio.gather(*first), 5)
        assert redis_client.llen(KEY) == 10
        rest = [asyncio.ensure_future(p.process_item({"n": i})) for i in range(10, 13)]
        await settle()
        assert not any(t.done() for t in rest) and p.writer.buffered == 3
        assert redis_client.llen(KEY) == 10
        await p.close_spider()
        assert [json.loads(v)["n"] for v in redis_client.lrange(KEY, 0, -1)] == list(range(13))
        assert stats.get_value("redis_items/written") == 13
        assert stats.get_value("redis_items/batches") == 2

    run(scenario())


def test_a_flush_takes_along_everything_buffered_in_one_round_trip(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario() -> None:
        stats = get_crawler().stats
        p = make_pipeline(redis_url, batch_size=10, flush_interval=3600, stats=stats)
        await p.open_spider()
        # 25 items arrive before the writer runs: the full batches trigger one write that takes all 25
        await asyncio.wait_for(asyncio.gather(*(p.process_item({"n": i}) for i in range(25))), 5)
        assert redis_client.llen(KEY) == 25
        assert stats.get_value("redis_items/batches") == 1
        await p.close_spider()

    run(scenario())


def test_a_partial_batch_is_written_after_the_flush_interval(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario() -> None:
        p = make_pipeline(redis_url, batch_size=1000, flush_interval=0.05)
        await p.open_spider()
        await asyncio.wait_for(asyncio.gather(*(p.process_item({"n": i}) for i in range(3))), 5)
        assert redis_client.llen(KEY) == 3
        await p.close_spider()

    run(scenario())


def test_encoding_matches_scrapy_redis(redis_url: str, redis_client: redis.Redis) -> None:
    """Scrapy's JSON encoder: Items, dataclasses, dates and decimals are written as scrapy-redis does."""
    from scrapy.utils.serialize import ScrapyJSONEncoder

    items = [
        Book(title="Dune", price=Decimal("9.99"), published=datetime.date(1965, 8, 1)),
        Page(url="http://x/1", extra={"when": datetime.datetime(2024, 1, 2, 3, 4, 5)}),
        {"tags": {"a"}, "n": 1},
    ]

    async def scenario() -> None:
        p = make_pipeline(redis_url, flush_interval=0.01)
        await p.open_spider()
        for item in items:
            assert await p.process_item(item) is item
        await p.close_spider()

    run(scenario())
    stored = redis_client.lrange(KEY, 0, -1)
    assert [s.decode() for s in stored] == [ScrapyJSONEncoder().encode(i) for i in items]
    assert json.loads(stored[0]) == {"title": "Dune", "price": "9.99", "published": "1965-08-01"}


# -- STREAM mode -------------------------------------------------------------------------------
def test_stream_mode_appends_entries_with_the_item_field(redis_url: str, redis_client: redis.Redis) -> None:
    async def scenario() -> None:
        p = make_pipeline(redis_url, stream=True, batch_size=7, flush_interval=0.01)
        await p.open_spider()
        await asyncio.gather(*(p.process_item({"n": i}) for i in range(20)))
        await p.close_spider()

    run(scenario())
    entries = redis_client.xrange(KEY)
    assert sorted(json.loads(fields[b"item"])["n"] for _, fields in entries) == list(range(20))
    # consumers can use consumer groups on it
    redis_client.xgroup_create(KEY, "consumers", id="0")
    got = redis_client.xreadgroup("consumers", "c1", {KEY: ">"}, count=100)
    assert len(got[0][1]) == 20


def test_stream_maxlen_trims_approximately(redis_url: str, redis_client: redis.Redis) -> None:
    async def scenario() -> None:
        p = make_pipeline(redis_url, stream=True, maxlen=100, batch_size=50, flush_interval=0.01)
        await p.open_spider()
        await asyncio.gather(*(p.process_item({"n": i}) for i in range(1000)))
        await p.close_spider()

    run(scenario())
    assert 100 <= redis_client.xlen(KEY) < 1000
    # the newest entries are the ones kept
    last = redis_client.xrevrange(KEY, count=1)[0][1][b"item"]
    assert json.loads(last) == {"n": 999}


def test_open_refuses_a_key_of_the_wrong_type(redis_url: str, redis_client: redis.Redis) -> None:
    redis_client.rpush(KEY, "x")

    async def scenario() -> None:
        p = make_pipeline(redis_url, stream=True)
        with pytest.raises(ScrapyDistError, match="REDIS_ITEMS_STREAM"):
            await p.open_spider()
        await p.server.aclose()

    run(scenario())


# -- encoding errors ---------------------------------------------------------------------------
def test_unencodable_item_is_dropped_naming_the_field(redis_url: str, redis_client: redis.Redis) -> None:
    async def scenario() -> None:
        stats = get_crawler().stats
        p = make_pipeline(redis_url, flush_interval=0.01, stats=stats)
        await p.open_spider()
        with pytest.raises(DropItem, match=r"field 'meta\.tags\[1\]'") as info:
            await p.process_item({"url": "u", "meta": {"tags": ["ok", object()]}})
        assert info.value.log_level == "ERROR"
        with pytest.raises(DropItem, match=r"field 'price'"):
            await p.process_item(Book(title="t", price=object()))
        # the crawl goes on: later items are written
        await p.process_item({"url": "v"})
        await p.close_spider()
        assert stats.get_value("redis_items/unserializable") == 2
        assert stats.get_value("redis_items/written") == 1

    run(scenario())
    assert [json.loads(v) for v in redis_client.lrange(KEY, 0, -1)] == [{"url": "v"}]


def test_find_unencodable_reports_the_value_itself_when_no_part_is_to_blame() -> None:
    from scrapy_dist.pipelines import default_serialize

    # every key and value encodes alone, but a tuple key cannot be a JSON object key
    path, error = find_unencodable({"a": {(1, 2): "x"}}, default_serialize)
    assert path == "a"
    assert isinstance(error, TypeError)


# -- Redis outages -----------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["list", "stream"])
def test_items_wait_through_a_redis_outage_and_none_is_lost(redis_servers: Any, stream: bool) -> None:
    (server,) = redis_servers(1)
    port = server.port

    async def scenario() -> None:
        stats = get_crawler().stats
        p = make_pipeline(server.url, stream=stream, batch_size=10, flush_interval=0.02, stats=stats)
        await p.open_spider()
        await asyncio.gather(*(p.process_item({"n": i}) for i in range(10)))
        server.kill()
        tasks = [asyncio.ensure_future(p.process_item({"n": i})) for i in range(10, 35)]
        while not stats.get_value("redis_items/redis_errors"):  # the writer found Redis gone
            await asyncio.sleep(0.01)
        assert not any(t.done() for t in tasks)  # not reported while Redis is down
        assert p.outage.down
        # a fresh server: empty, and without the stream script (NOSCRIPT is handled)
        revived = RedisProcess(port=port).start()
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), 20)
            await p.close_spider()
            client = redis.Redis(port=port)
            # exactly the items written after it came back
            assert sorted(n["n"] for n in _items(client, KEY, stream)) == list(range(10, 35))
            client.close()
            assert stats.get_value("redis_items/redis_errors") >= 1
        finally:
            revived.stop()

    run(scenario())


# -- settings ----------------------------------------------------------------------------------
def test_from_crawler_reads_settings(redis_url: str) -> None:
    class BooksSpider(scrapy.Spider):
        name = "books"

    crawler = get_crawler(
        BooksSpider,
        {
            "REDIS_URL": redis_url,
            "REDIS_KEY_PREFIX": "shop:",
            "REDIS_ITEMS_KEY": "%(spider)s:out",
            "REDIS_ITEMS_STREAM": True,
            "REDIS_ITEMS_MAXLEN": 5000,
            "REDIS_ITEMS_BATCH_SIZE": 7,
            "REDIS_ITEMS_FLUSH_INTERVAL": 0.5,
            "REDIS_ITEMS_SERIALIZER": "json.dumps",
        },
    )
    p = RedisPipeline.from_crawler(crawler)
    assert (p.key, p.stream, p.maxlen, p.batch_size, p.flush_interval) == (
        "shop:books:out",
        True,
        5000,
        7,
        0.5,
    )
    assert p.serialize is json.dumps
    assert p.stats is crawler.stats
    asyncio.run(p.server.aclose())


@pytest.mark.parametrize("stream", [False, True], ids=["list", "stream"])
def test_item_key_can_route_items_to_several_keys(
    redis_url: str, redis_client: redis.Redis, stream: bool
) -> None:
    class ByKind(RedisPipeline):
        def item_key(self, item: Any) -> str:
            return f"items:{item['kind']}"

    async def scenario() -> None:
        p = ByKind(redis.asyncio.Redis.from_url(redis_url), KEY, stream=stream, flush_interval=0.01)
        await p.open_spider()
        await asyncio.gather(*(p.process_item({"kind": k, "n": i}) for i, k in enumerate("abab")))
        await p.close_spider()

    run(scenario())
    assert [i["n"] for i in _items(redis_client, "items:a", stream)] == [0, 2]
    assert [i["n"] for i in _items(redis_client, "items:b", stream)] == [1, 3]


# -- subclasses written for scrapy-redis's RedisPipeline ----------------------------------------
class _Spider(scrapy.Spider):
    name = "books"


def test_scrapy_redis_subclass_calling_process_item_with_the_spider_writes(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """``return RedisPipeline.process_item(self, item, spider)`` (scrapy-redis's signature) raised a
    TypeError for every item."""

    class Tagged(RedisPipeline):
        def process_item(self, item: Any, spider: Any) -> Any:  # type: ignore[override]
            item["by"] = spider.name
            return RedisPipeline.process_item(self, item, spider)

    async def scenario() -> None:
        p = Tagged(redis.asyncio.Redis.from_url(redis_url), KEY, flush_interval=0.01)
        await p.open_spider()
        await p.process_item({"n": 1}, _Spider())
        await p.close_spider()

    run(scenario())
    assert _items(redis_client, KEY, False) == [{"n": 1, "by": "books"}]


def test_scrapy_redis_hooks_nothing_calls_are_named_at_start(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An overridden _process_item (scrapy-redis's write, in a thread) and a blocking process_item using
    self.server (here an asyncio client: un-awaited commands write nothing) were silently ignored."""

    class Private(RedisPipeline):
        def _process_item(self, item: Any, spider: Any) -> Any:
            self.server.rpush(f"{spider.name}:products", item["url"])
            return item

    class Blocking(RedisPipeline):
        def process_item(self, item: Any, spider: Any) -> Any:  # type: ignore[override]
            self.server.rpush(f"{spider.name}:raw", json.dumps(item))
            return item

    class Fine(RedisPipeline):
        async def process_item(self, item: Any, spider: Any = None) -> Any:
            await self.server.incr("count")
            return await super().process_item(item)

    crawler = get_crawler(_Spider, {"REDIS_URL": redis_url})
    for cls in (Private, Blocking, Fine):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="scrapy_dist.pipelines"):
            p = cls.from_crawler(crawler)
        asyncio.run(p.server.aclose())
        lines = [r.getMessage() for r in caplog.records]
        if cls is Fine:
            assert lines == []
            continue
        [line] = lines
        hook = "_process_item() is never called" if cls is Private else "process_item() uses self.server"
        assert line.startswith(f"scrapy-dist: {cls.__name__}.{hook}"), line
        assert "process_item(self, item)" in line


def test_scrapy_redis_constructor_is_one_line_and_exit_1(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``__init__(self, server)`` (scrapy-redis's constructor) ended the crawl with a TypeError
    traceback."""

    class Old(RedisPipeline):
        def __init__(self, server: Any) -> None:
            super().__init__(server, KEY)

    crawler = get_crawler(_Spider, {"REDIS_URL": redis_url})
    with caplog.at_level(logging.ERROR), pytest.raises(NotConfigured):
        Old.from_crawler(crawler)
    assert start_error(crawler) is not None
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert line.startswith("scrapy-dist: ") and "Old.__init__(server)" in line and "\n" not in line
    assert "**kwargs" in line


# -- end to end: real scrapy crawl workers -----------------------------------------------------
def _items(client: redis.Redis, key: str, stream: bool) -> list[dict[str, Any]]:
    if stream:
        return [json.loads(fields[b"item"]) for _, fields in client.xrange(key)]
    return [json.loads(v) for v in client.lrange(key, 0, -1)]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["list", "stream"])
def test_two_workers_write_every_item_exactly_as_often_as_scraped(
    tmp_path: Path, site_factory: Any, redis_url: str, redis_client: redis.Redis, stream: bool
) -> None:
    site = site_factory(pages=300, links=8)
    project = make_project(
        tmp_path,
        {
            "REDIS_URL": redis_url,
            "ITEM_PIPELINES": {"scrapy_dist.pipelines.RedisPipeline": 300},
            "REDIS_ITEMS_STREAM": stream,
            "REDIS_ITEMS_BATCH_SIZE": 20,
            "REDIS_ITEMS_FLUSH_INTERVAL": 0.2,
        },
    )
    try:
        for _ in range(2):
            project.crawl("links", args={"seed": site.page_url(0)})
        assert project.wait_all(timeout=120) == [0, 0], project.logs()
    finally:
        project.stop_all()
    items = _items(redis_client, "links:items", stream)
    scraped = [project.stats(i).get("item_scraped_count", 0) for i in range(2)]
    written = [project.stats(i).get("redis_items/written", 0) for i in range(2)]
    assert all(scraped), f"both workers should have scraped items: {scraped}\n{project.logs()[-3000:]}"
    assert len(items) == sum(scraped) == sum(written)
    counts = Counter(item["url"] for item in items)
    assert set(counts) == {site.page_url(i) for i in range(300)}
    assert set(counts.values()) == {1}  # nothing crawled twice, so nothing written twice


SLOW_ITEMS_SPIDER = '''
import scrapy


class SlowItemsSpider(scrapy.Spider):
    """Follows links; each page yields 3 items (so batches fill across pages)."""

    name = "slowitems"

    def __init__(self, seed=None, **kw):
        super().__init__(**kw)
        self.seed = seed

    async def start(self):
        yield scrapy.Request(self.seed)

    def parse(self, response):
        for part in range(3):
            yield {"url": response.url, "part": part}
        for href in response.css("a::attr(href)").getall():
            yield response.follow(href)
'''


@pytest.mark.slow
def test_a_worker_killed_mid_crawl_loses_no_item(
    tmp_path: Path, site_factory: Any, redis_url: str, redis_client: redis.Redis
) -> None:
    site = site_factory(pages=400, links=6, slow=200, slow_delay=0.1)
    project = make_project(
        tmp_path,
        {
            "REDIS_URL": redis_url,
            "ITEM_PIPELINES": {"scrapy_dist.pipelines.RedisPipeline": 300},
            "REDIS_ITEMS_BATCH_SIZE": 20,
            "REDIS_ITEMS_FLUSH_INTERVAL": 0.2,
            "SCHEDULER_LEASE_SECONDS": 3,
            "CONCURRENT_REQUESTS": 4,
            "SCHEDULER_IDLE_BEFORE_CLOSE": 2,
        },
        spiders=SLOW_ITEMS_SPIDER,
    )
    try:
        # The victim never fills a batch before it dies: every item it scraped is still buffered. Had it
        # reported them scraped (and the frontier acknowledged their requests), they would be lost.
        victim = project.crawl(
            "slowitems",
            args={"seed": site.page_url(0)},
            settings={"REDIS_ITEMS_BATCH_SIZE": 100_000, "REDIS_ITEMS_FLUSH_INTERVAL": 60},
        )
        project.crawl("slowitems", args={"seed": site.page_url(0)})
        deadline = time.monotonic() + 60
        while sum(site.fetch_counts().values()) < 120 or not redis_client.llen("slowitems:items"):
            assert time.monotonic() < deadline, project.logs()[-3000:]
            assert victim.poll() is None, project.logs()[-3000:]
            time.sleep(0.05)
        project.kill(victim)
        survivor = project.procs[1][0]
        assert survivor.wait(120) == 0, project.logs()[-3000:]
    finally:
        project.stop_all()
    # the victim died holding leased requests, which the survivor crawled again
    assert project.stats(1).get("scheduler/requeued/lease_expired", 0) > 0, project.logs()[-3000:]
    items = _items(redis_client, "slowitems:items", stream=False)
    seen = Counter((item["url"], item["part"]) for item in items)
    expected = {(site.page_url(i), part) for i in range(400) for part in range(3)}
    assert set(seen) == expected, f"missing: {sorted(expected - set(seen))[:10]}"
    # every page the victim downloaded was downloaded again by the survivor
    assert sum(site.fetch_counts().values()) > 400


# -- scrapy-dist items -------------------------------------------------------------------------
def _write_items(client: redis.Redis, key: str, stream: bool, items: list[Any]) -> None:
    for item in items:
        data = item if isinstance(item, str) else json.dumps(item)
        if stream:
            client.xadd(key, {"item": data})
        else:
            client.rpush(key, data)


@pytest.mark.parametrize("stream", [False, True], ids=["list", "stream"])
def test_items_command_prints_json_lines(redis_url: str, redis_client: redis.Redis, stream: bool) -> None:
    from click.testing import CliRunner

    from scrapy_dist.cli import main

    _write_items(redis_client, "books:items", stream, [{"n": 1}, "not json", {"n": 2, "t": "é"}])
    result = CliRunner().invoke(main, ["--redis-url", redis_url, "items", "books", "--json-lines"])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == ['{"n":1}', '{"n":2,"t":"é"}']
    assert "not JSON" in result.stderr
    # the items are read, not consumed
    assert (redis_client.xlen if stream else redis_client.llen)("books:items") == 3

    result = CliRunner().invoke(main, ["items", "books", "--redis-url", redis_url])
    assert result.exit_code == 0, result.output
    assert '"n": 2' in result.stdout and "not json" in result.stdout
    assert "3 items in 'books:items'" in result.stderr


def test_items_command_refuses_a_key_of_another_type(redis_url: str, redis_client: redis.Redis) -> None:
    from click.testing import CliRunner

    from scrapy_dist.cli import main

    redis_client.hset("books:items", "a", "b")
    result = CliRunner().invoke(main, ["--redis-url", redis_url, "items", "books"])
    assert result.exit_code == 1
    assert "is a Redis hash" in result.output


@pytest.mark.parametrize("stream", [False, True], ids=["list", "stream"])
def test_items_command_follows_new_items(redis_url: str, redis_client: redis.Redis, stream: bool) -> None:
    import sys

    cmd = [sys.executable, "-c", "from scrapy_dist.cli import main; main()"]
    cmd += ["--redis-url", redis_url, "items", "books", "--follow", "--json-lines"]
    proc = Zygote.popen_cli(cmd)
    watchdog = threading.Timer(30, proc.kill)  # a missing line must fail the test, not hang it
    watchdog.start()
    try:
        # the key does not exist yet: --follow waits for it
        _write_items(redis_client, "books:items", stream, [{"n": i} for i in range(3)])
        assert [json.loads(proc.stdout.readline()) for _ in range(3)] == [{"n": i} for i in range(3)]
        _write_items(redis_client, "books:items", stream, [{"n": i} for i in range(3, 600)])
        got = [json.loads(proc.stdout.readline()) for _ in range(3, 600)]
        assert got == [{"n": i} for i in range(3, 600)]
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
