"""Scripts validate before they write: the housekeeping scripts against hostile values, called
directly on a real Redis. A bad value is repaired, or the call is refused with nothing written."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from scrapy_dist.redis import scripts


def test_idle_overwrites_a_garbage_close_at(redis_client: Any) -> None:
    redis_client.hset("c", mapping={"close": "finished", "close_at": "\x1b[2Jsoon"})
    redis_client.zadd("w", {"worker-1": 1})
    idle = scripts.register(redis_client, "idle")
    decided, reason, _ = idle(keys=["q", "l", "d", "c", "w"], args=["finished", 100])
    assert decided == 1 and reason == b"finished"
    assert float(redis_client.hget("c", "close_at")) > 100


def test_clusterstats_repairs_garbage_instead_of_failing_half_way(redis_client: Any) -> None:
    redis_client.hset("stats", mapping={"a": "1", "b": "not a number"})
    redis_client.hset("worker", "flush_seq", "garbage")
    script = scripts.register(redis_client, "clusterstats")
    ops = ["sum", "a", "2", "sum", "b", "3", "sum", "c", "nan", "sum", "d", "1.5"]
    applied, _, garbage = script(keys=["stats", "workers", "worker"], args=["w1", 1, 60, "0", 0, *ops])
    assert applied == 1 and garbage == 1
    assert redis_client.hgetall("stats") == {b"a": b"3", b"b": b"3", b"d": b"1.5"}
    assert redis_client.hget("worker", "flush_seq") == b"1"
    applied, _, garbage = script(keys=["stats", "workers", "worker"], args=["w1", 1, 60, "0", 0, *ops])
    # a resent flush counts once
    assert applied == 0 and garbage == 0 and redis_client.hget("stats", "a") == b"3"


def test_errors_window_survives_garbage_counters(redis_client: Any) -> None:
    script = scripts.register(redis_client, "errors")
    args = [1000, 10, 60, "", "", 1, "log", 5]
    script(keys=["win", "ex", "ctl"], args=[*args, 1, "errors", 1])
    redis_client.hset("win", "100|errors", "lots")
    redis_client.hset("win", "100|attempts", "\xff")
    _, _, totals, _, _, _ = script(keys=["win", "ex", "ctl"], args=[*args, 2, "errors", 2, "attempts", 4])
    got = dict(zip(totals[::2], totals[1::2], strict=True))
    assert got[b"errors"] == b"2" and got[b"attempts"] == b"4"


def test_errors_window_examples_or_control_of_another_type_are_moved_aside(redis_client: Any) -> None:
    """Before, each of them failed every call: the crawl-wide error monitor was off while they stayed."""
    script = scripts.register(redis_client, "errors")
    redis_client.set("win", "someone's")
    redis_client.hset("ex", "a", "b")
    redis_client.sadd("ctl", "x")
    tripped, _, totals, control, _, _ = script(
        keys=["win", "ex", "ctl"], args=[1000, 10, 60, 1, "", 1, "pause", 5, 1, "errors", 3, '{"k": 1}']
    )
    assert tripped == 1 and dict(zip(totals[::2], totals[1::2], strict=True))[b"errors"] == b"3"
    assert control[2] == b"1" and redis_client.hget("ctl", "paused") == b"1"  # the action was taken
    assert redis_client.lrange("ex", 0, -1) == [b'{"k": 1}']
    assert redis_client.get("win:garbage") == b"someone's"
    assert redis_client.hgetall("ex:garbage") == {b"a": b"b"}
    assert redis_client.smembers("ctl:garbage") == {b"x"}


def test_clusterstats_keys_of_another_type_are_moved_aside(redis_client: Any) -> None:
    """Before, the crawl-wide stats (a stats key of another type) or the heartbeat (workers) stopped."""
    script = scripts.register(redis_client, "clusterstats")
    redis_client.set("stats", "x")
    redis_client.hset("workers", "a", "b")
    redis_client.rpush("worker", "l")
    redis_client.set("history", "h")
    applied, _, _ = script(keys=["stats", "workers", "worker", "history"],
                           args=["w1", 1, 60, "0", 0, "sum", "pages", "2"])
    assert applied == 1
    assert redis_client.hget("stats", "pages") == b"2" and redis_client.zscore("workers", "w1") is not None
    assert redis_client.hget("worker", "flush_seq") == b"1" and redis_client.xlen("history") == 1
    assert {k for k in redis_client.keys("*:garbage")} == {
        b"stats:garbage", b"workers:garbage", b"worker:garbage", b"history:garbage"
    }


def test_finish_writes_nothing_when_a_key_has_the_wrong_type(redis_client: Any) -> None:
    redis_client.zadd("workers", {"w1": 1e12})
    redis_client.set("queue", "a string")
    with pytest.raises(redis.ResponseError):
        scripts.register(redis_client, "finish")(keys=["workers", "queue", "l", "d"], args=["w1", 60])
    assert redis_client.zscore("workers", "w1") == 1e12


def test_seeds_take_moves_a_processing_key_of_the_wrong_type_aside_before_popping(redis_client: Any) -> None:
    """Refused (nothing popped), it stopped every worker's seeds until someone deleted it by hand."""
    redis_client.rpush("seeds", "https://a.example/", "https://b.example/")
    redis_client.set("processing", "a string")
    status, taken, _, _, _, repaired, _ = scripts.register(redis_client, "seeds_take")(
        keys=["seeds", "processing", "workers"],
        args=["", "w1", 60, "list", 2, "take", "0", 5, 86400, 10000],
    )
    assert status == b"ok" and repaired == [b"processing"] and redis_client.get("processing:garbage")
    assert redis_client.lrange("processing", 0, -1) == [b"w1\n" + e for e in taken] and len(taken) == 2


def test_items_xadd_refuses_a_wrong_type_before_writing(redis_client: Any) -> None:
    redis_client.set("items", "x")
    with pytest.raises(redis.ResponseError, match="STREAM"):
        scripts.register(redis_client, "items_xadd")(keys=["items"], args=["", "item", "a", "b"])
