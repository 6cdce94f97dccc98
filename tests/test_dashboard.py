"""The live dashboard: its JSON endpoints against a real Redis, the token and CSRF rules of its
buttons, the bounded history, and the page itself in a real headless Chromium while a crawl runs
(skipped, with the reason, where Debian's chromium and chromedriver are not installed)."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from aiohttp import ClientSession
from crawlproject import make_project
from helpers import run, wait_for
from redis.backoff import NoBackoff
from redis.retry import Retry

from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.monitor.dashboard import Dashboard, DashboardThread, check_binding, history_series
from scrapy_dist.redis.keys import CrawlKeys

LINKS = CrawlKeys("links")
TOKEN = "s3cret-token"


async def _call(url: str, method: str = "GET", **kw: Any) -> tuple[int, Any, dict[str, str]]:
    async with ClientSession() as session, session.request(method, url, **kw) as reply:
        body = await (reply.json() if reply.content_type == "application/json" else reply.text())
        return reply.status, body, dict(reply.headers)


@pytest.fixture
def served(redis_url: str) -> Any:
    requeued: list[int] = []

    async def requeue() -> str:
        requeued.append(1)
        return "requeued 0"

    dash = Dashboard(redis.Redis.from_url(redis_url), LINKS, token=TOKEN, requeue=requeue, cache_seconds=60)
    server = DashboardThread(dash)
    server.dashboard = dash  # type: ignore[attr-defined]
    server.requeued = requeued  # type: ignore[attr-defined]
    yield server
    server.close()


def test_the_page_the_chart_library_and_the_status(served: Any, redis_client: Any) -> None:
    redis_client.zadd(LINKS.queue, {b"\x00" * 6 + b"x": 0})
    status, page, headers = run(_call(served.url))
    assert status == 200 and "scrapy-dist: <span id=\"spider\">links</span>" in page
    assert "default-src 'self'" in headers["Content-Security-Policy"]  # no inline script can run
    status, lib, _ = run(_call(served.url + "static/chart.umd.min.js"))
    assert status == 200 and "Chart.js v4" in lib
    assert run(_call(served.url + "static/..%2Fdashboard.py"))[0] == 404
    status, body, _ = run(_call(served.url + "api/status"))
    assert status == 200 and body["frontier"]["queued"] == 1 and body["spider"] == "links"
    run(_call(served.url + "api/status"))
    assert served.dashboard.reads == 1  # cached: any number of open pages cost one read


def test_the_page_escapes_the_spider_name(redis_url: str) -> None:
    dash = Dashboard(redis.Redis.from_url(redis_url), CrawlKeys("a<b&c"), token=TOKEN)
    server = DashboardThread(dash)
    try:
        status, page, _ = run(_call(server.url))
    finally:
        server.close()
    assert status == 200 and '<span id="spider">a&lt;b&amp;c</span>' in page


def test_buttons_need_the_token_from_the_page_itself(served: Any, redis_client: Any) -> None:
    pause = served.url + "api/pause"
    assert run(_call(pause, "POST"))[0] == 403  # read-only without the token
    assert run(_call(pause, "POST", headers={"X-Dashboard-Token": "wrong"}))[0] == 403
    # a page of another site that knew the token still cannot use it: its Origin is not ours
    assert run(_call(pause, "POST", headers={"X-Dashboard-Token": TOKEN,
                                            "Origin": "http://evil.test"}))[0] == 403
    assert not redis_client.hget(LINKS.control, "paused")
    own = {"X-Dashboard-Token": TOKEN, "Origin": served.url.rstrip("/")}
    status, body, _ = run(_call(pause, "POST", headers=own))
    assert status == 200 and body == {"done": "paused"}
    assert redis_client.hget(LINKS.control, "paused") == b"1"
    assert run(_call(served.url + "api/resume", "POST", headers={"X-Dashboard-Token": TOKEN}))[0] == 200
    assert redis_client.hget(LINKS.control, "paused") in (None, b"0")
    assert run(_call(served.url + "api/requeue", "POST", headers={"X-Dashboard-Token": TOKEN}))[0] == 200
    assert served.requeued == [1]  # type: ignore[attr-defined]
    assert run(_call(served.url + "api/pause", "GET"))[0] == 405  # never by a link or an <img>


def test_listening_beyond_loopback_needs_a_token() -> None:
    check_binding("127.0.0.1", None)
    check_binding("::1", None)
    check_binding("0.0.0.0", TOKEN)
    with pytest.raises(ScrapyDistError, match="only with a token"):
        check_binding("0.0.0.0", None)


def test_history_series_from_real_stream_entries_skip_garbage(redis_client: Any) -> None:
    now_ms = int(time.time() * 1000)
    key = LINKS.history
    for i in range(6):  # two workers, one sample each 10 s, 60 pages and 1 error more each time
        for w in ("a", "b"):
            fields = {"w": w, "p": str(60 * i), "e": str(i), "q": str(100 - i), "f": "8", "d": "0"}
            redis_client.xadd(key, fields, id=f"{now_ms - 60_000 + 10_000 * i}-{'ab'.index(w)}")
    redis_client.xadd(key, {"w": "c", "p": "not a number"})
    redis_client.xadd(key, {"p": "5"})  # no worker
    entries = redis_client.xrange(key)
    series = history_series(entries, now_ms / 1000)
    # from just before the first sample (a minute ago) to now, in 10-second points
    assert series["times"][0] <= now_ms / 1000 - 60 < series["times"][1] + 10 and len(series["times"]) == 7
    assert sorted(series["workers"]) == ["a", "b"]
    rates = [x for x in series["pages_per_min"] if x]
    assert rates and all(r == pytest.approx(2 * 360.0) for r in rates)  # 60 pages / 10 s each, two workers
    assert [x for x in series["errors_per_min"] if x] == [pytest.approx(12.0)] * len(rates)
    assert [x for x in series["queued"] if x is not None][-1] == 95


# -- the page in a real browser ----------------------------------------------------------------------------
def _browser() -> Any:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("no chromium + chromedriver here (Debian: apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1400,1800"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver), options=options)


@pytest.mark.slow
def test_the_page_draws_a_running_crawl_and_pauses_only_with_the_token(
    tmp_path: Path, redis_url: str, site_factory: Any, redis_client: Any
) -> None:
    browser = _browser()
    site = site_factory(pages=400, delay=0.1)  # a crawl of ~10 s: still running when the charts have moved
    project = make_project(tmp_path, {
        "REDIS_URL": redis_url, "ADDONS": {"scrapy_dist.Addon": 0}, "CLUSTERSTATS_INTERVAL": 0.5,
        "SCHEDULER_IDLE_BEFORE_CLOSE": 1, "CONCURRENT_REQUESTS": 4,
    })
    dash = Dashboard(redis.Redis.from_url(redis_url), LINKS, token=TOKEN, cache_seconds=0.5)
    served = DashboardThread(dash)
    try:
        project.crawl(args={"seed": site.page_url(0)})
        browser.get(served.url)
        wait_for(lambda: "running" in browser.find_element("id", "workers").text, 30, "the worker running")

        def drawn(what: str) -> Any:
            return browser.execute_script(f"return window.dashboardCharts.{what}")

        # charts render and then move: the history stream fills as the worker's heartbeats come in
        wait_for(lambda: drawn("pages.data.labels.length") >= 6, 30, "the charts' points")
        wait_for(lambda: sum(x or 0 for x in drawn("pages.data.datasets[0].data")) > 0, 30, "pages/min drawn")
        first = sum(x or 0 for x in drawn("pages.data.datasets[0].data"))
        wait_for(lambda: sum(x or 0 for x in drawn("pages.data.datasets[0].data")) > first, 30, "an update")
        assert len(drawn("pages.data.datasets")) >= 2  # crawl-wide and one line per worker
        # Pause without the token: refused; with it: the crawl is paused
        browser.find_element("id", "pause").click()
        wait_for(lambda: "refused (403)" in browser.find_element("id", "message").text, 10, "a refusal")
        assert not redis_client.hget(LINKS.control, "paused")
        browser.find_element("id", "token").send_keys(TOKEN)
        browser.find_element("id", "pause").click()
        wait_for(lambda: redis_client.hget(LINKS.control, "paused") == b"1", 10, "paused by the page")
        browser.find_element("id", "resume").click()
        wait_for(lambda: redis_client.hget(LINKS.control, "paused") in (None, b"0"), 10, "resumed")
        for proc, _ in project.procs:  # nothing left to check: the rest of the crawl is a graceful stop
            proc.terminate()
        assert project.wait_all(90) == [0], project.logs()[-3000:]
    finally:
        browser.quit()
        served.close()


def test_the_history_sample_is_written_bounded_and_a_foreign_key_moved_aside(redis_client: Any) -> None:
    from scrapy_dist.redis import scripts

    script = scripts.register(redis_client, "clusterstats")
    fields = ["pages", "7", "items", "3", "errors", "1", "frontier_queued", "40"]
    script(keys=["stats", "workers", "worker", "history"], args=["w1", 1, 60, "0", 4, *fields])
    ((_, sample),) = redis_client.xrange("history")
    assert sample[b"w"] == b"w1" and sample[b"p"] == b"7" and sample[b"q"] == b"40"
    # someone else's string under the history key: moved aside (kept), the flush merges, the history goes on
    redis_client.set("history2", "not a stream")
    applied = script(keys=["stats", "workers", "worker", "history2"], args=["w1", 2, 60, "0", 4, *fields])[0]
    assert applied == 1 and redis_client.get("history2:garbage") == b"not a stream"
    assert redis_client.xlen("history2") == 1


def test_redis_away_is_a_503_with_the_reason_and_one_warning(
    redis_servers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    (redis_server,) = redis_servers(1)
    # no retries between failed calls, as the clients scrapy_dist.redis.connection builds (redis-py's
    # default retries each refused connection with a backoff of seconds)
    client = redis.Redis(port=redis_server.port, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    dash = Dashboard(client, LINKS, token=TOKEN, cache_seconds=0)
    server = DashboardThread(dash)
    caplog.set_level(logging.INFO, logger="scrapy_dist.redis.outage")
    try:
        assert run(_call(server.url + "api/status"))[0] == 200
        redis_server.kill()
        for path in ("api/status", "api/history", "api/status"):
            status, body, _ = run(_call(server.url + path))
            assert status == 503 and body["error"].startswith("Redis unavailable (ConnectionError"), body
        status, body, _ = run(_call(server.url + "api/pause", "POST", headers={"X-Dashboard-Token": TOKEN}))
        assert status == 503 and "Redis unavailable" in body["error"]
        redis_server.start()
        assert run(_call(server.url + "api/status"))[0] == 200
    finally:
        server.close()
    lines = [r for r in caplog.records if r.name == "scrapy_dist.redis.outage"]
    assert [r.levelname for r in lines] == ["WARNING", "INFO"], [r.getMessage() for r in lines]
    assert "dashboard" in lines[0].getMessage()
    assert not any(r.exc_info for r in caplog.records)
