"""Long-running workers (``SCHEDULER_IDLE_BEFORE_CLOSE = None``): the setting, the status line "idle, next
revisit in N s", the revisit rules, and (end-to-end) the Redis cost of an idle minute and a worker that
picks up work that arrives or comes due while it idles."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from crawlproject import make_project
from helpers import wait_for

from scrapy_dist.cli.status import idle_text
from scrapy_dist.frontier.orders import RevisitRules
from scrapy_dist.monitor import read_status
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.settings import DistSettings, SettingsError
from scrapy_dist.settings.values import revisit_rules

NOFOLLOW = CrawlKeys("nofollow")


def test_idle_before_close_none_means_never() -> None:
    for given in (None, "none", "None"):
        assert math.isinf(DistSettings.from_settings({"SCHEDULER_IDLE_BEFORE_CLOSE": given}).scheduler
                          .idle_before_close)
    assert DistSettings.from_settings({}).scheduler.idle_before_close == 0.0
    assert DistSettings.from_settings({"SCHEDULER_IDLE_BEFORE_CLOSE": 3}).scheduler.idle_before_close == 3.0


def test_revisit_rules_most_specific_wins_url_or_host() -> None:
    rules = RevisitRules(revisit_rules({
        "*.example.com": 3600, "shop.example.com": 60, "*/item/*": 2592000, "*/login*": None,
    }))
    assert rules.for_url("https://a.example.com/list", "a.example.com") == 3600
    assert rules.for_url("https://shop.example.com/list", "shop.example.com") == 60  # exact host first
    assert rules.for_url("https://a.example.com/item/7", "a.example.com") == 2592000  # more literal chars
    assert rules.for_url("https://a.example.com/login?x", "a.example.com") is None
    assert rules.for_url("https://other.org/", "other.org") is not None  # _NOT_SET: no rule
    assert rules.for_url("https://other.org/", "other.org") not in (None, 3600, 60)


@pytest.mark.parametrize("bad", [{"*": "soon"}, {"*": 0}, {"*": -5}, {"*": True}, {"": 5}, ["*"]])
def test_bad_revisit_rules_are_one_line(bad: Any) -> None:
    with pytest.raises(SettingsError) as err:
        DistSettings.from_settings({"REVISIT_AFTER": bad})
    assert "REVISIT_AFTER" in str(err.value) and "\n" not in str(err.value)


def test_status_counts_revisits_and_says_when_the_next_is_due(redis_client: redis.Redis) -> None:
    now = float(redis_client.time()[0])
    redis_client.zadd(NOFOLLOW.delayed, {b"m1": now + 120, b"m2": now + 3600})
    redis_client.hset(NOFOLLOW.delayed_meta, mapping={"m1": "0 r", "m2": "0 r", "revisits": 2})
    status = read_status(redis_client, NOFOLLOW)
    assert status["revisits"]["scheduled"] == 2
    assert 110 <= status["revisits"]["next_in"] <= 121
    assert idle_text(status).startswith("idle, next revisit in 1")
    # garbage count: read as 0, status goes on
    redis_client.hset(NOFOLLOW.delayed_meta, "revisits", "lots")
    assert read_status(redis_client, NOFOLLOW)["revisits"]["scheduled"] == 0
    # work queued: not idle
    assert idle_text({"frontier": {"queued": 3, "inflight": 0}, "revisits": {"next_in": 5}}) == ""


def _member(seq: int, url: str) -> bytes:
    return seq.to_bytes(6, "big") + b"\x01" + msgpack.packb({"u": url})


def _calls(client: redis.Redis) -> int:
    return sum(v["calls"] for k, v in client.info("commandstats").items() if k != "cmdstat_config")


@pytest.mark.slow
def test_an_idle_long_running_worker_costs_little_and_picks_up_work(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    site = site_factory(pages=5, links=1)
    project = make_project(tmp_path, {
        "REDIS_URL": redis_url, "SCHEDULER_IDLE_BEFORE_CLOSE": "none", "SCHEDULER_IDLE_POLL_MAX": 2,
        "ADDONS": {"scrapy_dist.Addon": 0},
    })
    proc = project.crawl("nofollow")
    project.wait_until_open()
    client = redis.Redis.from_url(redis_url)
    time.sleep(4)  # the polls slow down to SCHEDULER_IDLE_POLL_MAX
    client.config_resetstat()
    window = 5.0
    time.sleep(window)
    per_minute = _calls(client) * 60 / window
    # an idle worker polls slower and slower, not 4 sync calls a second
    assert per_minute < 2000, per_minute
    assert proc.poll() is None  # still up: it never closes
    # work arrives: a request queued by anyone, and a revisit coming due in 2 s
    client.zadd(NOFOLLOW.queue, {_member(1, site.page_url(1)): 0})
    now = float(client.time()[0])
    client.zadd(NOFOLLOW.delayed, {_member(2, site.page_url(2)): now + 2})
    client.hset(NOFOLLOW.delayed_meta, mapping={_member(2, site.page_url(2)): "0 r", "revisits": 1})
    wait_for(lambda: {"/page/1", "/page/2"} <= set(site.fetch_counts()), 20, "both pages fetched")
    assert proc.poll() is None
    project.stop_all()
