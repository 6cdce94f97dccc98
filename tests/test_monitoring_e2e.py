"""End-to-end: real `scrapy crawl` workers with the monitoring extensions, checked through Redis and
`scrapy-dist status --json` -- stats that add up, a killed worker shown as lost, every worker closing
together when the crawl runs out of work, an error storm that pauses the crawl until `resume`, and the
add-on alone crawling across two workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import redis
from crawlproject import SPIDERS, make_project
from helpers import wait_for
from zygote import Zygote

from scrapy_dist.frontier.shard import lease_parts
from scrapy_dist.monitor import read_status
from scrapy_dist.redis.keys import CrawlKeys

pytestmark = pytest.mark.slow

LINKS = CrawlKeys("links")
EXTENSIONS = {
    "proj.stats_ext.DumpStats": 0,  # the project's own, for per-process stats
    "scrapy_dist.extensions.ClusterStats": 500,
    "scrapy_dist.extensions.IdleMonitor": 500,
    "scrapy_dist.extensions.ErrorMonitor": 500,
}


def cli(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-c", "from scrapy_dist.cli import main; main()", "--redis-url", redis_url, *args]
    env = {k: v for k, v in os.environ.items() if k != "SCRAPY_SETTINGS_MODULE"}  # no project here
    return Zygote.run_cli(cmd, timeout=60, env=env)


def status_json(redis_url: str, spider: str = "links") -> dict[str, Any]:
    out = cli(redis_url, "status", spider, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def worker_state_of(client: redis.Redis, pid: int) -> str | None:
    """The state ``scrapy-dist status`` gives the worker of process ``pid`` now."""
    return next((w["state"] for w in read_status(client, LINKS)["workers"] if w["pid"] == pid), None)


def test_stats_of_three_workers_add_up(tmp_path: Path, redis_url: str, site_factory: Any) -> None:
    site = site_factory(pages=400, delay=0.005)
    project = make_project(
        tmp_path, {"REDIS_URL": redis_url, "EXTENSIONS": EXTENSIONS, "CLUSTERSTATS_INTERVAL": 1}
    )
    for _ in range(3):
        project.crawl(args={"seed": site.page_url(0)})  # the same seed: deduplicated crawl-wide
    assert project.wait_all(90) == [0, 0, 0], project.logs()[-4000:]
    assert len(site.fetch_counts()) == 400

    merged = status_json(redis_url)
    stats = merged["stats"]
    per_worker = [project.stats(i) for i in range(3)]
    for name in ("response_received_count", "item_scraped_count", "downloader/request_count",
                 "scheduler/dequeued/redis"):
        assert stats[name] == sum(s.get(name, 0) for s in per_worker), name
    assert stats["response_received_count"] == 400 and stats["item_scraped_count"] == 400

    def when(text: str) -> datetime:
        return datetime.fromisoformat(text)

    assert when(stats["start_time"]) == min(when(s["start_time"]) for s in per_worker)
    assert when(stats["finish_time"]) == max(when(s["finish_time"]) for s in per_worker)
    assert stats["request_depth_max"] == max(s.get("request_depth_max", 0) for s in per_worker)
    # every worker is listed, closed, with its own page count
    workers = {w["pid"]: w for w in merged["workers"]}
    assert len(workers) == 3
    for i, (proc, _) in enumerate(project.procs):
        w = workers[proc.pid]
        assert w["state"] == "closed" and w["finish_reason"] == "finished"
        assert w["pages"] == per_worker[i].get("response_received_count", 0)
    assert merged["frontier"] == {"queued": 0, "inflight": 0, "delayed": 0}
    assert merged["filter"]["kind"] == "bloom" and merged["filter"]["items"] == 400


def test_a_killed_worker_shows_as_lost(tmp_path: Path, redis_url: str, site_factory: Any) -> None:
    site = site_factory(pages=3000, delay=0.2)
    project = make_project(
        tmp_path,
        {"REDIS_URL": redis_url, "EXTENSIONS": EXTENSIONS, "CLUSTERSTATS_INTERVAL": 1,
         "CONCURRENT_REQUESTS": 8, "SCHEDULER_LEASE_SECONDS": 30},
    )
    survivor = project.crawl(args={"seed": site.page_url(0)})
    victim = project.crawl(args={"seed": site.page_url(0)})
    client = redis.Redis.from_url(redis_url)
    wait_for(lambda: client.zcard(LINKS.workers) == 2, 30, "two workers")
    wait_for(lambda: any(
        f":{victim.pid}:".encode() in (lease_parts(k)[2] or b"")
        for k in client.zrange(LINKS.leases, 0, -1)), 30, "the victim to hold leases")
    project.kill(victim)
    # lost once unseen for three heartbeat intervals: read in-process until then, then through the CLI
    wait_for(lambda: worker_state_of(client, victim.pid) == "lost", 30, "the victim to show as lost")
    status = status_json(redis_url)
    by_pid = {w["pid"]: w for w in status["workers"]}
    assert by_pid[victim.pid]["state"] == "lost"
    assert by_pid[victim.pid]["leases"] > 0  # what the frontier requeues when the leases run out
    assert by_pid[survivor.pid]["state"] == "running"
    assert status["workers_summary"]["lost"] == 1 and status["workers_summary"]["running"] == 1
    survivor.terminate()
    survivor.wait(30)
    client.close()


WAITING_SPIDERS = SPIDERS + '''

import asyncio
import redis.asyncio


class WaitingSpider(scrapy.Spider):
    """Like a RedisSpider: start() takes seeds from <name>:start_urls and never ends."""

    name = "waiting"

    async def start(self):
        client = redis.asyncio.Redis.from_url(self.settings["REDIS_URL"])
        while True:
            url = await client.lpop("waiting:start_urls")
            if url:
                yield scrapy.Request(url.decode())
            else:
                await asyncio.sleep(0.1)

    def parse(self, response):
        yield {"url": response.url}
        for href in response.css("a::attr(href)").getall():
            yield response.follow(href)
'''


def test_workers_close_together_when_the_crawl_runs_out_of_work(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    first, second = site_factory(pages=200, delay=0.005), site_factory(pages=50, delay=0.005)
    project = make_project(
        tmp_path,
        {"REDIS_URL": redis_url, "EXTENSIONS": EXTENSIONS, "CLUSTERSTATS_INTERVAL": 1,
         "SCHEDULER_IDLE_BEFORE_CLOSE": 2.5},
        spiders=WAITING_SPIDERS,
    )
    client = redis.Redis.from_url(redis_url)
    for _ in range(3):
        project.crawl("waiting")
    wait_for(lambda: client.zcard(CrawlKeys("waiting").workers) == 3, 30, "three workers")
    client.rpush("waiting:start_urls", first.page_url(0))
    wait_for(lambda: len(first.fetch_counts()) == 200, 60, "the first site")
    # new seeds before SCHEDULER_IDLE_BEFORE_CLOSE has passed keep everyone running
    time.sleep(1.0)
    client.rpush("waiting:start_urls", second.page_url(0))
    assert project.wait_all(60) == [0, 0, 0], project.logs()[-4000:]
    assert len(second.fetch_counts()) == 50
    stats = [project.stats(i) for i in range(3)]
    assert [s["finish_reason"] for s in stats] == ["finished"] * 3
    finish = sorted(datetime.fromisoformat(s["finish_time"]) for s in stats)
    assert (finish[-1] - finish[0]).total_seconds() < 3, finish
    assert sum(s.get("response_received_count", 0) for s in stats) == 250
    client.close()


def test_an_error_storm_pauses_the_crawl_until_resume(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    site = site_factory(pages=150, delay=0.005)
    storm = {"on": True}
    respond = site.respond

    def stormy(path: str) -> tuple[int, bytes, float]:
        status, body, delay = respond(path)
        if storm["on"] and path.startswith("/page/") and int(path.rsplit("/", 1)[1]) >= 20:
            return 500, b"storm", 0.0
        return status, body, delay

    site.respond = stormy
    project = make_project(
        tmp_path,
        {"REDIS_URL": redis_url, "EXTENSIONS": EXTENSIONS, "CLUSTERSTATS_INTERVAL": 1,
         "ERRORMONITOR_MAX_ERRORS": 40, "ERRORMONITOR_WINDOW": 30, "ERRORMONITOR_ACTION": "pause",
         "RETRY_TIMES": 1000, "CONCURRENT_REQUESTS": 8, "SCHEDULER_IDLE_BEFORE_CLOSE": 1},
    )
    project.crawl(args={"seed": site.page_url(0)})
    project.crawl()
    client = redis.Redis.from_url(redis_url)
    wait_for(lambda: client.hget(LINKS.control, "paused") == b"1", 60, "the error monitor's pause")
    # every worker stops taking requests: once the requests in flight are answered, the site stays quiet
    # (for 1.5 s, while a worker that went on would send retries of the 500s without a pause)
    wait_for(lambda: time.monotonic() - site.log[-1][0] >= 1.5, 30, "the site to go quiet for 1.5 s")
    status = status_json(redis_url)
    assert status["state"] == "paused" and status["control"]["paused_by"] == "errormonitor"
    assert status["errors"]["reasons"].get("http/500", 0) > 40
    assert status["workers_summary"]["running"] == 2
    storm["on"] = False
    out = cli(redis_url, "resume", "links")
    assert out.returncode == 0 and "Resumed" in out.stdout
    assert project.wait_all(60) == [0, 0], project.logs()[-4000:]
    assert set(site.fetch_counts()) == {f"/page/{i}" for i in range(150)}  # nothing was given up
    assert "Error threshold passed for 'links'" in project.logs()
    assert [project.stats(i)["finish_reason"] for i in range(2)] == ["finished", "finished"]
    client.close()


def test_the_addon_alone_crawls_across_two_workers(tmp_path: Path, redis_url: str, site_factory: Any) -> None:
    site = site_factory(pages=300, delay=0.02)
    project = make_project(tmp_path)
    # nothing but the add-on and where Redis is
    project.settings = {"REDIS_URL": redis_url, "ADDONS": {"scrapy_dist.Addon": 0}}
    project.crawl(args={"seed": site.page_url(0)})
    project.crawl(args={"seed": site.page_url(0)})  # the same seed: deduplicated crawl-wide
    assert project.wait_all(90) == [0, 0], project.logs()[-4000:]
    counts = site.fetch_counts()
    assert len(counts) == 300 and max(counts.values()) == 1
    pages = [project.stats(i).get("response_received_count", 0) for i in range(2)]
    assert sum(pages) == 300 and min(pages) > 0, pages
    log = project.logs()
    assert "scrapy_dist.scheduler.Scheduler" in log and "ClusterStats" in log
    status = status_json(redis_url)
    assert status["stats"]["response_received_count"] == 300
    assert status["workers_summary"]["closed"] == 2
