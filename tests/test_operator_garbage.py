"""Operator tools survive garbage: `scrapy-dist status`, `dead` and `items` through their real entry point
against a real Redis filled with garbage, and a control hash that cannot close workers it should not."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from scrapy import Request
from scrapy.utils.test import get_crawler

from scrapy_dist.cli import main
from scrapy_dist.extensions import IdleMonitor
from scrapy_dist.frontier.layout import ControlState
from scrapy_dist.frontier.orders import dead_letter_record
from scrapy_dist.redis import scripts
from scrapy_dist.redis.keys import CrawlKeys

SPIDER = "junk"
KEYS = CrawlKeys(SPIDER)
ENV = {"COLUMNS": "200", "SCRAPY_SETTINGS_MODULE": None}
#: what must never reach the terminal from Redis contents
ESCAPES = ("\x1b", "\x9b", "\x07", "\u202e")
EVIL_ID = "[/x][bold]host:1:\x1b]52;c;aGk=\x07\x1b[2J\u202e"


def cli(redis_url: str, *args: str) -> Any:
    result = CliRunner().invoke(main, ["--redis-url", redis_url, *args], env=ENV)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 0, result.output
    for bad in ESCAPES:
        assert bad not in result.output, (bad, result.output)
    assert "Traceback" not in result.output
    return result


@pytest.fixture
def garbage(redis_client: redis.Redis) -> redis.Redis:
    now = float(redis_client.time()[0])
    redis_client.hset(KEYS.control, mapping={
        "shards": "100000", "close": "[/x]\x1b[2J", "close_at": "nan", "paused": "maybe",
        "paused_by": "\x1b[5m",
    })
    redis_client.zadd(KEYS.workers, {EVIL_ID: now, "w-inf": float("inf"), "w-ok": now})
    redis_client.hset(KEYS.worker(EVIL_ID), mapping={
        "pages": "1e300", "items": "²", "errors": "-3", "started": "nan", "interval": "-1",
        "pid": "99999999999",
        "inflight": "x", "state": "\x1b[31mrunning", "pages_per_min": "inf", "finish_reason": "[/x]\x9b2J",
        "host": "\x1b[2J",
    })
    redis_client.hset(KEYS.worker("w-inf"), mapping={"started": "1e300", "interval": "nan"})
    redis_client.hset(KEYS.errors, mapping={"_bucket": "nan", "_window": "1e300", "1|attempts": "zz"})
    redis_client.hset(KEYS.bloom, mapping={"capacity": "1" + "0" * 400, "error_rate": "nan", "n": "-1"})
    redis_client.set(KEYS.queue_tails, "not a hash")
    redis_client.set(KEYS.domain_info, "not a hash")
    redis_client.hset(KEYS.stats, mapping={"response_received_count": "\x1b[2Jabc",
                                           "item_scraped_count": "nan"})
    return redis_client


def test_status_survives_garbage(redis_url: str, garbage: redis.Redis) -> None:
    out = cli(redis_url, "status", SPIDER).output
    assert "[/x][bold]host:1:" in out  # shown literally, not eaten as rich markup
    assert "\\x1b" in out  # escapes are shown escaped
    assert "Ignored garbage" in out and "shards='100000'" in out
    data = json.loads(cli(redis_url, "status", SPIDER, "--json").output)
    assert data["shards"] == 1
    assert data["control"]["close_at"] is None and data["control"]["close"] is None
    evil = next(w for w in data["workers"] if w["id"] == EVIL_ID)
    assert evil["pages"] is None and evil["pid"] is None and "pages" in evil["garbage"]
    assert data["filter"]["kind"] == "garbage"
    # The remedy for a garbled control hash: `scrapy-dist resume` clears the flags (shards: the crawl's).
    cli(redis_url, "resume", SPIDER)
    data = json.loads(cli(redis_url, "status", SPIDER, "--json").output)
    assert data["garbage"]["control"] == ["shards='100000' (expected 1 to 1024)"]


def test_dead_survives_garbage_and_requeue_skips_bad_records(
    redis_url: str, redis_client: redis.Redis
) -> None:
    good = dead_letter_record(Request("https://e.com/ok", meta={"retry_times": 2}), reason="500", worker="w",
                              status=500, now=1000.0)
    record = json.loads(good)
    records = [
        good,
        json.dumps({**record, "at": 1e300}),
        json.dumps({**record, "at": float("nan")}),  # Python writes NaN, which json.loads reads back
        json.dumps({**record, "at": 10**400}),
        "[" * 100_000,
        json.dumps({**record, "worker": EVIL_ID, "url": "https://e.com/\x1b[2J", "reason": "[/x]\u202e"}),
        json.dumps({**record, "url": "not a url"}),  # a url Request() refuses
        json.dumps({**record, "status": 10**30}),
        "\x1b[2J not json",
    ]
    redis_client.rpush(KEYS.deadletter, *records)
    out = cli(redis_url, "dead", SPIDER).output
    assert "[/x]" in out and "skipped malformed record" in out
    assert out.count("skipped malformed record") == 6
    for line in cli(redis_url, "dead", SPIDER, "--json").stdout.splitlines():
        json.loads(line)
    result = cli(redis_url, "dead", SPIDER, "--requeue")
    assert "kept not a url (cannot be requeued: ValueError" in result.output
    assert "requeued 2 dead letters" in result.output  # the good one and the one with the evil worker id
    assert redis_client.zcard(KEYS.queue) >= 1
    # A flood of garbage is counted, not echoed line by line.
    redis_client.rpush(KEYS.deadletter, *[b"\x00junk"] * 500)
    out = cli(redis_url, "dead", SPIDER).output
    assert out.count("skipped malformed record") == 20 and "more malformed records skipped" in out


def test_items_survive_garbage(redis_url: str, redis_client: redis.Redis) -> None:
    redis_client.rpush(KEYS.items, "\x1b[2J\x1b]52;c;aGk=\x07 not json", "[" * 100_000,
                       json.dumps({"t": "\x9b2J\u202e"}, ensure_ascii=False), json.dumps({"ok": 1}))
    out = cli(redis_url, "items", SPIDER).output
    assert '"ok": 1' in out and "\\u009b2J" in out
    lines = cli(redis_url, "items", SPIDER, "--json-lines").stdout.splitlines()
    assert [json.loads(line) for line in lines] == [{"t": "\x9b2J\u202e"}, {"ok": 1}]


# -- the control hash ------------------------------------------------------------------------------------
def test_close_at_far_in_the_future_closes_nobody() -> None:
    c = ControlState.from_hash({b"close": b"finished", b"close_at": b"1e12"})
    assert c.close_reason(started_at=100.0, now=200.0) == ""
    assert c.close_reason(started_at=100.0, now=1e12) == "finished"  # once that time has come, it is real
    for at in (b"nan", b"inf", b"-inf", b"1e400", b"x"):
        bad = ControlState.from_hash({b"close": b"finished", b"close_at": at})
        assert bad.close_at is None and bad.close_reason(0.0, 1e9) == "" and bad.problems


def make_idlemonitor(redis_url: str, **settings: Any) -> IdleMonitor:
    crawler = get_crawler(settings_dict={"REDIS_URL": redis_url, **settings})
    crawler.spidercls.name = SPIDER
    return IdleMonitor.from_crawler(crawler)


def test_idle_monitor_ignores_a_future_close_and_reports_garbage_once(
    redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    future = time.time() + 10 * 365 * 86400
    redis_client.hset(KEYS.control, mapping={"close": "finished", "close_at": repr(future)})

    async def scenario() -> list[str]:
        m = make_idlemonitor(redis_url, SCHEDULER_IDLE_BEFORE_CLOSE=0)
        await m.spider_opened(None)
        reasons = [await m.check(now=0)]
        redis_client.hset(KEYS.control, "close_at", "NaN-garbage")
        with caplog.at_level(logging.WARNING):
            reasons += [await m.check(now=i) for i in range(5)]
        await m.spider_closed(None, "x")
        return reasons

    assert asyncio.run(scenario()) == [""] * 6
    warnings = [r.getMessage() for r in caplog.records if "garbage" in r.getMessage()]
    assert len(warnings) == 1 and "close_at='NaN-garbage'" in warnings[0]


def test_control_garbage_rewritten_at_every_poll_is_one_line(
    redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # a new garbage value at every poll was a new WARNING, and a new entry kept for the process's lifetime
    from scrapy_dist.frontier import layout as control

    async def scenario() -> None:
        m = make_idlemonitor(redis_url, SCHEDULER_IDLE_BEFORE_CLOSE=0)
        await m.spider_opened(None)
        with caplog.at_level(logging.WARNING):
            for i in range(20):
                redis_client.hset(KEYS.control, mapping={"paused": f"junk-{i}", "shards": f"-{i}"})
                await m.check(now=i)
        await m.spider_closed(None, "x")

    control._reported -= {(KEYS.control, "paused"), (KEYS.control, "shards")}  # other tests' reports
    before = len(control._reported)
    asyncio.run(scenario())
    warnings = [r.getMessage() for r in caplog.records if "garbage" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert len(control._reported) - before <= 2


def test_idle_script_overwrites_a_future_or_garbage_close(redis_client: redis.Redis) -> None:
    script = scripts.register(redis_client, "idle")
    keys = [KEYS.queue, KEYS.leases, KEYS.delayed, KEYS.control, KEYS.workers]
    redis_client.zadd(KEYS.workers, {"worker-1": 1})
    for at in ("1e12", "nan", "garbage"):
        redis_client.hset(KEYS.control, mapping={"close": "bogus", "close_at": at})
        decided, reason, _ = script(keys=keys, args=["finished", "0"])
        assert (decided, reason) == (1, b"finished"), at


def test_error_monitor_ignores_a_future_or_garbage_close(redis_url: str, redis_client: redis.Redis) -> None:
    from scrapy_dist.extensions import ErrorMonitor

    crawler = get_crawler(settings_dict={"REDIS_URL": redis_url, "CLUSTERSTATS_INTERVAL": 3600})
    crawler.spidercls.name = SPIDER
    monitor = ErrorMonitor.from_crawler(crawler)

    async def scenario() -> list[bool]:
        await monitor.spider_opened(None)
        closing = []
        for at in (repr(time.time() + 10 * 365 * 86400), "garbage", "nan"):
            redis_client.hset(KEYS.control, mapping={"close": "error_threshold", "close_at": at})
            await monitor.flush(now=time.time())  # no ValueError per poll, not closed by the future flag
            closing.append(monitor.closing)
        await monitor.spider_closed(None, "x")
        return closing

    assert asyncio.run(scenario()) == [False, False, False]
