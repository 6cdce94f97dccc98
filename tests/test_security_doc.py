"""The Redis ACL example of docs/security.md, run against a real redis-server: a seed pusher can push
seeds (with redis-cli's commands and with ``scrapy-dist push``) and nothing else; a worker can reach the
frontier but not the server's administration."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner
from redis_servers import RedisProcess

from scrapy_dist.cli import main

DOC = Path(__file__).resolve().parent.parent / "docs" / "security.md"


def acl_lines() -> dict[str, list[str]]:
    """user name -> the ACL SETUSER arguments given in the doc."""
    out = {}
    for line in DOC.read_text().splitlines():
        words = line.split()
        if words[:2] == ["ACL", "SETUSER"]:
            out[words[2]] = words
    return out


@pytest.fixture
def acl_server(redis_servers: Callable[..., list[RedisProcess]]) -> RedisProcess:
    (server,) = redis_servers(1)
    admin = redis.Redis(port=server.port)
    lines = acl_lines()
    assert set(lines) == {"links-worker", "links-seeder"}
    for words in lines.values():
        assert admin.execute_command(*words) == b"OK"
    admin.close()
    return server


def _denied(call: Callable[[], object]) -> bool:
    try:
        call()
    except redis.exceptions.NoPermissionError:
        return True
    return False


def test_the_seeder_can_push_seeds_and_touch_nothing_else(acl_server: RedisProcess) -> None:
    seeder = redis.Redis(port=acl_server.port, username="links-seeder", password="seeder-password")
    assert seeder.lpush("links:start_urls", "https://example.com/") == 1
    assert seeder.rpush("links:start_urls", '{"url": "https://example.com/b"}') == 2
    assert seeder.type("links:start_urls") == b"list"
    assert seeder.ping()
    assert _denied(lambda: seeder.zadd("{links}:queue", {b"\0" * 6 + b"\x01x": 0}))
    assert _denied(lambda: seeder.lrange("links:start_urls", 0, -1))  # cannot read what others pushed
    assert _denied(lambda: seeder.delete("links:start_urls"))
    assert _denied(lambda: seeder.lpush("{links}:deadletter", "x"))
    assert _denied(lambda: seeder.hset("{links}:control", "paused", "1"))
    assert _denied(lambda: seeder.lpush("other:start_urls", "https://example.com/"))
    assert _denied(lambda: seeder.eval("return redis.call('ZADD', KEYS[1], 0, 'x')", 1, "{links}:queue"))
    assert _denied(lambda: seeder.flushall())
    # the CLI pushes as this user too (TYPE check, PING, pipelined RPUSH)
    url = f"redis://links-seeder:seeder-password@127.0.0.1:{acl_server.port}/0"
    result = CliRunner().invoke(
        main, ["--redis-url", url, "push", "links", "https://example.com/c"], env={"REDIS_URL": None}
    )
    assert result.exit_code == 0, result.output
    admin = redis.Redis(port=acl_server.port)
    assert admin.llen("links:start_urls") == 3 and not admin.exists("{links}:queue")


def test_the_worker_reaches_the_frontier_not_the_administration(acl_server: RedisProcess) -> None:
    worker = redis.Redis(port=acl_server.port, username="links-worker", password="worker-password")
    assert worker.zadd("{links}:queue", {b"x": 0}) == 1
    assert worker.eval("return redis.call('ZCARD', KEYS[1])", 1, "{links}:queue") == 1
    assert worker.lpush("links:start_urls", "x") == 1 and worker.lpop("links:start_urls") == b"x"
    assert worker.lpush("{links:start_urls}:processing", "x") == 1
    assert _denied(lambda: worker.get("{other}:queue"))
    assert _denied(lambda: worker.flushall())
    assert _denied(lambda: worker.config_get("*"))
    assert _denied(lambda: worker.execute_command("ACL", "LIST"))
