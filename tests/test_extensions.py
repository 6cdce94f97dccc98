"""The monitoring extensions against a real Redis: stats merging, heartbeats, the error window and its
actions, the crawl-wide idle decision, control flags, and the add-on's settings."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
from helpers import run
from scrapy import Request
from scrapy.exceptions import NotConfigured
from scrapy.http import HtmlResponse
from scrapy.settings import Settings
from scrapy.utils.test import get_crawler
from twisted.python.failure import Failure
from zygote import Zygote

from scrapy_dist.addon import Addon
from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.extensions import ClusterStats, ErrorMonitor, IdleClock, IdleMonitor
from scrapy_dist.extensions.clusterstats import (
    RateMeter,
    StatsMerger,
    encode_datetime,
    error_count,
    worker_state,
)
from scrapy_dist.extensions.errors import ErrorCounts, format_alert, http_error_matcher
from scrapy_dist.frontier.layout import ControlState, pause_crawl, resume_crawl
from scrapy_dist.redis import scripts
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.settings.reader import start_error

KEYS = CrawlKeys("books")


def h(client: redis.Redis, key: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in client.hgetall(key).items()}


# -- stats merging (pure) ---------------------------------------------------------------------------
def test_merger_sends_deltas_of_numbers_and_changed_values_only() -> None:
    m = StatsMerger()
    t0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=timezone.utc)
    ops = m.operations({"pages": 5, "bytes": 1.5, "start_time": t0, "finish_reason": "x", "odd": [1]})
    assert sorted(ops) == sorted([
        ("sum", "pages", "5"), ("sum", "bytes", "1.5"),
        ("min", "start_time", "2024-05-01T12:00:00.000000+00:00"), ("set", "finish_reason", "x"),
    ])
    assert m.operations({"pages": 5, "bytes": 1.5, "start_time": t0, "finish_reason": "x"}) == []
    assert m.operations({"pages": 12, "bytes": 1.0}) == [("sum", "pages", "7"), ("sum", "bytes", "-0.5")]


def test_merger_modes() -> None:
    m = StatsMerger(max_stats=["custom/gauge*"], min_stats=["first_seen"])
    t = datetime.now(timezone.utc)
    assert m.mode("memusage/max", 10) == "max"
    assert m.mode("request_depth_max", 3) == "max"
    assert m.mode("elapsed_time_seconds", 3.0) == "max"
    assert m.mode("dupefilter/bloom/fill_ratio", 0.1) == "max"
    assert m.mode("custom/gauge_a", 1) == "max"
    assert m.mode("first_seen", 1) == "min"
    assert m.mode("start_time", t) == "min"
    assert m.mode("finish_time", t) == "max"
    assert m.mode("scheduler/dequeued", 3) == "sum"
    assert m.mode("downloader/maximum_thing", 3) == "sum"  # "max" must be a word
    assert m.mode("flag", True) == "set"
    assert m.mode("bad", float("nan")) is None


def test_datetimes_are_fixed_width_utc() -> None:
    naive = datetime(2024, 1, 2, 3, 4, 5)
    other = datetime(2024, 1, 2, 5, 4, 5, 7, tzinfo=timezone(timedelta(hours=2)))
    a, b = encode_datetime(naive), encode_datetime(other)
    assert a == "2024-01-02T03:04:05.000000+00:00"
    assert b == "2024-01-02T03:04:05.000007+00:00"
    assert a < b


# -- ClusterStats against Redis -------------------------------------------------------------------
def make_clusterstats(redis_url: str, **settings: Any) -> ClusterStats:
    crawler = get_crawler(settings_dict={"REDIS_URL": redis_url, "CLUSTERSTATS_INTERVAL": 3600, **settings})
    crawler.spidercls.name = "books"
    return ClusterStats.from_crawler(crawler)


def test_two_workers_merge_into_one_hash(redis_url: str, redis_client: redis.Redis) -> None:
    t0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=timezone.utc)

    async def scenario() -> None:
        a, b = make_clusterstats(redis_url), make_clusterstats(redis_url)
        a.crawler.stats.set_value("start_time", t0)
        b.crawler.stats.set_value("start_time", t0 + timedelta(seconds=3))
        await a.spider_opened(None)
        await b.spider_opened(None)
        for o, pages, depth in ((a, 10, 3), (b, 7, 5)):
            o.crawler.stats.inc_value("response_received_count", pages)
            o.crawler.stats.max_value("request_depth_max", depth)
            o.crawler.stats.inc_value("downloader/response_bytes", 1000)
        assert await a.flush() == 1
        assert await b.flush() == 1
        merged = h(redis_client, KEYS.stats)
        assert merged["response_received_count"] == "17"
        assert merged["request_depth_max"] == "5"
        assert merged["downloader/response_bytes"] == "2000"
        assert merged["start_time"] == "2024-05-01T12:00:00.000000+00:00"
        a.crawler.stats.inc_value("response_received_count", 5)
        a.crawler.stats.inc_value("item_scraped_count", 2)
        await a.flush()
        merged = h(redis_client, KEYS.stats)
        assert merged["response_received_count"] == "22" and merged["item_scraped_count"] == "2"
        # closing: finish_time = the later of the two, nothing deleted
        a.crawler.stats.set_value("finish_time", t0 + timedelta(minutes=1))
        a.crawler.stats.set_value("finish_reason", "finished")
        await a.spider_closed(None, "finished")
        b.crawler.stats.set_value("finish_time", t0 + timedelta(minutes=2))
        await b.spider_closed(None, "finished")
        merged = h(redis_client, KEYS.stats)
        assert merged["finish_time"] == "2024-05-01T12:02:00.000000+00:00"
        assert merged["response_received_count"] == "22"
        workers = {w.decode() for w in redis_client.zrange(KEYS.workers, 0, -1)}
        assert workers == {a.worker, b.worker}
        info = h(redis_client, KEYS.worker(a.worker))
        assert info["state"] == "closed" and info["finish_reason"] == "finished"
        assert info["pages"] == "15" and info["items"] == "2"
        assert redis_client.ttl(KEYS.worker(a.worker)) > 0

    run(scenario())


def test_a_flush_resent_after_a_lost_reply_counts_once(redis_url: str, redis_client: redis.Redis) -> None:
    async def scenario() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        script = scripts.register(client, "clusterstats")
        keys = [KEYS.stats, KEYS.workers, KEYS.worker("w1")]
        args = ["w1", 1, 60, "0", 1, "state", "running", "sum", "pages", "4", "max", "depth", "2",
                "min", "t", "2024-01-01T00:00:01.000000+00:00", "set", "reason", "x", "sum", "f", "0.5"]
        assert (await script(keys=keys, args=args))[0] == 1
        assert (await script(keys=keys, args=args))[0] == 0  # same sequence number: not again
        args[1] = 2
        args[9], args[12] = "3", "1"  # depth 1 < 2 stays 2
        args[15] = "2023-12-31T23:59:59.000000+00:00"
        assert (await script(keys=keys, args=args))[0] == 1
        await client.aclose()

    run(scenario())
    assert h(redis_client, KEYS.stats) == {
        "pages": "7", "depth": "2", "t": "2023-12-31T23:59:59.000000+00:00", "reason": "x", "f": "1",
    }


@pytest.mark.parametrize("garbage", [b"1e308", b"inf", b"99999"])
def test_a_garbage_flush_seq_does_not_silence_the_worker(
    redis_url: str, redis_client: redis.Redis, garbage: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    # anyone could set a worker's flush_seq past every number it would send: none of its flushes was
    # merged again (the crawl-wide stats and the history lost it) for the rest of the crawl
    async def scenario() -> list[int]:
        client = redis.asyncio.Redis.from_url(redis_url)
        script = scripts.register(client, "clusterstats")
        keys = [KEYS.stats, KEYS.workers, KEYS.worker("w1")]
        out = []
        for seq in (1, 2, 2, 3):
            if seq == 2 and not out[1:]:
                redis_client.hset(KEYS.worker("w1"), "flush_seq", garbage)
            out.append((await script(keys=keys, args=["w1", seq, 60, "0", 0, "sum", "pages", "4"]))[0])
        await client.aclose()
        return out

    assert run(scenario()) == [1, 1, 0, 1]  # the resent 2 still counts once
    assert h(redis_client, KEYS.stats) == {"pages": "12"}
    assert h(redis_client, KEYS.worker("w1"))["flush_seq"] == "3"

    # through the extension: merged, and named once however often it is written again
    async def extension() -> None:
        o = make_clusterstats(redis_url)
        await o.spider_opened(None)
        for _ in range(3):
            redis_client.hset(KEYS.worker(o.worker), "flush_seq", garbage)
            o.crawler.stats.inc_value("response_received_count", 1)
            assert await o.flush() == 1
        await o.spider_closed(None, "finished")

    with caplog.at_level(logging.WARNING, logger="scrapy_dist.extensions.clusterstats"):
        run(extension())
    assert caplog.text.count("its flush_seq was not this worker's") == 1


def test_last_flush_leaves_nothing_behind_once_the_crawl_keys_are_gone(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario() -> int:
        client = redis.asyncio.Redis.from_url(redis_url)
        script = scripts.register(client, "clusterstats")
        keys = [KEYS.stats, KEYS.workers, KEYS.worker("w1")]
        out = await script(keys=keys, args=["w1", 1, 60, "1", 1, "state", "closed", "sum", "pages", "4"])
        await client.aclose()
        return int(out[0])

    redis_client.hset(KEYS.worker("w1"), "state", "running")
    assert run(scenario()) == -1
    assert redis_client.keys("*") == []


def test_stats_are_kept_while_redis_is_down_and_sent_once_it_is_back(
    redis_servers: Any, redis_client: redis.Redis
) -> None:
    (server,) = redis_servers(1)

    async def scenario() -> None:
        o = make_clusterstats(server.url)
        await o.spider_opened(None)
        o.crawler.stats.inc_value("response_received_count", 3)
        await o.flush()
        server.kill()
        o.crawler.stats.inc_value("response_received_count", 4)
        with pytest.raises(redis.exceptions.ConnectionError):
            await o.flush()
        server.start()  # empty: what the first flush carried is gone with the old server
        o.crawler.stats.inc_value("response_received_count", 5)
        assert await o.flush() == 1  # the failed flush, resent as it was
        assert client.hget(KEYS.stats, "response_received_count") == b"4"
        await o.spider_closed(None, "finished")  # then what came since
        assert client.hget(KEYS.stats, "response_received_count") == b"9"

    client = redis.Redis(port=server.port)
    run(scenario())
    client.close()


# -- heartbeats (pure) ------------------------------------------------------------------------------
def test_rate_meter() -> None:
    r = RateMeter(span=60)
    assert r.per_minute() == 0
    r.add(0, now=0)
    r.add(10, now=0.5)
    assert r.per_minute() == 0  # less than a second of data
    for t in range(1, 121):
        r.add(t * 2, now=t)  # 2 per second
    assert r.per_minute() == pytest.approx(120)


def test_worker_state() -> None:
    assert worker_state({"interval": "1.0"}, last_seen=100, now=102.9, default_interval=5) == "running"
    assert worker_state({"interval": "1.0"}, last_seen=100, now=103.1, default_interval=5) == "lost"
    assert worker_state({}, last_seen=100, now=114, default_interval=5) == "running"
    assert worker_state({}, last_seen=100, now=116, default_interval=5) == "lost"
    assert worker_state({"state": "closed", "interval": "1"}, 100, 1000, 5) == "closed"


def test_error_count() -> None:
    stats = {"spider_exceptions/count": 2, "downloader/exception_count": 3,
             "downloader/response_status_count/500": 4, "downloader/response_status_count/429": 1,
             "downloader/response_status_count/404": 9, "downloader/response_status_count/200": 50}
    assert error_count(stats) == 10


# -- the error monitor --------------------------------------------------------------------------------
def test_http_error_matcher() -> None:
    m = http_error_matcher(["5xx", 429, "403"])
    assert [s for s in (200, 301, 403, 404, 429, 500, 503, 599) if m(s)] == [403, 429, 500, 503, 599]
    with pytest.raises(ScrapyDistError):
        http_error_matcher(["bad"])


def test_error_counts_and_alert_text() -> None:
    c = ErrorCounts(http_error_matcher(["5xx"]), worker="w")
    for i in range(5):
        c.response(500, f"http://x/{i}", now=1.0)
    c.response(200, "http://x/ok", now=1.0)
    c.download_error("TimeoutError", "http://x/slow", now=1.0)
    c.spider_error("ValueError", "http://x/bad", now=1.0)
    counts, examples = c.take()
    assert counts == {"attempts": 7, "errors": 7, "http": 5, "download": 1, "spider": 1,
                      "r:http/500": 5, "r:download/TimeoutError": 1, "r:spider/ValueError": 1}
    assert len(examples) == 5  # at most 3 per reason
    assert json.loads(examples[0]) == {"at": 1.0, "kind": "http", "reason": "http/500", "url": "http://x/0",
                                       "worker": "w"}
    assert c.take() == ({}, [])
    text = format_alert("books", counts, examples, 60, "pause")
    assert "7 errors crawl-wide in the last 60s (100% of 7 attempts)" in text
    assert "http/500: 5 (e.g. http://x/" in text and "download/TimeoutError: 1 (e.g. http://x/slow)" in text
    assert "scrapy-dist resume books" in text


def make_errormonitor(redis_url: str, **settings: Any) -> ErrorMonitor:
    crawler = get_crawler(settings_dict={"REDIS_URL": redis_url, "CLUSTERSTATS_INTERVAL": 3600, **settings})
    crawler.spidercls.name = "books"
    return ErrorMonitor.from_crawler(crawler)


def test_error_monitor_counts_from_signals(redis_url: str) -> None:
    m = make_errormonitor(redis_url)
    ok, bad, failing = Request("http://x/ok"), Request("http://x/500"), Request("http://x/timeout")
    m.response_downloaded(HtmlResponse("http://x/ok", status=200), ok)
    m.request_left_downloader(ok)
    m.response_downloaded(HtmlResponse("http://x/500", status=500), bad)
    m.request_left_downloader(bad)
    try:
        raise TimeoutError("slow")
    except TimeoutError:
        m.request_left_downloader(failing)  # the downloader sends it while the exception is in flight
    try:
        raise KeyError("k")
    except KeyError:
        m.spider_error(Failure(), HtmlResponse("http://x/ok", status=200))
    assert sys.exc_info()[0] is None
    counts, _ = m.events.take()
    assert counts == {"attempts": 3, "errors": 3, "http": 1, "download": 1, "spider": 1,
                      "r:http/500": 1, "r:download/TimeoutError": 1, "r:spider/KeyError": 1}


def test_error_window_trips_once_and_pauses_the_crawl(redis_url: str, redis_client: redis.Redis) -> None:
    async def scenario() -> None:
        w1 = make_errormonitor(redis_url, ERRORMONITOR_MAX_ERRORS=10, ERRORMONITOR_ACTION="pause",
                               ERRORMONITOR_WINDOW=60)
        w2 = make_errormonitor(redis_url, ERRORMONITOR_MAX_ERRORS=10, ERRORMONITOR_ACTION="pause",
                               ERRORMONITOR_WINDOW=60)
        for m in (w1, w2):
            await m.spider_opened(None)
        t = 1_000_000.0
        for i in range(6):
            w1.events.response(500, f"http://x/{i}", t)
            w2.events.response(500, f"http://y/{i}", t)
        assert await w1.flush(now=t) is False  # 6 errors: under the limit
        assert await w2.flush(now=t + 1) is True  # 12: passed, by w2 only
        assert w2.totals["errors"] == 12 and w2.totals["r:http/500"] == 12
        assert h(redis_client, KEYS.control)["paused"] == "1"
        w1.events.response(500, "http://x/again", t + 2)
        assert await w1.flush(now=t + 2) is False  # already paused: no second trip
        assert w1.totals["errors"] == 13
        assert w2.crawler.stats.get_value("errormonitor/tripped") == 1
        # the window slides: a minute later the old buckets are gone
        await w1.flush(now=t + 64)
        assert w1.totals == {}
        assert not [f for f in redis_client.hkeys(KEYS.errors) if not f.startswith(b"_")]
        for m in (w1, w2):
            await m.spider_closed(None, "finished")

    run(scenario())


def test_garbage_in_the_error_window_is_deleted_once_and_trips_nothing(
    redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # a bucket ahead of now never left the window: it tripped the monitor (and paused the crawl) again
    # after every resume; 'inf' made the totals unreadable; 100,000 other fields were read by every flush
    t = 1_000_000.0
    bucket = int(t // 2)  # a 60 s window has 2 s buckets
    redis_client.hset(KEYS.errors, mapping={
        "99999999999|errors": 5000, f"{bucket}|errors": "inf", f"{bucket}|attempts": "1e308",
        f"{bucket - 1}|errors": -7, **{f"junk{i}": 1 for i in range(100_000)},
    })
    redis_client.rpush(KEYS.error_examples, *[json.dumps({"reason": str(i)}) for i in range(10_000)])

    async def scenario() -> None:
        m = make_errormonitor(redis_url, ERRORMONITOR_MAX_ERRORS=10, ERRORMONITOR_ACTION="pause",
                              ERRORMONITOR_WINDOW=60)
        await m.spider_opened(None)
        m.events.response(200, "http://x/", t)
        assert await m.flush(now=t) is False
        assert m.totals == {"attempts": 1}
        assert redis_client.hlen(KEYS.errors) == 3  # _bucket, _window and the one real count
        for i in range(11):
            m.events.response(500, f"http://x/{i}", t + 1)
        assert await m.flush(now=t + 1) is True  # a real trip shows the examples kept, not 10,000
        assert redis_client.hget(KEYS.control, "paused") == b"1"
        await m.spider_closed(None, "finished")

    with caplog.at_level(logging.WARNING, logger="scrapy_dist.extensions.errors"):
        run(scenario())
    assert sum("no worker writes" in r.getMessage() for r in caplog.records) == 1
    assert "Deleted 100003 fields" in caplog.text  # the attempts count was rewritten by the flush itself
    alert = next(r.getMessage() for r in caplog.records if "threshold" in r.getMessage())
    assert alert.count("\n") < 100


def test_error_rate_needs_enough_attempts_and_close_reaches_every_worker(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario() -> None:
        kw = {"ERRORMONITOR_MAX_ERROR_RATE": 0.5, "ERRORMONITOR_ACTION": "close",
              "ERRORMONITOR_MIN_ATTEMPTS": 10}
        w1, w2 = make_errormonitor(redis_url, **kw), make_errormonitor(redis_url, **kw)
        for m in (w1, w2):
            await m.spider_opened(None)
        t = time.time()  # close decisions are compared with the workers' start (server time)
        for i in range(4):
            w1.events.response(503, f"http://x/{i}", t)
        assert await w1.flush(now=t) is False  # 100% but only 4 attempts
        for i in range(6):
            w2.events.response(200 if i % 2 else 503, f"http://y/{i}", t)
        # 7 errors of 10 attempts: 70% > 50%
        assert await w2.flush(now=t) is True
        control = h(redis_client, KEYS.control)
        assert control["close"] == "error_threshold"
        assert ControlState.from_hash(redis_client.hgetall(KEYS.control)).close_reason(w1.started_at) == (
            "error_threshold"
        )
        for m in (w1, w2):
            await m.spider_closed(None, "x")

    run(scenario())


def test_error_monitor_rejects_bad_settings(redis_url: str) -> None:
    # refused at start-up: the monitor is disabled without a word, the crawl's start refused with one line
    crawler = get_crawler(settings_dict={"REDIS_URL": redis_url, "ERRORMONITOR_ACTION": "explode"})
    with pytest.raises(NotConfigured) as info:
        ErrorMonitor.from_crawler(crawler)
    assert not info.value.args  # Scrapy logs a NotConfigured with a message
    error = start_error(crawler)
    assert isinstance(error, ScrapyDistError)
    assert "ERRORMONITOR_ACTION=explode" in str(error)


# -- control flags ------------------------------------------------------------------------------------
def test_close_flags_apply_only_to_workers_started_before_them() -> None:
    c = ControlState.from_hash({b"close": b"finished", b"close_at": b"100.5"})
    assert c.close_reason(started_at=90) == "finished"
    assert c.close_reason(started_at=101) == ""
    assert ControlState().close_reason(0) == ""


def test_pause_and_resume(redis_client: redis.Redis) -> None:
    pause_crawl(redis_client, KEYS.control)
    assert ControlState.from_hash(redis_client.hgetall(KEYS.control)).paused
    redis_client.hset(KEYS.control, mapping={"close": "error_threshold", "close_at": "1"})
    redis_client.hset(KEYS.errors, "1|errors", 100)
    resume_crawl(redis_client, KEYS.control, KEYS.errors)
    state = ControlState.from_hash(redis_client.hgetall(KEYS.control))
    assert not state.paused and not state.close
    assert not redis_client.exists(KEYS.errors)


# -- the idle decision --------------------------------------------------------------------------------
def test_idle_clock() -> None:
    c = IdleClock(2.0)
    assert c.observe(busy=False, now=10) is False
    assert c.observe(busy=False, now=11.9) is False
    assert c.observe(busy=True, now=12) is False  # seeds arrived: start over
    assert c.observe(busy=False, now=13) is False
    assert c.observe(busy=False, now=15) is True


def make_idlemonitor(redis_url: str, **settings: Any) -> IdleMonitor:
    crawler = get_crawler(settings_dict={"REDIS_URL": redis_url, **settings})
    crawler.spidercls.name = "books"
    return IdleMonitor.from_crawler(crawler)


def test_idle_monitor_decides_once_the_frontier_and_seeds_stay_empty(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario() -> None:
        m = make_idlemonitor(redis_url, SCHEDULER_IDLE_BEFORE_CLOSE=2)
        await m.spider_opened(None)
        redis_client.zadd(KEYS.workers, {"worker-1": time.time()})  # its scheduler's heartbeat
        redis_client.rpush(KEYS.start_urls, "http://x/")
        assert await m.check(now=0) == ""
        assert await m.check(now=5) == ""  # seeds waiting: not idle
        redis_client.delete(KEYS.start_urls)
        redis_client.zadd(KEYS.leases, {b"m": 1})
        assert await m.check(now=6) == ""
        redis_client.delete(KEYS.leases)
        assert await m.check(now=7) == ""  # the clock starts
        assert await m.check(now=8.5) == ""
        assert await m.check(now=9) == "finished"  # no engine to close here; the flag is set
        assert h(redis_client, KEYS.control)["close"] == "finished"
        # a second worker started before the decision closes on the flag alone
        other = make_idlemonitor(redis_url, SCHEDULER_IDLE_BEFORE_CLOSE=0)
        other.started_at = 0.0
        other.redis = m.redis
        assert await other.check(now=0) == "finished"
        # a worker started after it does not
        late = make_idlemonitor(redis_url, SCHEDULER_IDLE_BEFORE_CLOSE=0)
        await late.spider_opened(None)
        assert await late.check(now=0) == ""
        await late.spider_closed(None, "x")
        await m.spider_closed(None, "x")

    run(scenario())


def test_a_seeds_key_of_another_type_does_not_stop_the_idle_monitor(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def scenario() -> tuple[int, bool]:
        m = make_idlemonitor(redis_url, SCHEDULER_IDLE_BEFORE_CLOSE=1)  # expects a LIST
        await m.spider_opened(None)
        redis_client.sadd(KEYS.start_urls, "http://x/")
        redis_client.zadd(KEYS.queue, {b"q": 0})
        redis_client.hset(KEYS.control, "paused", "1")
        work, control = await m.read()
        await m.spider_closed(None, "x")
        return work, control.paused

    assert run(scenario()) == (1, True)


def test_idle_script_refuses_while_the_frontier_holds_work(redis_url: str, redis_client: redis.Redis) -> None:
    script = scripts.register(redis_client, "idle")
    keys = [KEYS.queue, KEYS.leases, KEYS.delayed, KEYS.control, KEYS.workers]
    redis_client.zadd(KEYS.workers, {"worker-1": 1})
    redis_client.zadd(KEYS.delayed, {b"m": 1})
    assert script(keys=keys, args=["finished", "0"])[0] == 0
    assert not redis_client.exists(KEYS.control)
    redis_client.delete(KEYS.delayed)
    assert script(keys=keys, args=["finished", "0"])[0] == 1
    decided, reason, _ = script(keys=keys, args=["finished", "0"])
    assert (decided, reason) == (0, b"finished")  # already decided


def test_idle_script_writes_nothing_once_the_last_worker_has_left(redis_client: redis.Redis) -> None:
    # A poll racing the last worker's finish (which deleted every key of the crawl) must not
    # recreate the control hash: a crawl with no registered worker has ended.
    script = scripts.register(redis_client, "idle")
    keys = [KEYS.queue, KEYS.leases, KEYS.delayed, KEYS.control, KEYS.workers]
    assert script(keys=keys, args=["finished", "0"])[0] == 0
    assert not redis_client.exists(KEYS.control)


# -- the add-on ---------------------------------------------------------------------------------------
def addon_settings(user: dict[str, Any]) -> Settings:
    from scrapy.settings import Settings

    s = Settings()  # Scrapy's defaults at "default" priority
    s.setdict(user, priority="project")
    Addon().update_settings(s)
    return s


def test_addon_fills_in_defaults() -> None:
    from scrapy_dist.middlewares.retry import HttpErrorMiddleware, RetryMiddleware

    s = addon_settings({})
    assert s["SCHEDULER"] == "scrapy_dist.scheduler.Scheduler"
    assert s["DUPEFILTER_CLASS"] == "scrapy_dist.dupefilter.BloomDupeFilter"
    assert s.getpriority("SCHEDULER") == 15
    ext = s.getdict("EXTENSIONS")
    assert {ClusterStats, IdleMonitor, ErrorMonitor} <= set(ext)
    dl = s.getdict("DOWNLOADER_MIDDLEWARES")
    assert dl[RetryMiddleware] == 550
    assert None in dl.values()  # Scrapy's retry middleware switched off
    assert s.getdict("SPIDER_MIDDLEWARES")[HttpErrorMiddleware] == 50


def test_addon_never_overrides_the_user() -> None:
    s = addon_settings({
        "SCHEDULER": "myproject.MyScheduler",
        "EXTENSIONS": {"scrapy_dist.extensions.IdleMonitor": None},
        "DOWNLOADER_MIDDLEWARES": {"scrapy.downloadermiddlewares.retry.RetryMiddleware": None},
    })
    assert s["SCHEDULER"] == "myproject.MyScheduler"
    assert s["DUPEFILTER_CLASS"] == "scrapy_dist.dupefilter.BloomDupeFilter"
    ext = s.getdict("EXTENSIONS")
    assert ext["scrapy_dist.extensions.IdleMonitor"] is None
    assert ClusterStats in ext and IdleMonitor not in ext
    # retries switched off by the user stay off: ours is not added
    dl = s.getdict("DOWNLOADER_MIDDLEWARES")
    assert dl["scrapy.downloadermiddlewares.retry.RetryMiddleware"] is None
    assert not any("retry" in getattr(k, "__module__", str(k)) for k, v in dl.items() if v is not None)


@pytest.mark.parametrize("kept", ["scrapy_redis.scheduler.Scheduler", "scrapy.core.scheduler.Scheduler",
                                  "myproject.MyScheduler"])
def test_addon_warns_once_when_the_project_keeps_a_scheduler_of_its_own(
    caplog: pytest.LogCaptureFixture, kept: str
) -> None:
    with caplog.at_level(logging.WARNING, logger="scrapy_dist.addon"):
        addon_settings({"SCHEDULER": kept})
    lines = [r.getMessage() for r in caplog.records if "SCHEDULER" in r.getMessage()]
    assert len(lines) == 1 and repr(kept) in lines[0] and "does not share its frontier" in lines[0], lines


def test_addon_says_nothing_of_a_scrapy_dist_scheduler(caplog: pytest.LogCaptureFixture) -> None:
    from scrapy_dist.frontier.scheduler import Scheduler

    class Mine(Scheduler):
        pass

    for user in ({}, {"SCHEDULER": "scrapy_dist.scheduler.Scheduler"}, {"SCHEDULER": Mine}):
        with caplog.at_level(logging.WARNING, logger="scrapy_dist.addon"):
            addon_settings(user)
    assert not [r for r in caplog.records if "SCHEDULER" in r.getMessage()]


@pytest.mark.slow
def test_scrapy_parse_and_fetch_with_the_addon_stay_out_of_the_shared_crawl(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis, site_factory: Any
) -> None:
    # they joined the crawl: `scrapy parse` recorded its URL in the crawl-wide dupefilter (the crawl then
    # skipped it, and the next `scrapy parse` of it got "No response downloaded"); their callbacks, not
    # spider methods, logged an ERROR each
    from crawlproject import make_project

    site = site_factory(pages=5)
    make_project(tmp_path)
    url = site.page_url(1)
    env = {**os.environ, "PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("SCRAPY_SETTINGS_MODULE", None)
    env.pop("REDIS_URL", None)
    settings = ["-s", 'ADDONS={"scrapy_dist.Addon": 0}', "-s", f"REDIS_URL={redis_url}"]
    commands = [["parse", "--spider", "links", "-c", "parse", url]] * 2 + [["fetch", url]]
    for command in commands:
        out = Zygote.run_cli([sys.executable, "-m", "scrapy", *command, *settings], cwd=tmp_path, env=env,
                             timeout=60)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "] ERROR:" not in out.stderr, out.stderr[-3000:]
        assert f"off for `scrapy {command[0]}`" in out.stderr
        assert (f"'url': '{url}'" if command[0] == "parse" else "<html") in out.stdout, out.stderr[-3000:]
    assert redis_client.keys("*") == []
