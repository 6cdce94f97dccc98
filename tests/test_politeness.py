"""Crawl-wide politeness: per-domain delay and concurrency enforced by the frontier across workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from crawlproject import Project, make_project

from scrapy_dist.demo.site import SiteGraph, SiteServer
from scrapy_dist.frontier.orders import DomainLimit, DomainLimits


def test_most_specific_rule_wins() -> None:
    limits = DomainLimits(
        DomainLimit(0.0, 8, 0.0),
        {"*.example.com": {"delay": 1.0}, "api.example.com": {"concurrency": 1}, "*.com": {"delay": 9}},
    )
    assert limits.for_domain("www.example.com") == DomainLimit(1.0, 8, 0.0)
    assert limits.for_domain("api.example.com") == DomainLimit(0.0, 1, 0.0)  # exact beats glob
    assert limits.for_domain("other.com") == DomainLimit(9.0, 8, 0.0)
    assert limits.for_domain("example.org") == DomainLimit(0.0, 8, 0.0)
    assert DomainLimit(0.2, 1, 0.5).encode() == "0.2 1 0.5"
    # the frontier clamps limits read from Redis to the largest delay and jitter any domain has here
    assert limits.bound() == "9.0 0.0"
    assert DomainLimits(DomainLimit(0.5, 2, 0.25), {"a.com": {"jitter": 2}}).bound() == "0.5 2.0"


def _start(tmp_path: Path, redis_url: str, seeds: list[str], settings: dict[str, Any]) -> Project:
    """A crawl's first worker, with the seeds (start the other two with :func:`_more_workers`)."""
    project = make_project(
        tmp_path,
        {"REDIS_URL": redis_url, "CONCURRENT_REQUESTS": 16, "SCHEDULER_IDLE_BEFORE_CLOSE": 2, **settings},
    )
    project.crawl(args={"seeds": ",".join(seeds)})
    return project


def _more_workers(project: Project) -> None:
    """Two more workers, once the first has opened the frontier."""
    project.wait_until_open(30)
    project.crawl()
    project.crawl()


def _finish(project: Project) -> None:
    assert project.wait_all(120) == [0, 0, 0], project.logs()[-4000:]


def _crawl(tmp_path: Path, redis_url: str, seeds: list[str], settings: dict[str, Any]) -> None:
    project = _start(tmp_path, redis_url, seeds, settings)
    _more_workers(project)
    _finish(project)


def _rate(server: SiteServer) -> float:
    """Requests per second over the middle 80% of the crawl (workers start one after another)."""
    times = sorted(t for t, _, _ in server.log)
    lo, hi = len(times) // 10, len(times) - len(times) // 10 - 1
    return (hi - lo) / (times[hi] - times[lo])


@pytest.mark.slow
def test_limited_host_is_polite_crawl_wide_while_the_other_runs_full_speed(
    tmp_path: Path, redis_url: str, other_redis_url: str
) -> None:
    limited = SiteServer(SiteGraph(25, links=3), host="127.0.0.2").start()
    free = SiteServer(SiteGraph(300, links=10), host="127.0.0.3", delay=0.005).start()
    alone = SiteServer(SiteGraph(300, links=10), host="127.0.0.4", delay=0.005).start()
    try:
        polite = {
            "SCHEDULER_POLITENESS": "cluster",
            "CONCURRENT_REQUESTS_PER_DOMAIN": 48,  # no crawl-wide cap for the free host
            "DOMAIN_LIMITS": {"127.0.0.2": {"delay": 0.2, "concurrency": 1}},
        }
        # the two crawls run side by side, so that whatever else loads the machine slows both alike
        crawls = [
            _start(tmp_path / "both", redis_url, [limited.page_url(0), free.page_url(0)], polite),
            _start(tmp_path / "alone", other_redis_url, [alone.page_url(0)], polite),
        ]
        for project in crawls:
            _more_workers(project)
        for project in crawls:
            _finish(project)
    finally:
        for s in (limited, free, alone):
            s.stop()
    assert len(limited.fetch_counts()) == 25 and len(free.fetch_counts()) == 300
    starts = sorted(t for t, _, _ in limited.log)
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert min(gaps) >= 0.2, f"two requests to the limited host {min(gaps):.3f}s apart"
    # the unlimited host is crawled about as fast with the limited one in the crawl as without it (a crawl
    # of its own, run at the same time, so both share the machine's load): head-of-line blocking behind
    # the limited host would hold the free host to one request per 0.2 s (benchmarks/politeness.py
    # measures the real figure)
    assert _rate(free) >= 0.25 * _rate(alone), (_rate(free), _rate(alone))


