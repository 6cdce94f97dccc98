"""scrapy_dist.redis.connection and scrapy_dist.redis.embedded against real redis-server processes."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from helpers import run, wait_for
from redis.backoff import NoBackoff
from redis.connection import SSLConnection, UnixDomainSocketConnection
from redis.retry import Retry
from redis_servers import RedisProcess, cluster_port, free_port, redis_server_binary
from scrapy.settings import Settings
from scrapy.utils.test import get_crawler
from zygote import Zygote

from scrapy_dist.exceptions import RedisUnavailable
from scrapy_dist.redis.connection import (
    check_reachable,
    check_reachable_async,
    ensure_reachable,
    get_async_redis,
    get_redis,
    is_cluster,
    mask_url,
    resolve_target,
    resolve_url,
)
from scrapy_dist.redis.embedded import EmbeddedRedis, embedded_dir
from scrapy_dist.settings.reader import start_error
from scrapy_dist.settings.values import SettingsError

# -- URLs and settings ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("redis://localhost:6379/0", "redis://localhost:6379/0"),
        ("redis://:s3cret@h:1/2", "redis://:***@h:1/2"),
        ("redis://alice:s3cret@h:1/2", "redis://alice:***@h:1/2"),
        ("redis://alice@h:1/2", "redis://alice@h:1/2"),
        ("rediss://alice:s3cret@cache.example.com:6380/5", "rediss://alice:***@cache.example.com:6380/5"),
        ("unix://:s3cret@/run/redis.sock?db=3", "unix://:***@/run/redis.sock?db=3"),
        ("unix:///run/redis.sock?db=3", "unix:///run/redis.sock?db=3"),
        ("redis://:p%40ss@h:1/0", "redis://:***@h:1/0"),
        ("redis://:a@b@h:1/0", "redis://:***@h:1/0"),
        ("redis://h:1/0?password=s3cret&db=1", "redis://h:1/0?password=***&db=1"),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked
    assert "s3cret" not in mask_url(url)


def test_redis_url_wins_over_host_and_port() -> None:
    target = resolve_target({"REDIS_URL": "redis://u:pw@h1:7000/3", "REDIS_HOST": "h2", "REDIS_PORT": 7001})
    assert target.url == "redis://u:pw@h1:7000/3"
    assert target.setting == "REDIS_URL"
    assert target.masked_url == "redis://u:***@h1:7000/3"


@pytest.mark.parametrize(
    ("settings", "url"),
    [
        ({"REDIS_HOST": "redis.internal", "REDIS_PORT": 6380}, "redis://redis.internal:6380/0"),
        ({"REDIS_HOST": "redis.internal"}, "redis://redis.internal:6379/0"),
        ({"REDIS_PORT": "6390"}, "redis://localhost:6390/0"),
    ],
)
def test_scrapy_redis_host_and_port(settings: dict[str, object], url: str) -> None:
    assert resolve_url(Settings(settings)) == url
    assert resolve_target(settings).setting == "REDIS_HOST/REDIS_PORT"


def test_redis_host_and_port_reach_a_server(redis_server: RedisProcess) -> None:
    client = get_redis(Settings({"REDIS_HOST": "127.0.0.1", "REDIS_PORT": redis_server.port}))
    try:
        assert client.ping() is True
    finally:
        client.close()


def _writes_land_in_db(client: redis.Redis, port: int, db: int) -> None:
    """A write through ``client`` is read back from database ``db`` of the server on ``port``."""
    other = redis.Redis(port=port, db=db)
    try:
        client.set("test_connection:db", f"in {db}")
        assert other.get("test_connection:db") == f"in {db}".encode()
    finally:
        other.delete("test_connection:db")
        other.close()
        client.close()


def test_redis_params_db_applies_to_host_and_port(redis_server: RedisProcess) -> None:
    # scrapy-redis builds Redis(host=..., port=..., **REDIS_PARAMS): its db is the one used. A worker
    # that wrote to db 0 instead would never see the seeds pushed to that db.
    settings = {"REDIS_HOST": "127.0.0.1", "REDIS_PORT": redis_server.port, "REDIS_PARAMS": {"db": 6}}
    assert resolve_target(settings).url == f"redis://127.0.0.1:{redis_server.port}/6"
    _writes_land_in_db(get_redis(Settings(settings)), redis_server.port, 6)


def test_url_with_db_selects_the_database(redis_server: RedisProcess) -> None:
    url = f"redis://127.0.0.1:{redis_server.port}/7"
    _writes_land_in_db(get_redis({"REDIS_URL": url}), redis_server.port, 7)


@pytest.mark.parametrize(
    ("located", "db"),
    [
        ({"REDIS_HOST": "127.0.0.1"}, 5),
        ({"REDIS_URL": "redis://127.0.0.1:{port}"}, 5),
        ({"REDIS_URL": "redis://127.0.0.1:{port}/4"}, 4),  # a URL's own db wins, as in scrapy-redis
    ],
)
def test_redis_db_selects_the_database_as_in_scrapy_redis(
    redis_server: RedisProcess, located: dict[str, str], db: int
) -> None:
    # scrapy-redis's REDIS_DB was silently ignored: the crawl used db 0
    settings: dict[str, object] = {k: v.format(port=redis_server.port) for k, v in located.items()}
    settings.update(REDIS_PORT=redis_server.port, REDIS_DB="5", REDIS_PARAMS={"db": 6})
    if "REDIS_URL" in settings:
        del settings["REDIS_PORT"]
    _writes_land_in_db(get_redis(Settings(settings)), redis_server.port, db)


def test_redis_params_host_and_port_locate_redis_as_in_scrapy_redis(redis_server: RedisProcess) -> None:
    # scrapy-redis builds Redis(**REDIS_PARAMS): a project with only REDIS_PARAMS = {"host": ..., "port":
    # ...} silently used the embedded Redis instead
    settings = {"REDIS_PARAMS": {"host": "127.0.0.1", "port": str(redis_server.port), "db": 3}}
    target = resolve_target(settings)
    assert target.url == f"redis://127.0.0.1:{redis_server.port}/3"
    client = get_redis(Settings(settings))
    try:
        assert client.ping() is True
    finally:
        client.close()
    with pytest.raises(SettingsError, match=r"REDIS_PARAMS\['port'\]=x: not an integer"):
        resolve_target({"REDIS_PARAMS": {"host": "127.0.0.1", "port": "x"}})


@pytest.fixture
def acl_server(redis_servers: Callable[..., list[RedisProcess]]) -> RedisProcess:
    """A server where user ``alice`` (password ``wonder land``) exists and ``default`` needs ``topsecret``."""
    (server,) = redis_servers(1)
    admin = redis.Redis(port=server.port)
    admin.execute_command("ACL", "SETUSER", "alice", "on", ">wonder land", "~*", "+@all")
    admin.config_set("requirepass", "topsecret")
    admin.close()
    return server


def test_url_with_user_and_password(acl_server: RedisProcess) -> None:
    client = get_redis({"REDIS_URL": f"redis://alice:wonder%20land@127.0.0.1:{acl_server.port}/2"})
    try:
        assert client.execute_command("ACL", "WHOAMI") == b"alice"
        assert client.client_info()["db"] == 2
    finally:
        client.close()


def test_url_with_password_only(acl_server: RedisProcess) -> None:
    client = get_redis({"REDIS_URL": f"redis://:topsecret@127.0.0.1:{acl_server.port}/0"})
    try:
        assert client.execute_command("ACL", "WHOAMI") == b"default"
    finally:
        client.close()


def test_wrong_password_is_reported_without_the_password(acl_server: RedisProcess) -> None:
    url = f"redis://:wrongpass@127.0.0.1:{acl_server.port}/0"
    with pytest.raises(RedisUnavailable) as info:
        check_reachable({"REDIS_URL": url})
    message = str(info.value)
    assert f"redis://:***@127.0.0.1:{acl_server.port}/0" in message
    assert "wrongpass" not in message


@pytest.fixture
def unix_server(redis_servers: Callable[..., list[RedisProcess]]) -> Iterator[str]:
    # Socket paths are limited to ~100 bytes: keep it short, under /tmp.
    directory = tempfile.mkdtemp(prefix="sd-", dir="/tmp")
    path = os.path.join(directory, "r.sock")
    redis_servers(1, extra_args=["--unixsocket", path, "--unixsocketperm", "700"])
    yield path
    shutil.rmtree(directory, ignore_errors=True)


def test_unix_socket_url_with_db(unix_server: str) -> None:
    client = get_redis({"REDIS_URL": f"unix://{unix_server}?db=4"})
    try:
        assert client.connection_pool.connection_class is UnixDomainSocketConnection
        client.set("test_connection:unix", "x")
        assert client.client_info()["db"] == 4
        client.delete("test_connection:unix")
    finally:
        client.close()


def test_unix_socket_url_async(unix_server: str) -> None:
    async def ping() -> bool:
        client = get_async_redis({"REDIS_URL": f"unix://{unix_server}?db=4"})
        try:
            return bool(await client.ping())
        finally:
            await client.aclose()

    assert asyncio.run(ping()) is True


def test_rediss_url_makes_a_tls_client() -> None:
    client = get_redis({"REDIS_URL": "rediss://alice:pw@cache.example.com:6380/5"})
    pool = client.connection_pool
    assert pool.connection_class is SSLConnection
    assert pool.connection_kwargs["username"] == "alice"
    assert pool.connection_kwargs["password"] == "pw"
    assert pool.connection_kwargs["db"] == 5
    assert pool.connection_kwargs["port"] == 6380


def test_rediss_url_to_a_plain_port_says_so_at_once(redis_server: RedisProcess) -> None:
    # a TLS handshake waits for an answer a plain port never gives (socket timeout x retries, then
    # "Timeout connecting to server"); one plain PING tells it
    settings = {"REDIS_URL": f"rediss://127.0.0.1:{redis_server.port}/0"}
    with pytest.raises(RedisUnavailable, match=r"over TLS \(the port speaks plain Redis, not TLS: use redis://\)"):
        check_reachable(settings)


def test_rediss_url_to_a_silent_port_says_tls() -> None:
    # a port that accepts and never answers is not known to be plain: the handshake's timeout says TLS
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    thread = threading.Thread(target=lambda: accepted.extend(listener.accept()[0] for _ in range(8)),
                              daemon=True)
    thread.start()
    settings = {"REDIS_URL": f"rediss://127.0.0.1:{listener.getsockname()[1]}/0",
                "REDIS_PARAMS": {"socket_timeout": 0.3}, "REDIS_CLUSTER": False}
    try:
        with pytest.raises(RedisUnavailable, match=r"over TLS \(Timeout.*rediss:// only for a TLS port"):
            check_reachable(settings)
    finally:
        listener.close()
        for conn in accepted:
            conn.close()


def test_outage_friendly_defaults_and_redis_params_override() -> None:
    client = get_redis({"REDIS_URL": "redis://127.0.0.1:1/0"})
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["socket_connect_timeout"] == 5.0
    assert kwargs["socket_timeout"] == 15.0
    assert kwargs["socket_keepalive"] is True
    assert kwargs["health_check_interval"] == 15
    assert kwargs["retry"].get_retries() == 3

    params = '{"socket_timeout": 30, "health_check_interval": 2, "redis_cls": "x.Y"}'
    client = get_redis(Settings({"REDIS_URL": "redis://127.0.0.1:1/0", "REDIS_PARAMS": params}))
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == 30
    assert kwargs["health_check_interval"] == 2
    assert "redis_cls" not in kwargs

    settings = {"REDIS_URL": "redis://127.0.0.1:1/0", "REDIS_PARAMS": {"socket_timeout": 9}}
    async_client = get_async_redis(settings)
    akwargs = async_client.connection_pool.connection_kwargs
    assert akwargs["socket_timeout"] == 9
    assert akwargs["health_check_interval"] == 15
    assert akwargs["retry"].get_retries() == 3


def test_unix_clients_get_no_tcp_only_options() -> None:
    client = get_redis({"REDIS_URL": "unix:///tmp/nowhere.sock"})
    assert "socket_keepalive" not in client.connection_pool.connection_kwargs


def test_async_client_shares_the_configuration(redis_url: str, redis_client: redis.Redis) -> None:
    async def write() -> None:
        client = get_async_redis({"REDIS_URL": redis_url})
        try:
            await client.set("test_connection:async", "hello")
        finally:
            await client.aclose()

    asyncio.run(write())
    assert redis_client.get("test_connection:async") == b"hello"


def test_client_reconnects_after_a_redis_restart(redis_servers: Callable[..., list[RedisProcess]]) -> None:
    (server,) = redis_servers(1)
    client = get_redis({"REDIS_URL": server.url})
    client.set("k", "1")
    server.kill()
    with pytest.raises(redis.ConnectionError):
        client.get("k")
    restarted = RedisProcess(port=server.port).start()
    try:
        assert client.ping() is True  # the same client works again, no rebuild needed
    finally:
        client.close()
        restarted.stop()


def test_a_stopped_server_is_noticed_after_one_socket_timeout_and_a_write_is_not_sent_again(
    redis_servers: Callable[..., list[RedisProcess]],
) -> None:
    """A silent network split (here: redis-server under SIGSTOP) is a timeout. redis-py retried timeouts
    three times: a caller -- a worker's frontier, the CLI's reachability check -- heard nothing for four
    socket timeouts (a minute by default), and the command was sent again on a new connection each time,
    so a write ran several times once the server woke up (items written twice)."""
    (server,) = redis_servers(1)
    settings = {"REDIS_URL": server.url, "REDIS_PARAMS": {"socket_timeout": 0.5}, "REDIS_CLUSTER": None}
    client = get_async_redis(settings)

    async def push_while_stopped() -> float:
        await client.ping()
        assert server.proc is not None
        server.proc.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        try:
            with pytest.raises(redis.TimeoutError):
                await client.rpush("stopped:items", "item")
            return time.monotonic() - started
        finally:
            server.proc.send_signal(signal.SIGCONT)

    try:
        assert run(push_while_stopped()) < 1.5
        with redis.Redis(port=server.port) as plain:
            wait_for(lambda: plain.llen("stopped:items") > 0, 5, "the write sent before the stop")
            time.sleep(0.3)
            assert plain.llen("stopped:items") == 1
        assert server.proc is not None
        server.proc.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        # the CLI's and a worker's start-up check, in a process that has not asked this URL about a cluster
        fresh = {**settings, "REDIS_URL": f"redis://localhost:{server.port}/1"}
        with pytest.raises(RedisUnavailable, match="Timeout"):
            check_reachable(fresh)
        assert time.monotonic() - started < 1.5
    finally:
        assert server.proc is not None
        server.proc.send_signal(signal.SIGCONT)
        run(client.aclose())


# -- reachability ---------------------------------------------------------------------------------


def test_unreachable_redis_is_one_line_naming_url_and_setting() -> None:
    port = free_port()
    url = f"redis://:s3cret@127.0.0.1:{port}/0"
    with pytest.raises(RedisUnavailable) as info:
        check_reachable({"REDIS_URL": url})
    message = str(info.value)
    assert "\n" not in message
    assert f"redis://:***@127.0.0.1:{port}/0" in message
    assert "REDIS_URL" in message
    assert "s3cret" not in message


def test_unreachable_host_port_names_those_settings() -> None:
    port = free_port()
    settings = {"REDIS_HOST": "127.0.0.1", "REDIS_PORT": port}
    with pytest.raises(RedisUnavailable, match=r"REDIS_HOST/REDIS_PORT"):
        check_reachable(get_redis(settings), settings)


def test_unreachable_client_without_settings_is_described_from_the_client() -> None:
    port = free_port()
    client = redis.Redis(port=port, password="s3cret", db=3, retry=Retry(NoBackoff(), 0))
    with pytest.raises(RedisUnavailable) as info:
        check_reachable(client)
    assert f"redis://:***@localhost:{port}/3" in str(info.value)
    assert "s3cret" not in str(info.value)


def test_reachable_redis_passes(redis_url: str, redis_client: redis.Redis) -> None:
    check_reachable({"REDIS_URL": redis_url})
    check_reachable(redis_client)


def test_check_reachable_async(redis_url: str) -> None:
    port = free_port()
    dead_settings = {"REDIS_URL": f"redis://127.0.0.1:{port}/0"}

    async def check() -> None:
        client = get_async_redis({"REDIS_URL": redis_url})
        await check_reachable_async(client)
        await client.aclose()
        dead = get_async_redis(dead_settings)
        try:
            await check_reachable_async(dead, dead_settings)
        finally:
            await dead.aclose()

    with pytest.raises(RedisUnavailable, match=f"127.0.0.1:{port}"):
        asyncio.run(check())


def test_check_reachable_refuses_an_async_client(redis_url: str) -> None:
    client = get_async_redis({"REDIS_URL": redis_url})
    with pytest.raises(TypeError, match="check_reachable_async"):
        check_reachable(client)


def test_ensure_reachable_refuses_the_start_with_one_error_line(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    crawler = get_crawler(settings_dict={"REDIS_URL": f"redis://:s3cret@127.0.0.1:{port}/0"})
    with caplog.at_level(logging.INFO):
        assert ensure_reachable(crawler) is False
        assert ensure_reachable(crawler) is False  # a consequence: not logged again
    assert isinstance(start_error(crawler), RedisUnavailable)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert f"redis://:***@127.0.0.1:{port}/0" in errors[0].getMessage()
    assert "s3cret" not in caplog.text


def test_ensure_reachable_passes(redis_url: str) -> None:
    crawler = get_crawler(settings_dict={"REDIS_URL": redis_url})
    assert ensure_reachable(crawler) is True
    assert start_error(crawler) is None


SCHEDULERS = textwrap.dedent(
    """
    from scrapy.core.scheduler import Scheduler

    from scrapy_dist.redis.connection import ensure_reachable


    class CheckInFromCrawler(Scheduler):
        @classmethod
        def from_crawler(cls, crawler):
            ensure_reachable(crawler)
            return super().from_crawler(crawler)


    class CheckInOpen(Scheduler):
        def open(self, spider):
            ensure_reachable(self.crawler)  # refused or not, Scrapy closes what it opened
            return super().open(spider)
    """
)


@pytest.fixture
def tiny_project(tmp_path: Path) -> Path:
    (tmp_path / "scrapy.cfg").write_text("[settings]\ndefault = tinyproj.settings\n")
    pkg = tmp_path / "tinyproj"
    (pkg / "spiders").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "spiders" / "__init__.py").write_text("")
    (pkg / "settings.py").write_text('BOT_NAME = "tinyproj"\nSPIDER_MODULES = ["tinyproj.spiders"]\n')
    (pkg / "schedulers.py").write_text(SCHEDULERS)
    (pkg / "spiders" / "tiny.py").write_text(
        textwrap.dedent(
            """
            import scrapy


            class TinySpider(scrapy.Spider):
                name = "tiny"

                async def start(self):
                    yield scrapy.Request("http://127.0.0.1:9/")

                def parse(self, response):
                    pass
            """
        )
    )
    return tmp_path


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SCRAPY_SETTINGS_MODULE", "REDIS_URL")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), env.get("PYTHONPATH")]))
    return env


@pytest.mark.slow
@pytest.mark.parametrize(
    "scheduler",
    [
        "tinyproj.schedulers.CheckInFromCrawler",
        "tinyproj.schedulers.CheckInOpen",
        "scrapy_dist.scheduler.Scheduler",
    ],
)
def test_scrapy_crawl_against_closed_port_prints_one_error_and_fails(
    tiny_project: Path, scheduler: str
) -> None:
    port = free_port()
    proc = Zygote.run_cli(
        [
            sys.executable, "-m", "scrapy", "crawl", "tiny",
            "-s", f"SCHEDULER={scheduler}",
            "-s", f"REDIS_URL=redis://:s3cret@127.0.0.1:{port}/0",
            "-s", "LOG_LEVEL=INFO",
        ],
        cwd=tiny_project,
        env=_clean_env(),
        timeout=120,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    problems = [line for line in output.splitlines() if re.search(r"\b(ERROR|CRITICAL)\b|Traceback", line)]
    assert len(problems) == 1, output
    assert f"redis://:***@127.0.0.1:{port}/0" in problems[0]
    assert "REDIS_URL" in problems[0]
    assert "s3cret" not in output


# -- Redis Cluster and Sentinel -------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster_node() -> Iterator[RedisProcess]:
    """A one-node Redis Cluster owning all 16384 slots (module-scoped: a new node waits 2 s to be ok)."""
    server = RedisProcess(port=cluster_port(), extra_args=["--cluster-enabled", "yes"]).start()
    admin = redis.Redis(port=server.port)
    admin.execute_command("CLUSTER", "ADDSLOTS", *range(16384))
    deadline = time.monotonic() + 10
    while admin.cluster("info")["cluster_state"] != "ok":
        assert time.monotonic() < deadline, "cluster did not become ok"
        time.sleep(0.05)
    admin.close()
    yield server
    server.stop()


def test_cluster_is_auto_detected(cluster_node: RedisProcess) -> None:
    client = get_redis({"REDIS_URL": cluster_node.url})
    try:
        assert isinstance(client, redis.cluster.RedisCluster)
        assert is_cluster(client)
        client.set("{t}:a", "1")
        script = client.register_script("return redis.call('get', KEYS[1])")
        assert script(keys=["{t}:a"]) == b"1"
    finally:
        client.close()


def test_async_cluster_is_auto_detected(cluster_node: RedisProcess) -> None:
    client = get_async_redis({"REDIS_URL": cluster_node.url})
    assert isinstance(client, redis.asyncio.cluster.RedisCluster)

    async def roundtrip() -> bytes | None:
        try:
            await client.set("{t}:b", "2")
            return await client.get("{t}:b")
        finally:
            await client.aclose()

    assert asyncio.run(roundtrip()) == b"2"


def test_cluster_can_be_forced_off(cluster_node: RedisProcess) -> None:
    client = get_redis(Settings({"REDIS_URL": cluster_node.url, "REDIS_CLUSTER": "False"}))
    assert not is_cluster(client)
    assert isinstance(client, redis.Redis)
    client.close()


def test_plain_server_is_not_a_cluster(redis_url: str) -> None:
    client = get_redis({"REDIS_URL": redis_url})
    assert not is_cluster(client)
    client.close()


def test_forced_cluster_that_cannot_be_reached_is_one_clear_error() -> None:
    port = free_port()
    with pytest.raises(RedisUnavailable, match=rf"redis://127\.0\.0\.1:{port}/0.*REDIS_URL"):
        get_redis({"REDIS_URL": f"redis://127.0.0.1:{port}/0", "REDIS_CLUSTER": True})


@pytest.fixture
def sentinel(redis_servers: Callable[..., list[RedisProcess]], tmp_path: Path) -> Iterator[tuple[int, int]]:
    """(master port, sentinel port) of a master watched by one Sentinel as ``mymaster``."""
    (master,) = redis_servers(1)
    port = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n"
        f"sentinel monitor mymaster 127.0.0.1 {master.port} 1\n"
    )
    proc = subprocess.Popen(
        [redis_server_binary(), str(conf), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    probe = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            if probe.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", "mymaster"):
                break
        except redis.ConnectionError:
            pass
        assert time.monotonic() < deadline, "sentinel did not start"
        time.sleep(0.05)
    probe.close()
    yield master.port, port
    proc.terminate()
    proc.wait(5)


def test_sentinel_master_for(sentinel: tuple[int, int]) -> None:
    master_port, sentinel_port = sentinel
    settings = {
        "REDIS_SENTINELS": [f"127.0.0.1:{sentinel_port}"],
        "REDIS_SENTINEL_MASTER": "mymaster",
        "REDIS_URL": "redis:///6",
    }
    assert resolve_url(settings) == f"redis+sentinel://127.0.0.1:{sentinel_port}/mymaster/6"
    client = get_redis(settings)
    try:
        client.set("test_connection:sentinel", "yes")
        master = redis.Redis(port=master_port, db=6)
        assert master.get("test_connection:sentinel") == b"yes"
        master.close()
    finally:
        client.close()

    async def via_async() -> bytes | None:
        aclient = get_async_redis(settings)
        try:
            return await aclient.get("test_connection:sentinel")
        finally:
            await aclient.aclose()

    assert asyncio.run(via_async()) == b"yes"


# -- the embedded Redis ---------------------------------------------------------------------------


@pytest.fixture
def no_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """cwd = an empty temp dir outside any Scrapy project; the embedded server started there is stopped."""
    monkeypatch.setenv("SCRAPY_SETTINGS_MODULE", "unset")  # so that teardown restores the original state
    monkeypatch.delenv("SCRAPY_SETTINGS_MODULE")
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    EmbeddedRedis(tmp_path / ".scrapy" / "scrapy_dist").shutdown(save=False)


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Path]:
    """A Scrapy project root (scrapy.cfg) whose embedded server is stopped after the test."""
    (tmp_path / "scrapy.cfg").write_text("[settings]\ndefault = someproj.settings\n")
    (tmp_path / "sub").mkdir()
    yield tmp_path
    EmbeddedRedis(tmp_path / ".scrapy" / "scrapy_dist").shutdown(save=False)


def test_embedded_server_is_the_default(no_project: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="scrapy_dist.redis.connection"):
        client = get_redis({})
        async_client = get_async_redis({})
    target = resolve_target({})
    assert target.setting == "embedded"
    assert target.embedded_dir == no_project / ".scrapy" / "scrapy_dist"
    sock = EmbeddedRedis(no_project / ".scrapy" / "scrapy_dist").socket_path  # in the dir, unless too long
    assert target.url == f"unix://{sock}?db=0"

    info = [r.getMessage() for r in caplog.records if r.name == "scrapy_dist.redis.connection"]
    assert len(info) == 1  # once per process, although two clients were built
    assert "embedded Redis" in info[0] and "REDIS_URL" in info[0]
    assert str(target.embedded_dir) in info[0]

    try:
        # Lua with EVALSHA works, persistence is on, and it is not the tiny default config.
        script = client.register_script("return redis.call('incrby', KEYS[1], ARGV[1])")
        assert script(keys=["n"], args=[5]) == 5
        assert client.info("persistence")["aof_enabled"] == 1
        assert client.config_get("save")["save"]
        assert client.config_get("port")["port"] == "0"  # no TCP at all: only the private socket
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        assert client.info("server")["redis_version"] >= "6.2"
        assert asyncio.run(_async_get(async_client, "n")) == b"5"
    finally:
        client.close()

    # The state file is private, the socket only ours.
    assert target.embedded_dir is not None
    assert (target.embedded_dir / "server.json").stat().st_mode & 0o777 == 0o600
    assert sock.stat().st_mode & 0o077 == 0


async def _async_get(client: redis.asyncio.Redis, key: str) -> bytes | None:
    try:
        return await client.get(key)
    finally:
        await client.aclose()


def test_embedded_dir_is_under_the_project_data_dir(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCRAPY_SETTINGS_MODULE", "unset")  # so that teardown restores the original state
    monkeypatch.delenv("SCRAPY_SETTINGS_MODULE")
    monkeypatch.chdir(project / "sub")
    assert embedded_dir({}) == project / ".scrapy" / "scrapy_dist"
    assert embedded_dir({"REDIS_EMBEDDED_DIR": "other"}) == project / ".scrapy" / "other"
    assert embedded_dir({"REDIS_EMBEDDED_DIR": "/srv/x"}) == Path("/srv/x")


def test_explicit_settings_never_start_the_embedded_server(no_project: Path) -> None:
    resolve_target({"REDIS_HOST": "localhost"})
    resolve_target({"REDIS_URL": "redis://localhost/0"})
    assert not (no_project / ".scrapy").exists()


_RUN_ID = (
    "from scrapy_dist.redis.connection import get_redis\n"
    "c = get_redis({})\n"
    "print(c.info('server')['run_id'])\n"
)


def test_two_processes_share_one_embedded_server_that_outlives_them(project: Path) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RUN_ID],
            cwd=project / "sub",
            env=_clean_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    run_ids = {out.strip() for out, _ in outputs}
    assert len(run_ids) == 1, outputs

    server = EmbeddedRedis(project / ".scrapy" / "scrapy_dist")
    log = server.log_path.read_text()
    assert log.lower().count("ready to accept connections") == 1  # started once, not twice
    url = server.url()  # both starters exited; the server still runs
    assert url is not None
    client = redis.Redis.from_url(url)
    assert client.info("server")["run_id"] in run_ids
    client.close()


def test_stale_state_file_is_replaced(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "emb")
    server.directory.mkdir()
    dead_port = free_port()
    server.state_path.write_text(json.dumps({"port": dead_port, "password": "x", "pid": 2**22 + 7}))
    try:
        url, started = server.ensure_running()
        assert started
        assert url.startswith("unix://")
        assert "port" not in json.loads(server.state_path.read_text())
        assert redis.Redis.from_url(url).ping()
        # The next caller joins instead of starting another.
        assert server.ensure_running() == (url, False)
    finally:
        server.shutdown(save=False)


def test_state_file_pointing_at_another_server_is_not_joined(
    tmp_path: Path, redis_server: RedisProcess
) -> None:
    server = EmbeddedRedis(tmp_path / "emb")
    server.directory.mkdir()
    server.state_path.write_text(json.dumps({"port": redis_server.port, "password": "guess"}))
    try:
        url, started = server.ensure_running()
        assert started
        assert url.startswith("unix://")
    finally:
        server.shutdown(save=False)


def test_killed_server_is_restarted_with_its_data(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "emb")
    try:
        url, _ = server.ensure_running()
        client = redis.Redis.from_url(url)
        client.rpush("{s}:queue", "a", "b")
        old_run_id = client.info("server")["run_id"]
        client.close()
        pid = json.loads(server.state_path.read_text())["pid"]
        os.kill(pid, signal.SIGKILL)

        url2, started = server.ensure_running()
        assert started
        client = redis.Redis.from_url(url2)
        assert client.info("server")["run_id"] != old_run_id
        assert client.lrange("{s}:queue", 0, -1) == [b"a", b"b"]  # recovered from the AOF
        client.close()
    finally:
        server.shutdown(save=False)


def test_shutdown_stops_the_server_and_data_survives(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "emb")
    try:
        url, _ = server.ensure_running()
        redis.Redis.from_url(url).set("kept", "yes")
        assert server.shutdown() is True
        assert server.url() is None
        assert server.shutdown() is False
        url2, started = server.ensure_running()
        assert started
        assert redis.Redis.from_url(url2).get("kept") == b"yes"
    finally:
        server.shutdown(save=False)


def test_embedded_start_failure_is_one_clear_error(tmp_path: Path) -> None:
    """A real redis-server that refuses to start (its append-only file is corrupt): one line naming the
    cause from its log, the directory and the way out."""
    directory = tmp_path / "emb"
    directory.mkdir()
    (directory / "appendonly.aof").write_bytes(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\nnot a command stream\r\n")
    server = EmbeddedRedis(directory)
    try:
        with pytest.raises(RedisUnavailable) as info:
            server.ensure_running(timeout=10)
    finally:
        server.shutdown(save=False)
    message = str(info.value)
    assert "\n" not in message
    assert "Bad file format" in message  # the server's own reason, from redis.log
    assert "REDIS_URL" in message
    assert str(server.directory) in message



def test_one_client_pool_per_crawler_shared_by_its_components(redis_servers: Any) -> None:
    from scrapy_dist.dupefilter import BloomDupeFilter
    from scrapy_dist.pipelines import RedisPipeline
    from scrapy_dist.redis.connection import ClientPool

    redis_url = redis_servers(1)[0].url  # a server of its own: its client list is this test's alone
    crawler = get_crawler(settings_dict={"REDIS_URL": redis_url})
    other = get_crawler(settings_dict={"REDIS_URL": redis_url})
    pool = ClientPool.of(crawler)
    assert ClientPool.of(crawler) is pool and ClientPool.of(other) is not pool
    df = BloomDupeFilter.from_crawler(crawler)
    assert df.redis is pool.sync_client()
    assert RedisPipeline.from_crawler(crawler).server is pool.async_client()

    async def use_then_close() -> list[int]:
        client = pool.async_client()
        await client.set("shared", 1)
        await client.aclose()  # a component closing what it was given: the others keep their client
        seen = [int(await client.get("shared"))]
        pool.sync_client().close()
        seen.append(int(pool.sync_client().get("shared")))
        await pool.close()  # what the engine's stop does
        return seen

    assert run(use_then_close()) == [1, 1]
    plain = redis.Redis.from_url(redis_url)
    names = [c.get("name") for c in plain.client_list()]
    assert len(names) == 1, names  # only this client: the pool's connections are closed
    plain.close()


@pytest.mark.slow
def test_a_crawl_with_every_component_connects_through_one_pool(tmp_path: Path, redis_servers: Any,
                                                               site_factory: Any) -> None:
    from crawlproject import make_project

    redis_url = redis_servers(1)[0].url  # a server of its own: only this crawl connects to it
    site = site_factory(pages=150, delay=0.002)
    extensions = {f"scrapy_dist.extensions.{name}": 500
                  for name in ("ClusterStats", "IdleMonitor", "ErrorMonitor")}
    project = make_project(tmp_path, {
        "REDIS_URL": redis_url, "EXTENSIONS": extensions, "CLUSTERSTATS_INTERVAL": 1,
        "ITEM_PIPELINES": {"scrapy_dist.pipelines.RedisPipeline": 300},
        "DOWNLOADER_MIDDLEWARES": {"scrapy.downloadermiddlewares.cookies.CookiesMiddleware": None,
                                   "scrapy_dist.middlewares.SharedCookiesMiddleware": 700},
    })
    client = redis.Redis.from_url(redis_url)
    before = int(client.info("stats")["total_connections_received"])
    project.crawl(args={"seed": site.page_url(0)})
    assert project.wait_all(90) == [0], project.logs()[-4000:]
    assert len(site.fetch_counts()) == 150
    opened = int(client.info("stats")["total_connections_received"]) - before
    print("connections opened by the crawl:", opened)
    # a client per component opens one each (11 here); the one pool opens one per command in flight at the
    # same moment, which varies with the crawl's timing
    assert opened <= 8, opened
