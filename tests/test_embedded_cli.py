"""`scrapy-dist embedded status|stop`, `scrapy-dist redis-cli ...` and the embedded Redis' start-up
warning (the embedded default fits the `redis-cli lpush` workflow)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from redis_servers import RedisProcess
from zygote import Zygote

from scrapy_dist.cli import redis_cli_arguments
from scrapy_dist.redis.connection import resolve_target
from scrapy_dist.redis.embedded import EmbeddedRedis

SCRAPY_DIST = str(Path(sys.executable).with_name("scrapy-dist"))


@pytest.fixture
def outside(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    EmbeddedRedis(tmp_path / ".scrapy" / "scrapy_dist").shutdown(save=False)


def run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "SCRAPY_SETTINGS_MODULE")}
    return Zygote.run_cli([SCRAPY_DIST, *args], cwd=cwd, env=env, timeout=60)


def test_embedded_status_redis_cli_and_stop(outside: Path) -> None:
    # a project: outside one, `scrapy-dist redis-cli` refuses to start a fresh embedded Redis
    (outside / "scrapy.cfg").write_text("[settings]\ndefault = embproj.settings\n")
    (outside / "embproj").mkdir()
    (outside / "embproj" / "__init__.py").write_text("")
    (outside / "embproj" / "settings.py").write_text('BOT_NAME = "embproj"\n')
    status = run(outside, "embedded", "status")
    assert status.returncode == 0 and "not running" in status.stdout
    pushed = run(outside, "redis-cli", "lpush", "shop:start_urls", "https://example.com/")
    assert pushed.returncode == 0 and pushed.stdout.strip() == "1", pushed
    status = run(outside, "embedded", "status")
    # in the state directory, unless that path is too long for a socket (then a private runtime dir)
    sock = EmbeddedRedis(outside / ".scrapy" / "scrapy_dist").socket_path
    assert "running (pid" in status.stdout and f"redis-cli -s {sock}" in status.stdout
    # The plain redis-cli command it prints works as printed.
    cli = EmbeddedRedis(outside / ".scrapy" / "scrapy_dist")
    plain = subprocess.run([str(Path(sys.executable).with_name("redis-cli")), "-s", str(sock), "lrange",
                            "shop:start_urls", "0", "-1"], capture_output=True, text=True, timeout=30)
    assert plain.stdout.strip() == "https://example.com/"
    stop = run(outside, "embedded", "stop")
    assert "Stopped the embedded Redis" in stop.stdout
    assert cli.url() is None
    assert "No embedded Redis running" in run(outside, "embedded", "stop").stdout


def test_embedded_status_in_a_dir_of_another_user_is_one_line(outside: Path) -> None:
    directory = outside / ".scrapy" / "scrapy_dist"
    directory.mkdir(parents=True)
    os.chown(directory, 54321, 54321)
    result = run(outside, "embedded", "status")
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "uid 54321" in result.stderr
    assert "Traceback" not in result.stderr


def test_redis_cli_gets_the_password_by_environment(redis_url: str, redis_client: redis.Redis) -> None:
    redis_client.acl_setuser("cli-user", enabled=True, passwords=["+pa#ss/w?rd"], keys=["*"],
                             commands=["+@all"])
    try:
        url = redis_url.replace("redis://", "redis://cli-user:pa%23ss%2Fw%3Frd@")
        args, env = redis_cli_arguments(url)
        assert "pa#ss/w?rd" not in " ".join(args) and env == {"REDISCLI_AUTH": "pa#ss/w?rd"}
        assert "--user" in args and "-n" in args
        result = run(Path.cwd(), "--redis-url", url, "redis-cli", "ping")
        assert result.stdout.strip() == "PONG", result
    finally:
        redis_client.acl_deluser("cli-user")


def test_redis_cli_uses_the_user_password_and_db_of_redis_params(
    tmp_path: Path, redis_servers: Callable[..., list[RedisProcess]]
) -> None:
    # a scrapy-redis project puts them in REDIS_PARAMS: `scrapy-dist redis-cli` got
    # "SELECT 9 failed: NOAUTH Authentication required" where the workers connected
    (server,) = redis_servers(1)
    with redis.Redis(port=server.port) as admin:
        admin.config_set("requirepass", "s3cret")
    (tmp_path / "scrapy.cfg").write_text("[settings]\ndefault = paramsproj\n")
    (tmp_path / "paramsproj.py").write_text(
        f'REDIS_HOST = "127.0.0.1"\nREDIS_PORT = {server.port}\n'
        'REDIS_PARAMS = {"password": "s3cret", "db": 9}\n'
    )
    result = run(tmp_path, "redis-cli", "set", "test_embedded_cli:params", "here")
    assert result.stdout.strip() == "OK", result
    other = redis.Redis(port=server.port, db=9, password="s3cret")
    assert other.get("test_embedded_cli:params") == b"here"
    other.close()


def test_workers_warn_that_the_embedded_crawl_is_confined_to_this_machine(
    outside: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SCRAPY_SETTINGS_MODULE", "unset")
    monkeypatch.delenv("SCRAPY_SETTINGS_MODULE")
    monkeypatch.chdir(outside)
    with caplog.at_level(logging.WARNING, logger="scrapy_dist.redis.connection"):
        resolve_target({})
    (message,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "confined to this machine" in message and "REDIS_URL" in message
    assert f"redis-cli -s {EmbeddedRedis(outside / '.scrapy' / 'scrapy_dist').socket_path} lpush" in message
