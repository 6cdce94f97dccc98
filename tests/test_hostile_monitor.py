"""The monitoring tools read Redis that anyone may have written: whatever it holds, ``/metrics``, the
dashboard's endpoints and ``scrapy-dist status`` answer (HTTP 200, exit 0) with an answer of bounded size,
and skipped values are counted where the operator sees them. The dashboard answers only to the host names
it is reached by legitimately (a rebound DNS name in the operator's browser gets nothing)."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
import redis
from aiohttp import ClientSession
from helpers import run
from prometheus_client.parser import text_string_to_metric_families
from zygote import Zygote

from scrapy_dist.monitor.dashboard import Dashboard, DashboardThread
from scrapy_dist.monitor.metrics import CrawlCollector, serve
from scrapy_dist.redis.keys import CrawlKeys

CLI = [sys.executable, "-c", "from scrapy_dist.cli import main; main()"]  # the scrapy-dist command

SITE, OTHER = CrawlKeys("site"), CrawlKeys("other")
#: What a scrape, an API answer or a status document may weigh whatever Redis holds.
BOUND = 1_000_000


def scrape(collector: CrawlCollector) -> tuple[int, str]:
    server = serve(collector, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=30) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, ""
    finally:
        server.shutdown()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def fake_workers(client: redis.Redis, keys: CrawlKeys, n: int, id_bytes: int, history: bool = False) -> None:
    """``n`` workers nobody started: long ids, heartbeat hashes with long texts, history samples."""
    now = time.time()
    wids = [f"{i:06d}:" + "h" * max(0, id_bytes - 7) for i in range(n)]
    p = client.pipeline(transaction=False)
    for i, wid in enumerate(wids):
        p.zadd(keys.workers, {wid: now})
        p.hset(keys.worker(wid), mapping={"host": "x" * 5000, "pages": str(i), "state": "running",
                                          "finish_reason": "r" * 5000, "interval": "5.0"})
        if i % 500 == 499:
            p.execute()
    p.execute()
    if history:  # two samples per worker, 30 s apart: one chart series each
        for ago, pages in ((50, 0), (20, 10)):
            ms = int((now - ago) * 1000)
            for i, wid in enumerate(wids):
                p.xadd(keys.history, {"w": wid, "p": str(pages + i), "e": "0", "q": "1"}, id=f"{ms}-{i}")
            p.execute()


def test_metrics_survive_huge_and_non_finite_stats(redis_client: redis.Redis) -> None:
    # two exception types of one name: one reason, whose sum overflows a float
    for field in ("downloader/exception_type_count/x", "downloader/exception_type_count/twisted.x"):
        redis_client.hset(SITE.stats, field, "1e308")
    redis_client.hset(SITE.stats, mapping={"response_received_count": "inf", "item_scraped_count": "nan",
                                           "scheduler/enqueued": "-1e400", "log_count/ERROR": "3",
                                           "spider_exceptions/ValueError": "1e30"})
    redis_client.hset(OTHER.stats, "response_received_count", "12")
    collector = CrawlCollector(redis_client, ["site", "other"], cache_seconds=0)
    status, text = scrape(collector)
    assert status == 200
    found = samples(text)
    assert found[("scrapy_dist_up", (("spider", "other"),))] == 1
    assert found[("scrapy_dist_up", (("spider", "site"),))] == 1
    assert found[("scrapy_dist_pages_total", (("spider", "other"),))] == 12
    assert found[("scrapy_dist_log_errors_total", (("spider", "site"),))] == 3
    assert ("scrapy_dist_pages_total", (("spider", "site"),)) not in found
    # the six values out of range are skipped, and said so
    assert found[("scrapy_dist_skipped_values", (("spider", "site"),))] == 6
    assert found[("scrapy_dist_skipped_values", (("spider", "other"),))] == 0


def test_metrics_of_workers_with_huge_ids_stay_small(redis_client: redis.Redis) -> None:
    fake_workers(redis_client, SITE, 200, 100_000)
    redis_client.hset(SITE.domain_info, mapping={f"b:{'d' * 100_000}{i}": "5" for i in range(20)})
    status, text = scrape(CrawlCollector(redis_client, ["site"], cache_seconds=0))
    assert status == 200 and len(text) < BOUND, len(text)
    workers = {dict(labels)["worker"] for (name, labels) in samples(text)
               if name == "scrapy_dist_worker_up"}
    assert len(workers) == 200 and max(map(len, workers)) <= 120  # truncated, still one label each


async def _get(url: str, host: str | None = None) -> tuple[int, bytes]:
    headers = {"Host": host} if host else {}
    async with ClientSession() as session, session.get(url, headers=headers) as reply:
        return reply.status, await reply.read()


@pytest.fixture
def dashboard(redis_url: str) -> Any:
    server = DashboardThread(Dashboard(redis.Redis.from_url(redis_url), SITE, cache_seconds=0))
    yield server
    server.close()


def test_dashboard_answers_stay_small_with_ten_thousand_fake_workers(
    redis_client: redis.Redis, dashboard: Any
) -> None:
    fake_workers(redis_client, SITE, 10_000, 300, history=True)
    redis_client.hset(SITE.errors, mapping={"_bucket": "10", "_window": "600",
                                            **{f"{int(time.time() // 10)}|r:{i}{'e' * 500}": "1"
                                               for i in range(5000)}})
    for path in ("api/status", "api/history"):
        status, body = run(_get(dashboard.url + path))
        assert status == 200 and len(body) < BOUND, (path, len(body))
    history = json.loads(run(_get(dashboard.url + "api/history"))[1])
    assert 0 < len(history["workers"]) <= 21  # the busiest, the rest summed as "other"
    assert "other" in history["workers"]
    doc = json.loads(run(_get(dashboard.url + "api/status"))[1])
    assert len(doc["errors"]["reasons"]) <= 21


def test_status_json_stays_small_on_hostile_contents(redis_client: redis.Redis, redis_url: str,
                                                     tmp_path: Any) -> None:
    fake_workers(redis_client, SITE, 300, 100_000)
    redis_client.hset(SITE.stats, mapping={f"junk/{i}/{'s' * 1000}": "v" * 10_000 for i in range(3000)})
    redis_client.hset(SITE.stats, mapping={"response_received_count": "7", "nan_stat": "nan",
                                           "huge": "1e308"})
    env = {k: v for k, v in os.environ.items() if k != "SCRAPY_SETTINGS_MODULE"}
    for args in (["--json"], []):
        out = Zygote.run_cli(
            [*CLI, "--redis-url", redis_url, "status", "site", *args], env=env, cwd=tmp_path, timeout=120,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert len(out.stdout) < BOUND, (args, len(out.stdout))
    doc = json.loads(Zygote.run_cli(
        [*CLI, "--redis-url", redis_url, "status", "site", "--json"], env=env, cwd=tmp_path, timeout=120,
    ).stdout)
    assert doc["stats"]["response_received_count"] == 7
    assert "nan_stat" not in doc["stats"] and "huge" not in doc["stats"]
    assert doc["garbage"]["stats"] >= 2


@pytest.mark.parametrize("host, allowed", [
    ("127.0.0.1", True), ("localhost", True), ("LOCALHOST.", True), ("[::1]", True),
    ("evil.example", False), ("127.0.0.1.nip.io", False), ("", False),
])
def test_dashboard_refuses_a_host_header_it_is_not_bound_to(dashboard: Any, host: str, allowed: bool) -> None:
    port = dashboard.url.rstrip("/").rsplit(":", 1)[1]
    for path in ("", "api/status", "api/history"):
        status, body = run(_get(dashboard.url + path, host=f"{host}:{port}" if host else " "))
        assert (status == 200) == allowed, (host, path, status, body[:200])
        if not allowed:
            assert status == 421 and b"--allow-host" in body


def test_dashboard_allows_the_names_given(redis_url: str) -> None:
    dash = Dashboard(redis.Redis.from_url(redis_url), SITE, cache_seconds=0,
                     allowed_hosts=("crawl-box.internal",))
    server = DashboardThread(dash)
    try:
        assert run(_get(server.url + "api/status", host="crawl-box.internal:9420"))[0] == 200
        assert run(_get(server.url + "api/status", host="Crawl-Box.Internal"))[0] == 200
        assert run(_get(server.url + "api/status", host="other.internal"))[0] == 421
    finally:
        server.close()


@pytest.mark.parametrize("flag, env_hosts, name", [
    (["--allow-host", "crawl-box.internal"], "", "crawl-box.internal"),
    ([], "crawl-box.internal other.internal", "other.internal"),
])
def test_the_dashboard_command_takes_allow_host(
    redis_url: str, tmp_path: Any, flag: list[str], env_hosts: str, name: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SCRAPY_SETTINGS_MODULE"}
    env["SCRAPY_DIST_DASHBOARD_HOSTS"] = env_hosts
    proc = Zygote.popen_cli([*CLI, "--redis-url", redis_url, "dashboard", "site", "--port", "0", *flag],
                            env=env, cwd=tmp_path)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        url = line.split(" on ", 1)[1].split(" ", 1)[0]
        assert run(_get(url + "api/status", host=name))[0] == 200, line
        assert run(_get(url + "api/status", host="evil.example"))[0] == 421
    finally:
        proc.terminate()
        proc.wait(10)