@pytest.mark.slow
def test_process_politeness_is_per_worker(tmp_path: Path, redis_url: str) -> None:
    """The contrast: Scrapy's per-process slot settings let three workers hit the host three times as hard."""
    # 60 pages at 0.2 s each keep the first worker busy for ~12 s, long after the other two have started;
    # a small prefetch lets each of them lease its share instead of the first worker buffering it all
    limited = SiteServer(SiteGraph(60, links=3), host="127.0.0.2").start()
    try:
        _crawl(
            tmp_path,
            redis_url,
            [limited.page_url(0)],
            {
                "DOWNLOAD_SLOTS": {"127.0.0.2": {"delay": 0.2, "concurrency": 1, "jitter": 0}},
                "SCHEDULER_PREFETCH": 2,
            },
        )
    finally:
        limited.stop()
    starts = sorted(t for t, _, _ in limited.log)
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert len(limited.fetch_counts()) == 60
    assert min(gaps) < 0.2  # the per-process limit does not hold crawl-wide


def test_status_shows_busiest_domains_with_limits_and_backlog(redis_url: str, redis_client: Any) -> None:
    import asyncio
    import json

    import redis.asyncio
    from click.testing import CliRunner

    from scrapy_dist.cli import main
    from scrapy_dist.frontier.shard import Frontier, SyncBatch
    from scrapy_dist.redis.keys import CrawlKeys
    from scrapy_dist.settings import SchedulerSettings

    keys = CrawlKeys("polite")

    async def fill() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        f = Frontier(client, keys, "w", None, SchedulerSettings(politeness="cluster"))
        entries = [("", "", 0, b"\x01x%d" % i, "slow.test", "1.0 2 0.0") for i in range(5)]
        entries += [("", "", 0, b"\x01y%d" % i, "fast.test", "0.0 0 0.0") for i in range(2)]
        await f.sync(SyncBatch(enqueue=entries))
        await f.sync(SyncBatch(lease=10))
        await client.aclose()

    asyncio.run(fill())
    result = CliRunner().invoke(main, ["--redis-url", redis_url, "status", "polite", "--json"])
    assert result.exit_code == 0, result.output
    domains = {d["domain"]: d for d in json.loads(result.output)["domains"]}
    # one request of the delayed domain was leased (one per delay), both of the free one
    assert domains["slow.test"]["backlog"] == 4 and domains["slow.test"]["in_flight"] == 1
    assert domains["slow.test"]["delay"] == 1.0 and domains["slow.test"]["concurrency"] == 2
    assert 0 < domains["slow.test"]["next_in"] <= 1.0
    assert domains["fast.test"]["backlog"] == 0 and domains["fast.test"]["in_flight"] == 2
    table = CliRunner().invoke(main, ["--redis-url", redis_url, "status", "polite"])
    assert "Busiest domains" in table.output and "slow.test" in table.output


@pytest.mark.slow
def test_a_worker_in_another_politeness_mode_is_refused(
    tmp_path: Path, redis_url: str, redis_client: Any, site_factory: Any
) -> None:
    from scrapy_dist.redis.keys import CrawlKeys

    redis_client.hset(CrawlKeys("links").control, "politeness", "cluster")
    site = site_factory(pages=5)
    project = make_project(tmp_path, {"REDIS_URL": redis_url})  # process mode, the default
    project.crawl(args={"seed": site.page_url(0)})
    assert project.wait_all(60) == [1]
    errors = [line for line in project.logs().splitlines() if " ERROR: " in line]
    assert len(errors) == 1 and "SCHEDULER_POLITENESS='cluster'" in errors[0], errors
    assert site.fetch_counts() == {}


