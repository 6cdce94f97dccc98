"""Status that tells the truth: a new run after a finished one is running, not
``closing (finished)``; a paused crawl shows its prefetched leases as held, not in flight; piped output is
not cut to 80 columns; no empty tables; thousands separators. Workers are real ``scrapy crawl`` processes,
the CLI the real ``scrapy-dist`` entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import redis
from crawlproject import make_project
from helpers import wait_for, wait_for_pages
from zygote import Zygote

from scrapy_dist.frontier.layout import ControlState
from scrapy_dist.monitor import crawl_state
from scrapy_dist.redis import scripts
from scrapy_dist.redis.keys import CrawlKeys

SCRAPY_DIST = str(Path(sys.executable).with_name("scrapy-dist"))
KEYS = CrawlKeys("links")


def cli(cwd: Path, redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "SCRAPY_SETTINGS_MODULE"}
    env["REDIS_URL"] = redis_url
    return Zygote.run_cli([SCRAPY_DIST, *args], cwd=cwd, env=env, timeout=60)


def status_json(cwd: Path, redis_url: str) -> dict[str, Any]:
    res = cli(cwd, redis_url, "status", "links", "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)  # type: ignore[no-any-return]


def test_a_close_decided_before_the_running_workers_started_is_not_theirs() -> None:
    old = ControlState(close="finished", close_at=100.0)
    assert crawl_state(old, running=1, started=[200.0], now=300.0) == "running"
    assert crawl_state(old, running=2, started=[50.0, 200.0], now=300.0) == "closing (finished)"
    assert crawl_state(old, running=0, started=[], now=300.0) == "closed (finished)"


def test_new_run_after_a_finished_one_and_a_paused_crawl(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis, site_factory: Any
) -> None:
    site = site_factory(pages=400)
    # the previous run of this crawl finished: its close decision stays in the control hash
    sec, _ = redis_client.time()
    redis_client.hset(KEYS.control, mapping={"close": "finished", "close_at": str(int(sec) - 60)})
    project = make_project(tmp_path, {
        "REDIS_URL": redis_url, "ADDONS": {"scrapy_dist.Addon": 0}, "CLUSTERSTATS_INTERVAL": 0.5,
        "SCHEDULER_IDLE_BEFORE_CLOSE": 60, "DOWNLOAD_DELAY": 0.05, "CONCURRENT_REQUESTS": 8,
    })
    try:
        project.crawl(args={"seed": site.page_url(0)})
        wait_for_pages(site, 10)
        wait_for(lambda: status_json(tmp_path, redis_url)["workers_summary"]["running"] == 1, 30,
                 "the worker's heartbeat")
        assert status_json(tmp_path, redis_url)["state"] == "running"  # was: closing (finished)

        paused = cli(tmp_path, redis_url, "pause", "links")
        assert paused.returncode == 0, paused.stderr

        def settled() -> bool:
            s = status_json(tmp_path, redis_url)
            return s["leases"]["in_flight"] == 0 and (s["leases"]["prefetched"] or 0) > 0

        wait_for(settled, 30, "the paused worker to hold only prefetched leases", interval=0.3)
        s = status_json(tmp_path, redis_url)
        assert s["state"] == "paused" and s["frontier"]["inflight"] == s["leases"]["prefetched"]
        text = cli(tmp_path, redis_url, "status", "links").stdout
        in_flight = next(line for line in text.splitlines() if line.strip().startswith("In flight"))
        assert in_flight.split()[2] == "0", text  # was: every lease, "In flight 16", forever
        assert f"{s['leases']['prefetched']:,} prefetched (paused: held, not crawled)" in text
        assert project.procs[0][0].poll() is None
    finally:
        project.stop_all()


def heartbeat(client: redis.Redis, worker: str, seq: int, fields: dict[str, str], final: bool) -> None:
    script = scripts.register(client, "clusterstats")
    args: list[Any] = [worker, seq, 3600, "1" if final else "0", len(fields)]
    for k, v in fields.items():
        args += [k, v]
    script(keys=[KEYS.stats, KEYS.workers, KEYS.worker(worker)], args=args)


def test_piped_output_is_full_width_with_separators_and_no_empty_tables(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    empty = cli(tmp_path, redis_url, "status", "links").stdout
    assert "Workers: none yet" in empty and "┏" not in empty  # no empty workers table
    dead = cli(tmp_path, redis_url, "dead", "links")
    assert dead.stdout.strip() == "0 dead letters in 'links:deadletter'" or "┏" not in dead.stdout
    assert "┏" not in dead.stdout

    worker = "a-rather-long-host-name.example.internal:123456:0123456789abcdef"
    info = {"interval": "10.0", "state": "running", "pages": "1234567", "items": "7654321", "errors": "0",
            "pages_per_min": "0", "host": "h", "pid": "123456", "started": "1.0"}
    heartbeat(redis_client, worker, 1, info, final=False)
    heartbeat(redis_client, worker, 2, {**info, "state": "closed", "finish_reason": "finished"}, final=True)
    redis_client.rpush(KEYS.deadletter, *[json.dumps({"url": f"http://a.example/{'x' * 150}/{i}",
                                                      "reason": "DownloadTimeoutError", "attempts": 3,
                                                      "worker": worker, "at": 1.0}) for i in range(1200)])
    out = cli(tmp_path, redis_url, "status", "links").stdout
    assert "closed (finished)" in out and worker in out and "…" not in out, out
    assert "1,234,567" in out and "7,654,321" in out and "1,200" in out
    dead = cli(tmp_path, redis_url, "dead", "links", "--limit", "1100").stdout
    assert "…" not in dead and f"http://a.example/{'x' * 150}/1199" in dead
    assert "1,200 dead letters (showing the last 1,100" in dead and "1,199" in dead
