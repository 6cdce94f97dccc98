"""Items ride the ack of their page (lua/sync_items.lua): appended to the items key if and only if the
ack is accepted in the same call. Real Redis, real Frontier; time is injected (``now``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis.asyncio
from helpers import run

from scrapy_dist.frontier.shard import Frontier, ItemRoute, SyncBatch
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.settings import SchedulerSettings

KEYS = CrawlKeys("spider")
ITEMS = "spider:items"
T0 = 1_000_000.0


def _entry(i: int) -> tuple[Any, ...]:
    return ("", "", float(i), b"\x01page-%d" % i, "", "")


def _items(client: Any, stream: bool) -> list[str]:
    if stream:
        return [fields[b"item"].decode() for _, fields in client.xrange(ITEMS)]
    return [v.decode() for v in client.lrange(ITEMS, 0, -1)]


async def _workers(url: str, stream: bool, lease_seconds: float = 10.0) -> tuple[Any, Frontier, Frontier]:
    client = redis.asyncio.Redis.from_url(url)
    route = ItemRoute(ITEMS, "stream" if stream else "list")
    config = SchedulerSettings(lease_seconds=lease_seconds)
    a = Frontier(client, KEYS, "host:1:a", None, config, items=route)
    b = Frontier(client, KEYS, "host:2:b", None, config, items=route)
    return client, a, b


@pytest.mark.parametrize("stream", [False, True], ids=["list", "stream"])
def test_items_land_with_the_ack_and_only_then(redis_url: str, redis_client: Any, stream: bool) -> None:
    async def go() -> None:
        client, a, _ = await _workers(redis_url, stream)
        try:
            await a.sync(SyncBatch(enqueue=[_entry(1)]), now=T0)
            (lease, _), = (await a.sync(SyncBatch(lease=1), now=T0)).leased
            assert _items(redis_client, stream) == []
            res = await a.sync(SyncBatch(ack=[lease], items=[(lease, '{"n": 1}'), (lease, '{"n": 2}')]),
                               now=T0 + 1)
            assert (res.items, res.items_refused, res.acks_refused) == (2, 0, 0)
        finally:
            await client.aclose()

    run(go())
    assert [json.loads(x)["n"] for x in _items(redis_client, stream)] == [1, 2]


@pytest.mark.parametrize("stream", [False, True], ids=["list", "stream"])
def test_a_zombie_gets_its_ack_and_items_refused(redis_url: str, redis_client: Any, stream: bool) -> None:
    """Worker a is stopped past its lease; b leases the page again and acks it with its items; a resumes
    and acks with its own: refused, counted, and the page's items are b's, once."""

    async def go() -> None:
        client, a, b = await _workers(redis_url, stream)
        try:
            await a.sync(SyncBatch(enqueue=[_entry(1)]), now=T0)
            (la, _), = (await a.sync(SyncBatch(lease=1), now=T0)).leased
            (lb, _), = (await b.sync(SyncBatch(lease=1), now=T0 + 11)).leased  # a's lease ran out
            res_b = await b.sync(SyncBatch(ack=[lb], items=[(lb, '"b"')]), now=T0 + 12)
            res_a = await a.sync(SyncBatch(ack=[la], items=[(la, '"a"')]), now=T0 + 13)
            assert (res_b.items, res_b.acks_refused) == (1, 0)
            assert (res_a.items, res_a.items_refused, res_a.acks_refused) == (0, 1, 1)
        finally:
            await client.aclose()

    run(go())
    assert _items(redis_client, stream) == ['"b"']


def test_a_zombie_whose_page_nobody_took_yet_still_acks_it(redis_url: str, redis_client: Any) -> None:
    """A lease that ran out but whose request still waits in the queue: the late ack takes it out of
    the queue, so that fetch counts, and its items land (once: nobody fetches it again)."""

    async def go() -> None:
        client, a, b = await _workers(redis_url, False)
        try:
            await a.sync(SyncBatch(enqueue=[_entry(1)]), now=T0)
            (la, _), = (await a.sync(SyncBatch(lease=1), now=T0)).leased
            await b.sync(SyncBatch(), now=T0 + 11)  # sweeps the expired lease back to the queue
            res = await a.sync(SyncBatch(ack=[la], items=[(la, '"a"')]), now=T0 + 12)
            assert (res.items, res.acks_refused) == (1, 0)
            assert (await b.sync(SyncBatch(lease=1), now=T0 + 13)).leased == []
        finally:
            await client.aclose()

    run(go())
    assert _items(redis_client, False) == ['"a"']


def test_a_call_sent_again_after_a_lost_answer_writes_its_items_once(
    redis_url: str, redis_client: Any
) -> None:
    async def go() -> None:
        client, a, _ = await _workers(redis_url, False)
        try:
            await a.sync(SyncBatch(enqueue=[_entry(1)]), now=T0)
            (la, _), = (await a.sync(SyncBatch(lease=1), now=T0)).leased
            batch = SyncBatch(ack=[la], items=[(la, '"x"'), (la, '"y"')])
            first = await a.sync(batch, now=T0 + 1)
            again = await a.sync(batch, now=T0 + 2)  # the timed-out call, retried
            assert (first.items, again.items, again.items_refused) == (2, 0, 2)
        finally:
            await client.aclose()

    run(go())
    assert _items(redis_client, False) == ['"x"', '"y"']


def test_twins_and_revisits_are_separate_fetches(redis_url: str, redis_client: Any) -> None:
    """Two unfiltered entries of one URL are two pages: both fetches' items land. A revisit's ack
    carries its items too."""

    async def go() -> None:
        client, a, _ = await _workers(redis_url, False)
        try:
            await a.sync(SyncBatch(enqueue=[_entry(1), _entry(1)]), now=T0)
            leased = (await a.sync(SyncBatch(lease=2), now=T0)).leased
            assert len(leased) == 2
            (l1, _), (l2, _) = leased
            res = await a.sync(SyncBatch(ack=[l1], revisit=[(l2, 60.0, b"")],
                                         items=[(l1, '"one"'), (l2, '"two"')]), now=T0 + 1)
            assert (res.items, res.acks_refused) == (2, 0)
        finally:
            await client.aclose()

    run(go())
    assert sorted(_items(redis_client, False)) == ['"one"', '"two"']


def test_items_key_of_another_type_is_moved_aside_not_half_written(redis_url: str, redis_client: Any) -> None:
    redis_client.set(ITEMS, "someone's string")

    async def go() -> None:
        client, a, _ = await _workers(redis_url, False)
        try:
            first = await a.sync(SyncBatch(enqueue=[_entry(1)]), now=T0)
            assert ITEMS in first.repaired  # checked before any write, whatever the call carries
            (la, _), = (await a.sync(SyncBatch(lease=1), now=T0)).leased
            res = await a.sync(SyncBatch(ack=[la], items=[(la, '"x"')]), now=T0 + 1)
            assert res.items == 1
        finally:
            await client.aclose()

    run(go())
    assert redis_client.get(f"{ITEMS}:garbage") == b"someone's string"
    assert _items(redis_client, False) == ['"x"']


LOCAL_SPIDER = '''
import scrapy


class LocalSpider(scrapy.Spider):
    """The seed's one link carries what the frontier cannot encode: this worker crawls it itself."""

    name = "local"

    def __init__(self, seed=None, **kw):
        super().__init__(**kw)
        self.seed = seed

    async def start(self):
        yield scrapy.Request(self.seed)
        yield {"from": "start"}

    def parse(self, response):
        yield {"url": response.url}
        if response.url == self.seed:
            yield response.follow(response.css("a::attr(href)").get(), meta={"handle": object()})
'''


@pytest.mark.slow
def test_items_of_requests_no_lease_covers_are_written_too(
    tmp_path: Any, site_factory: Any, redis_url: str, redis_client: Any
) -> None:
    from crawlproject import make_project

    site = site_factory(pages=5, links=1)
    project = make_project(tmp_path, {
        "REDIS_URL": redis_url, "ITEM_PIPELINES": {"scrapy_dist.pipelines.RedisPipeline": 300},
    }, spiders=LOCAL_SPIDER)
    try:
        project.crawl("local", args={"seed": site.page_url(0)})
        assert project.wait_all(timeout=60) == [0], project.logs()[-3000:]
    finally:
        project.stop_all()
    items = [json.loads(v) for v in redis_client.lrange("local:items", 0, -1)]
    assert {"from": "start"} in items
    assert len([i for i in items if "url" in i]) == 2  # the seed (leased) and its link (local)
    assert project.stats(0).get("redis_items/unbound") == 2
