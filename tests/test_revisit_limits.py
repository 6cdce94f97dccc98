"""Revisit chains a writer of Redis cannot make endless: ``revisit_after`` from seeds and untrusted
entries is refused unless allowed, every revisit waits at least ``REVISIT_MIN_INTERVAL``, and
``scrapy-dist forget URL`` and ``scrapy-dist close SPIDER`` end chains -- against a real Redis."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, cast

import msgpack
import pytest
import redis
from click.testing import CliRunner
from crawlproject import make_project
from helpers import open_bloom_scheduler, run, wait_for
from scrapy import Request

from scrapy_dist.cli import main
from scrapy_dist.exceptions import RejectedEntry
from scrapy_dist.frontier.scheduler import Scheduler
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.seeds import SeedRules, parse_seed
from scrapy_dist.settings import DistSettings, SettingsError

SECRET = "revisit-secret"


async def _opened(redis_url: str, name: str, **settings: Any) -> Scheduler:
    sched = await open_bloom_scheduler(
        redis_url, name, {"allowed_domains": ["site.test"]}, SCHEDULER_ENTRY_SECRET=SECRET, **settings
    )
    return cast("Scheduler", sched)


async def _fetch_all(sched: Scheduler, rounds: int = 3) -> list[Request]:
    """Hand out what the frontier leases for a few rounds, every request fetched successfully."""
    assert sched.loop is not None and sched.revisits is not None
    out = []
    for _ in range(rounds):
        sched.loop.collect_finished(time.monotonic())
        await sched.loop.round(lease=10, renew=False)
        while (request := sched.next_request()) is not None:
            sched.revisits.outcome[request] = True  # as response_received records a successful fetch
            out.append(request)
    return out


def _revisits(client: redis.Redis, keys: CrawlKeys) -> list[tuple[bytes, float]]:
    return [(m, s) for m, s in client.zrange(keys.delayed, 0, -1, withscores=True)
            if (client.hget(keys.delayed_meta, m) or b"").endswith(b" r")]


def test_seeds_may_not_ask_for_revisits_unless_allowed() -> None:
    seed = json.dumps({"url": "http://site.test/", "meta": {"revisit_after": 0.001}}).encode()
    with pytest.raises(RejectedEntry, match="revisit_after"):
        parse_seed(seed)
    assert parse_seed(seed, SeedRules(meta_allowed=("*", "revisit_after"))).meta == {"revisit_after": 0.001}


def test_an_unsigned_queue_entry_asking_for_revisits_is_refused(redis_url: str) -> None:
    keys = CrawlKeys("unsigned")
    client = redis.Redis.from_url(redis_url)
    entry = b"\x01" + msgpack.packb({"u": "http://site.test/x", "M": {"revisit_after": 0.001}})
    client.zadd(keys.queue, {(1).to_bytes(6, "big") + entry: 0})

    async def go() -> list[Request]:
        sched = await _opened(redis_url, "unsigned")
        got = await _fetch_all(sched)
        await sched.redis.aclose()
        return got

    assert run(go()) == []
    reasons = [json.loads(r)["reason"] for r in client.lrange(keys.queue_rejected, 0, -1)]
    assert reasons == ["meta_not_allowed"]
    assert client.zcard(keys.delayed) == 0


def test_a_revisit_waits_at_least_the_floor(redis_url: str) -> None:
    keys = CrawlKeys("floor")
    client = redis.Redis.from_url(redis_url)

    async def go() -> None:
        sched = await _opened(redis_url, "floor")
        sched.enqueue_request(Request("http://site.test/p", meta={"revisit_after": 0.001}))
        await _fetch_all(sched)
        await sched.redis.aclose()

    run(go())
    ((_, due),) = _revisits(client, keys)
    assert due >= time.time() + 299  # REVISIT_MIN_INTERVAL: 300 s by default


def test_revisit_rules_below_the_floor_are_refused_in_one_line() -> None:
    with pytest.raises(SettingsError) as err:
        DistSettings.from_settings({"REVISIT_AFTER": {"*": 60}})
    assert "REVISIT_MIN_INTERVAL" in str(err.value) and "\n" not in str(err.value)
    assert DistSettings.from_settings({"REVISIT_AFTER": {"*": 60}, "REVISIT_MIN_INTERVAL": 60})


@pytest.mark.parametrize("command", ["forget", "close"])
def test_forget_and_close_end_revisit_chains(redis_url: str, command: str) -> None:
    keys = CrawlKeys("chains")
    client = redis.Redis.from_url(redis_url)

    async def go() -> None:
        sched = await _opened(redis_url, "chains")
        for path in ("a", "b"):
            sched.enqueue_request(Request(f"http://site.test/{path}", meta={"revisit_after": 3600}))
        await _fetch_all(sched)
        await sched.redis.aclose()

    run(go())
    assert len(_revisits(client, keys)) == 2
    args = ["forget", "chains", "http://site.test/a"] if command == "forget" else ["close", "chains"]
    result = CliRunner().invoke(main, ["--redis-url", redis_url, *args])
    assert result.exit_code == 0, result.output
    left = _revisits(client, keys)
    assert len(left) == (1 if command == "forget" else 0)
    assert "revisit" in result.output
    assert int(client.hget(keys.delayed_meta, "revisits") or 0) == len(left)


def test_a_worker_closing_by_decision_files_no_more_revisits(redis_url: str) -> None:
    keys = CrawlKeys("closing")
    client = redis.Redis.from_url(redis_url)

    async def go() -> None:
        sched = await _opened(redis_url, "closing")
        assert sched.revisits is not None
        sched.enqueue_request(Request("http://site.test/c", meta={"revisit_after": 3600}))
        await _fetch_all(sched, rounds=1)
        sched.revisits.stop()  # what the idle monitor does when it sees `scrapy-dist close`
        await _fetch_all(sched, rounds=2)
        await sched.redis.aclose()

    run(go())
    assert _revisits(client, keys) == []


@pytest.mark.slow
def test_close_leaves_no_chain_behind_a_running_crawl(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    pages = 6
    site = site_factory(pages=pages, links=2, delay=0.1)
    project = make_project(tmp_path, {
        "REDIS_URL": redis_url, "ADDONS": {"scrapy_dist.Addon": 0}, "SCHEDULER_DENY_NETWORKS": [],
        "CONCURRENT_REQUESTS": 4, "REVISIT_AFTER": {"*": 0.5},
        "REVISIT_MIN_INTERVAL": 0.1, "SCHEDULER_IDLE_POLL": 0.1, "SCHEDULER_IDLE_BEFORE_CLOSE": "none",
    })
    project.crawl(args={"seed": site.page_url(0)})
    wait_for(lambda: len(site.fetch_counts()) == pages and max(site.fetch_counts().values()) >= 3, 60,
             "every page fetched, and revisits running")
    result = CliRunner().invoke(main, ["--redis-url", redis_url, "close", "links"])
    assert result.exit_code == 0, result.output
    assert project.wait_all(60) == [0], project.logs()[-3000:]
    assert _revisits(redis.Redis.from_url(redis_url), CrawlKeys("links")) == []