def _frontier_calls(redis_url: str, calls: list[tuple[Any, float]], **kw: Any) -> list[Any]:
    """Polite sync calls of one worker, each ``(batch, now)``: their results."""
    import asyncio

    import redis.asyncio

    from scrapy_dist.frontier.shard import Frontier
    from scrapy_dist.redis.keys import CrawlKeys
    from scrapy_dist.settings import SchedulerSettings

    async def go() -> list[Any]:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            f = Frontier(client, CrawlKeys("sched"), "w", None, SchedulerSettings(politeness="cluster"), **kw)
            return [await f.sync(batch, now=now) for batch, now in calls]
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_queuing_reads_no_domain_state_and_a_waiting_domain_keeps_its_time(
    redis_url: str, redis_client: Any
) -> None:
    """Requests of a domain with the worker's default limits are queued with one ZADD NX on the schedule
    and no field of the domain; a domain leased with a delay stays scheduled at its next allowed time when
    nothing of it is left, so a request queued then waits for that time instead of going out at once."""
    from scrapy_dist.frontier.shard import SyncBatch
    from scrapy_dist.redis.keys import CrawlKeys

    keys = CrawlKeys("sched")
    t = 1_700_000_000.0
    entry = lambda i: ("", "", 0, b"\x01a%d" % i, "a.test", "5.0 2 0.0")  # noqa: E731
    _frontier_calls(redis_url, [(SyncBatch(enqueue=[entry(0)]), t)], limits_default="5.0 2 0.0")
    assert redis_client.exists(keys.domain_info) == 0  # queuing wrote no field of the domain
    assert redis_client.zscore(keys.domains, "a.test") == t  # scheduled at the time it was queued
    (second,) = _frontier_calls(redis_url, [(SyncBatch(lease=5), t)], limits_default="5.0 2 0.0")
    assert len(second.leased) == 1
    assert redis_client.hget(keys.domain_info, "p:a.test") == b"1 1700000005"  # no limits: the default's
    assert redis_client.zscore(keys.domains, "a.test") == t + 5  # waiting, nothing queued: kept
    (held, _), = second.leased
    results = _frontier_calls(redis_url, [
        (SyncBatch(ack=[held]), t + 1),  # finished: the delay runs from here
        (SyncBatch(enqueue=[entry(1)], lease=5), t + 2),
        (SyncBatch(lease=5), t + 5.5),
        (SyncBatch(lease=5), t + 6.5),
    ], limits_default="5.0 2 0.0")
    assert [len(r.leased) for r in results[1:]] == [0, 0, 1]
    assert redis_client.zscore(keys.domains, "a.test") == t + 6.5 + 5


def test_due_domains_are_served_longest_waiting_first_and_a_served_one_goes_to_the_back(
    redis_url: str, redis_client: Any
) -> None:
    """Due domains are leased from in the order they have waited, not by name: a domain queued first is
    served first, and one served with requests left waits behind the others due then, so no domain starves
    however many others keep arriving."""
    from scrapy_dist.frontier.shard import SyncBatch

    t = 1_700_000_000.0
    entry = lambda d, i: ("", "", 0, b"\x01%s%d" % (d, i), d.decode(), "0.0 8 0.0")  # noqa: E731
    results = _frontier_calls(redis_url, [
        (SyncBatch(enqueue=[entry(b"z.test", 0), entry(b"z.test", 1)]), t),
        (SyncBatch(enqueue=[entry(b"a.test", 0)]), t + 1),
        (SyncBatch(lease=1), t + 2),
        (SyncBatch(enqueue=[entry(b"b.test", 0)]), t + 3),
        (SyncBatch(lease=1), t + 4),
        (SyncBatch(lease=1), t + 5),
        (SyncBatch(lease=1), t + 6),
    ], limits_default="0.0 8 0.0")
    served = [bytes(key).split(b"\0", 1)[0] for r in results[2:] for key, _ in r.leased]
    assert served == [b"z.test", b"a.test", b"z.test", b"b.test"]


