"""Prometheus: ``scrapy-dist metrics`` serves the crawl-wide snapshot ``status`` reads, in the
Prometheus text format (parsed here with prometheus_client's own parser), cached, bounded, and never
crashing on what is in Redis."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis
from crawlproject import make_project
from helpers import dashboard_metrics
from prometheus_client.parser import text_string_to_metric_families
from redis.backoff import NoBackoff
from redis.retry import Retry
from scrapy import Request
from zygote import Zygote

from scrapy_dist.frontier.orders import dead_letter_record
from scrapy_dist.monitor.metrics import REASON_LIMIT, CrawlCollector, serve
from scrapy_dist.redis.keys import CrawlKeys

LINKS = CrawlKeys("links")
DOCS = Path(__file__).resolve().parent.parent / "docs" / "monitoring.md"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``(sample name, sorted labels) -> value`` of an exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read().decode()


def value(found: dict[Any, float], name: str, **labels: str) -> float:
    return found[(name, tuple(sorted({"spider": "links", **labels}.items())))]


def cli(redis_url: str, *args: str, cwd: Path | None = None) -> Any:
    env = {k: v for k, v in os.environ.items() if k != "SCRAPY_SETTINGS_MODULE"}
    return Zygote.popen_cli(
        [sys.executable, "-c", "from scrapy_dist.cli import main; main()", "--redis-url", redis_url, *args],
        env=env, cwd=cwd,
    )


@pytest.mark.slow
def test_metrics_of_a_crawl_match_status(tmp_path: Path, redis_url: str, site_factory: Any) -> None:
    site = site_factory(pages=150, links=5, missing=5, flaky=3, delay=0.01)  # flaky: 503 twice
    project = make_project(tmp_path, {
        "REDIS_URL": redis_url, "ADDONS": {"scrapy_dist.Addon": 0}, "CLUSTERSTATS_INTERVAL": 0.5,
        "SCHEDULER_IDLE_BEFORE_CLOSE": 1, "CONCURRENT_REQUESTS": 4, "RETRY_TIMES": 1,
    })
    exporter = cli(redis_url, "metrics", "links", "--port", "0", "--cache", "0")
    try:
        assert exporter.stdout is not None
        line = exporter.stdout.readline()
        url = re.search(r"(http://\S+/metrics)", line)
        assert url, line + exporter.stderr.read()
        project.crawl(args={"seed": site.page_url(0)})
        deadline = time.monotonic() + 60
        while True:  # scraped while the crawl runs: a running worker, pages going up
            running = samples(scrape(url.group(1)))
            if running.get(("scrapy_dist_workers", (("spider", "links"), ("state", "running")))) == 1:
                break
            assert time.monotonic() < deadline, "no running worker seen"
            time.sleep(0.2)
        assert value(running, "scrapy_dist_up") == 1
        assert project.wait_all(90) == [0], project.logs()[-3000:]
        final = samples(scrape(url.group(1)))
    finally:
        exporter.terminate()
        exporter.wait(10)
    status = json.loads(Zygote.run_cli(
        [sys.executable, "-c", "from scrapy_dist.cli import main; main()", "--redis-url", redis_url, "status",
         "links", "--json"], check=True).stdout)
    front = status["frontier"]
    for state in ("queued", "inflight", "delayed"):
        assert value(final, "scrapy_dist_frontier_requests", state=state) == front[state]
    assert value(final, "scrapy_dist_dead_letters") == status["deadletter"] == 3  # the flaky pages, 503 twice
    assert value(final, "scrapy_dist_dead_letters_by_reason", reason="503") == 3
    assert value(final, "scrapy_dist_filter_items") == status["filter"]["items"] == 150
    assert value(final, "scrapy_dist_filter_false_positive_ratio") == pytest.approx(
        status["filter"]["fpr_estimate"])
    stats = status["stats"]
    assert value(final, "scrapy_dist_pages_total") == stats["response_received_count"] >= 150
    assert value(final, "scrapy_dist_items_total") == stats["item_scraped_count"] == 150 - 5 - 3
    assert value(final, "scrapy_dist_errors_total", reason="http:404") == (
        stats["downloader/response_status_count/404"]) == 5  # the missing pages
    assert value(final, "scrapy_dist_workers", state="closed") == status["workers_summary"]["closed"] == 1
    (worker,) = status["workers"]
    assert value(final, "scrapy_dist_worker_pages_total", worker=worker["id"]) == worker["pages"]
    assert value(final, "scrapy_dist_worker_last_seen_timestamp_seconds", worker=worker["id"]) == (
        worker["last_seen"])
    assert value(final, "scrapy_dist_worker_up", worker=worker["id"]) == 0
    # every metric family exported is in the documentation's table, and every documented one was seen
    # here but those this crawl has no cause to export (no politeness, nothing dropped or paused...)
    documented = {n.removesuffix("_total")
                  for n in re.findall(r"^\| `(scrapy_dist_\w+)`", DOCS.read_text(), re.MULTILINE)}
    exported = {name.removesuffix("_total") for name, _ in {**running, **final}}
    assert exported <= documented
    # the Grafana dashboard's queries (docs/deploy) name metrics this crawl exported (but the politeness one)
    assert dashboard_metrics() - {"scrapy_dist_domain_backlog_requests"} <= exported
    assert documented - exported <= {
        "scrapy_dist_domain_backlog_requests", "scrapy_dist_error_ratio", "scrapy_dist_items_dropped",
        "scrapy_dist_log_errors", "scrapy_dist_dead_letters_by_reason", "scrapy_dist_worker_leases",
    }


def test_scrapes_within_the_cache_interval_read_redis_once(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    now = [100.0]
    collector = CrawlCollector(client, ["links", "other"], cache_seconds=5.0, clock=lambda: now[0])
    list(collector.collect())
    list(collector.collect())
    now[0] += 4.9
    list(collector.collect())
    assert collector.reads == 2  # one per crawl, once
    now[0] += 0.2
    list(collector.collect())
    assert collector.reads == 4


def test_hostile_dead_letters_and_many_reasons_stay_bounded(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    records = [dead_letter_record(Request(f"http://site.test/{i}"), reason=f"reason_{i}", worker="w", now=1.0)
               for i in range(REASON_LIMIT + 30)]
    client.rpush(LINKS.deadletter, *records, b"\xff not json", b"[1, 2]", b"x" * 100_000)
    collector = CrawlCollector(client, ["links"], cache_seconds=0)
    server = serve(collector, "127.0.0.1", 0)
    try:
        found = samples(scrape(f"http://127.0.0.1:{server.server_port}/metrics"))
    finally:
        server.shutdown()
    reasons = {dict(labels)["reason"]: v for (name, labels), v in found.items()
               if name == "scrapy_dist_dead_letters_by_reason"}
    assert len(reasons) == REASON_LIMIT + 1  # the rest summed under "other"
    assert sum(reasons.values()) == REASON_LIMIT + 33
    assert reasons["unreadable"] == 3
    assert value(found, "scrapy_dist_dead_letters") == REASON_LIMIT + 33


def test_redis_away_is_up_0_not_an_error() -> None:
    client = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    collector = CrawlCollector(client, ["links"], cache_seconds=0)
    families = {f.name: f for f in collector.collect()}
    assert [s.value for s in families["scrapy_dist_up"].samples] == [0.0]


def test_no_spider_outside_a_project_is_one_line(redis_url: str, tmp_path: Path) -> None:
    proc = cli(redis_url, "metrics", cwd=tmp_path)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "name the crawls to export: scrapy-dist metrics SPIDER..." in err
    assert "Traceback" not in err


def test_redis_away_is_one_warning_and_one_line_when_back(
    redis_servers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    (server,) = redis_servers(1)
    # no retries between failed calls, as the clients scrapy_dist.redis.connection builds (redis-py's
    # default retries each refused connection with a backoff of seconds)
    client = redis.Redis(port=server.port, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    collector = CrawlCollector(client, ["links"], cache_seconds=0)
    caplog.set_level(logging.INFO, logger="scrapy_dist.redis.outage")
    list(collector.collect())
    server.kill()
    for _ in range(3):
        families = {f.name: f for f in collector.collect()}
        assert [s.value for s in families["scrapy_dist_up"].samples] == [0.0]
    server.start()
    families = {f.name: f for f in collector.collect()}
    assert [s.value for s in families["scrapy_dist_up"].samples] == [1.0]
    lines = [r for r in caplog.records if r.name == "scrapy_dist.redis.outage"]
    assert [r.levelname for r in lines] == ["WARNING", "INFO"], [r.getMessage() for r in lines]
    assert "metrics exporter" in lines[0].getMessage() and "Redis is unreachable" in lines[0].getMessage()
    assert not any(r.exc_info for r in caplog.records)
