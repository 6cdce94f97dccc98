"""``scrapy-dist dead``: listing, requeueing and purging dead letters in a real Redis, and a requeue that
real ``scrapy crawl`` workers then crawl again."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from crawlproject import make_project
from helpers import queue_singles
from scrapy import Request, Spider
from test_retry import E2E_SETTINGS, SPIDERS, FailingSite, items

from scrapy_dist.cli import main
from scrapy_dist.frontier.orders import dead_letter_record, parse_record
from scrapy_dist.frontier.shard import SEQ_BYTES
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.wire.codec import decode_request

KEYS = CrawlKeys("retry")


#: a wide table (URLs unfolded); no project settings leaked by another test (REDIS_KEY_PREFIX ...)
ENV = {"COLUMNS": "200", "SCRAPY_SETTINGS_MODULE": None}


def run(redis_url: str, *args: str) -> Any:
    args = ("--redis-url", redis_url, "dead", "retry", *args)
    result = CliRunner().invoke(main, list(args), env=ENV)
    assert result.exit_code == 0, (result.output, result.exception)
    return result


@pytest.fixture
def letters(redis_client: redis.Redis) -> list[str]:
    """Four records (500 x2, a timeout, one without payload) and a malformed one, in the dead-letter list."""
    records = [
        dead_letter_record(
            Request("https://e.com/a", meta={"retry_times": 2, "keep": 1}, priority=5),
            reason="500",
            worker="w1",
            status=500,
            now=1000.0,
        ),
        dead_letter_record(
            Request("https://e.com/t", meta={"retry_times": 2}),
            reason="twisted.internet.error.TimeoutError",
            worker="w2",
            detail="took too long",
            now=1001.0,
        ),
        dead_letter_record(
            Request("https://e.com/b", meta={"retry_times": 2}), reason="500", worker="w1", status=500
        ),
        dead_letter_record(
            Request("https://e.com/x", meta={"o": object()}),
            reason="builtins.ValueError",
            worker="w1",
            status=200,
        ),
    ]
    redis_client.rpush(KEYS.deadletter, *records[:2], b"{not json", *records[2:])
    return records


def test_lists_a_table_with_counts_per_reason(redis_url: str, letters: list[str]) -> None:
    out = run(redis_url).output
    for text in ("https://e.com/a", "https://e.com/t", "TimeoutError", "w2", "not requeueable"):
        assert text in out
    assert "4 dead letters" in out and "500: 2" in out


def test_json_lines_and_reason_filter(redis_url: str, letters: list[str]) -> None:
    lines = [json.loads(line) for line in run(redis_url, "--json").stdout.splitlines()]
    assert [d["url"] for d in lines] == [
        "https://e.com/a",
        "https://e.com/t",
        "https://e.com/b",
        "https://e.com/x",
    ]
    assert lines[0]["attempts"] == 3 and lines[0]["status"] == 500 and lines[0]["index"] == 0
    assert lines[1]["detail"] == "took too long" and lines[3]["request"] is None
    timeouts = run(redis_url, "--json", "--reason", "TimeoutError").stdout.splitlines()
    assert [json.loads(line)["url"] for line in timeouts] == ["https://e.com/t"]


def test_requeue_by_reason_resets_retries_and_keeps_the_rest(
    redis_url: str, redis_client: redis.Redis, letters: list[str]
) -> None:
    result = run(redis_url, "--requeue", "--reason", "500")
    assert "requeued 2" in result.stdout
    queued = [
        (s, score)
        for m, score in redis_client.zrange(KEYS.queue, 0, -1, withscores=True)
        for s in queue_singles(m)
    ]
    requests = [decode_request(m[SEQ_BYTES:], Spider("retry")) for m, _ in queued]
    assert [r.url for r in requests] == ["https://e.com/a", "https://e.com/b"]  # priority 5 first
    assert [score for _, score in queued] == [-5, 0]
    assert requests[0].meta == {"keep": 1} and "retry_times" not in requests[1].meta
    left = redis_client.lrange(KEYS.deadletter, 0, -1)
    assert left == [letters[1].encode(), b"{not json", letters[3].encode()]
    assert redis_client.zcard(KEYS.workers) == 0  # the command does not pose as a worker


def test_requeue_keeps_records_it_cannot_requeue(
    redis_url: str, redis_client: redis.Redis, letters: list[str]
) -> None:
    result = run(redis_url, "--requeue")
    assert "requeued 3" in result.stdout and "1 kept" in result.stdout
    assert "cannot be requeued" in result.stderr and "malformed" in result.stderr
    assert sum(len(queue_singles(m)) for m in redis_client.zrange(KEYS.queue, 0, -1)) == 3
    assert [parse_record(r).url for r in redis_client.lrange(KEYS.deadletter, 1, -1)] == ["https://e.com/x"]


def test_purge(redis_url: str, redis_client: redis.Redis, letters: list[str]) -> None:
    assert "purged 2" in run(redis_url, "--purge", "--reason", "500").stdout
    assert redis_client.llen(KEYS.deadletter) == 3
    assert "purged 3" in run(redis_url, "--purge").stdout
    assert not redis_client.exists(KEYS.deadletter)


def test_requeue_and_purge_together_is_refused(redis_url: str) -> None:
    args = ["--redis-url", redis_url, "dead", "retry", "--requeue", "--purge"]
    result = CliRunner().invoke(main, args, env=ENV)
    assert result.exit_code == 2 and "cannot be combined" in result.output


def test_a_negative_limit_is_refused(redis_url: str, letters: list[str]) -> None:
    # --limit -1 showed an empty table "showing the last 0"
    result = CliRunner().invoke(main, ["--redis-url", redis_url, "dead", "retry", "--limit", "-1"], env=ENV)
    assert result.exit_code == 2 and "--limit" in result.output, result.output


@pytest.fixture
def failing_site() -> Iterator[FailingSite]:
    with FailingSite() as site:
        yield site


@pytest.mark.slow
def test_requeued_dead_letters_are_crawled_again(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis, failing_site: FailingSite
) -> None:
    site = failing_site
    late, never, other = "/flaky/late?fail=3&status=500", "/always500/z", "/notfound/noeb/gone"
    project = make_project(tmp_path, {"REDIS_URL": redis_url, **E2E_SETTINGS}, spiders=SPIDERS)
    project.crawl("retry", {"urls": ",".join(site.url(p) for p in (late, never, other))})
    assert project.wait_all(60) == [0], project.logs()[-3000:]
    assert site.statuses(late) == [500] * 3 and redis_client.llen(KEYS.deadletter) == 3

    assert "requeued 2" in run(redis_url, "--requeue", "--reason", "500").stdout
    assert [parse_record(r).reason for r in redis_client.lrange(KEYS.deadletter, 0, -1)] == ["404"]
    project.crawl("retry")
    assert project.wait_all(60) == [0, 0], project.logs()[-3000:]

    assert site.statuses(late) == [500, 500, 500, 200]  # crawled again, and this time it worked
    assert [i["url"] for i in items(tmp_path) if i.get("status") == 200] == [site.url(late)]
    # the always-failing URL got a fresh set of attempts (its retry counter was reset) and is back
    assert site.statuses(never) == [500] * 6
    again = [parse_record(r) for r in redis_client.lrange(KEYS.deadletter, 0, -1)]
    assert [(d.reason, d.attempts) for d in again] == [("404", 1), ("500", 3)]
    assert site.statuses(other) == [404]