def test_a_new_crawls_domain_info_is_a_hash_table_from_its_first_field(
    redis_url: str, redis_client: Any
) -> None:
    """A small HASH is a listpack whose every HGET and HSET scans it: the first call that writes a domain's
    field also writes a 'hashtable' field too long for a listpack, so the HASH is a hash table at once, and
    `status` lists only the domains."""
    from scrapy_dist.frontier.orders import busiest_domains
    from scrapy_dist.frontier.shard import SyncBatch
    from scrapy_dist.redis.keys import CrawlKeys

    keys = CrawlKeys("sched")
    entries = [("", "", 0, b"\x01%s" % d, d.decode(), "0.0 8 0.0") for d in (b"a.test", b"b.test")]
    (result,) = _frontier_calls(redis_url, [(SyncBatch(enqueue=entries, lease=1), None)],
                                limits_default="0.0 8 0.0")
    assert len(result.leased) == 1
    assert redis_client.hget(keys.domain_info, "layout") == b"p"
    assert len(redis_client.hget(keys.domain_info, "hashtable")) > 64
    assert redis_client.object("encoding", keys.domain_info) == b"hashtable"
    rows = busiest_domains(redis_client, keys, 0.0)
    assert sorted(row["domain"] for row in rows) == ["a.test", "b.test"]


def test_garbage_in_the_domain_fields_hides_only_its_own_row(redis_url: str, redis_client: Any) -> None:
    """Whatever a third party writes in the control hash's limits or a domain's field, `status` still lists
    the other domains."""
    from scrapy_dist.frontier.orders import busiest_domains
    from scrapy_dist.frontier.shard import SyncBatch
    from scrapy_dist.redis.keys import CrawlKeys

    keys = CrawlKeys("sched")
    domains = (b"a.test", b"b.test", b"c.test")
    entries = [("", "", 0, b"\x01%s%d" % (d, i), d.decode(), "") for d in domains for i in range(2)]
    _frontier_calls(redis_url, [(SyncBatch(enqueue=entries, lease=3), None)], limits_default="0.5 2 0.0")
    fields = {k.decode(): v for k, v in redis_client.hgetall(keys.domain_info).items()}
    assert {"p:a.test", "p:b.test", "p:c.test"} <= set(fields)
    redis_client.hset(keys.domain_info, "p:a.test", "2 0")  # no limits of its own: the crawl's default
    redis_client.hset(keys.domain_info, "p:b.test", "1 0 1e400 2 0")  # its own limits, garbage
    redis_client.hset(keys.domain_info, "p:c.test", "inf 0")  # its slots and time, garbage
    for garbage in ("nan 2 0", "1 x 0", "1e400 1 1", "0 2 -inf", "1 2", "1 2 3 4", ""):
        redis_client.hset(keys.control, "limits", garbage)
        rows = busiest_domains(redis_client, keys, 0.0)
        assert [row["domain"] for row in rows] == ["a.test"], garbage
        assert rows[0]["concurrency"] == 0 and rows[0]["in_flight"] == 2  # the default limits: garbage too
    redis_client.hset(keys.control, "limits", "0.5 2 0.0")
    rows = busiest_domains(redis_client, keys, 0.0)
    assert [(row["domain"], row["concurrency"]) for row in rows] == [("a.test", 2)]


def test_a_due_domain_leaves_the_schedule_when_its_last_request_is_leased(
    redis_url: str, redis_client: Any
) -> None:
    from scrapy_dist.frontier.shard import SyncBatch
    from scrapy_dist.redis.keys import CrawlKeys

    keys = CrawlKeys("sched")
    entries = [("", "", 0, b"\x01%s%d" % (d, i), d.decode(), "0.0 8 0.0") for d in (b"a.test", b"b.test")
               for i in range(3)]
    _, leased = _frontier_calls(redis_url, [(SyncBatch(enqueue=entries), None), (SyncBatch(lease=4), None)],
                                limits_default="0.0 8 0.0")
    assert len(leased.leased) == 4
    # the first domain's three and one of the second: only the second is left to schedule
    assert redis_client.zrange(keys.domains, 0, -1) == [b"b.test"]
    assert redis_client.hget(keys.domain_info, "p:a.test") == b"3 0"
    # one that someone took out of the schedule is found again by the calls' checks
    redis_client.zrem(keys.domains, "b.test")
    results = _frontier_calls(redis_url, [(SyncBatch(lease=4), None)] * 8, limits_default="0.0 8 0.0")
    assert sum(len(r.leased) for r in results) == 2
