"""The embedded Redis trusts only itself: attacks by another user simulated as far as a root sandbox allows
(another user is played by chown to a foreign uid), plus its maxmemory."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import redis

from scrapy_dist.exceptions import RedisUnavailable
from scrapy_dist.redis.embedded import EmbeddedRedis, parse_maxmemory

if TYPE_CHECKING:
    from collections.abc import Iterator

FOREIGN_UID = 54321


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    emb = EmbeddedRedis(tmp_path / "proj" / ".scrapy" / "scrapy_dist", maxmemory=64 * 1024**2)
    yield emb
    emb.shutdown(save=False)


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text
    return text


def test_world_writable_state_dir_is_refused_and_not_chmodded(server: EmbeddedRedis) -> None:
    server.directory.mkdir(parents=True)
    os.chmod(server.directory, 0o777)
    with pytest.raises(RedisUnavailable) as err:
        server.ensure_running()
    message = _one_line(err.value)
    assert str(server.directory) in message and "chmod go-w" in message
    assert os.stat(server.directory).st_mode & 0o777 == 0o777  # never repaired behind the user's back
    assert not server.state_path.exists()
    # The remedy the message names works.
    os.chmod(server.directory, 0o755)
    url, started = server.ensure_running()
    assert started and url.startswith("unix://")


def test_state_dir_planted_by_another_user_is_refused(server: EmbeddedRedis) -> None:
    # Attack (a): someone pre-creates ./.scrapy/scrapy_dist (say in /tmp) and waits for our crawl.
    server.directory.mkdir(parents=True, mode=0o700)
    os.chown(server.directory, FOREIGN_UID, FOREIGN_UID)
    with pytest.raises(RedisUnavailable) as err:
        server.ensure_running()
    message = _one_line(err.value)
    assert str(server.directory) in message and f"uid {FOREIGN_UID}" in message
    assert not server.state_path.exists() and not server.conf_path.exists()


def test_parent_writable_by_others_is_refused(server: EmbeddedRedis) -> None:
    parent = server.directory.parent.parent  # .../proj
    parent.mkdir(parents=True)
    os.chmod(parent, 0o777)  # anyone could rename our directory away and put theirs in its place
    with pytest.raises(RedisUnavailable) as err:
        server.ensure_running()
    assert str(parent) in _one_line(err.value)


def test_symlinks_planted_at_private_paths_are_never_followed(tmp_path: Path, server: EmbeddedRedis) -> None:
    # Attack (b): links at the config and state paths, pointing at files the attacker can read.
    server.directory.mkdir(parents=True, mode=0o700)
    loot = {name: tmp_path / f"loot-{name}" for name in ("redis.conf", "server.json")}
    for name, target in loot.items():
        target.write_text("")
        os.symlink(target, server.directory / name)
    url, started = server.ensure_running()
    assert started
    for name, target in loot.items():
        assert target.read_text() == ""  # nothing written through the link
        assert not (server.directory / name).is_symlink()
        assert (server.directory / name).stat().st_mode & 0o777 == 0o600
    assert redis.Redis.from_url(url).ping()


def test_symlinked_lock_file_is_refused_in_one_line(tmp_path: Path, server: EmbeddedRedis) -> None:
    server.directory.mkdir(parents=True, mode=0o700)
    os.symlink(tmp_path / "elsewhere", server.lock_path)
    with pytest.raises(RedisUnavailable) as err:
        server.ensure_running()
    assert str(server.lock_path) in _one_line(err.value)
    assert not (tmp_path / "elsewhere").exists()


def test_state_file_readable_by_others_is_not_trusted(server: EmbeddedRedis) -> None:
    url, _ = server.ensure_running()
    os.chmod(server.state_path, 0o644)
    assert server.url() is None  # someone else may have written it
    os.chmod(server.state_path, 0o600)  # trusted again, so that the fixture can stop the server
    assert server.url() == url


class Squatter:
    """A plain TCP listener that records every byte any client sends it."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.received = b""
        self.connections = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.settimeout(1.0)
            with contextlib.suppress(OSError):
                self.received += conn.recv(65536)
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.sock.close()


def test_squatter_on_the_recorded_port_gets_nothing(server: EmbeddedRedis) -> None:
    # Attack (c): the state file names the port of a dead server, now held by someone else.
    squatter = Squatter()
    try:
        server.directory.mkdir(parents=True, mode=0o700)
        fd = os.open(server.state_path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, json.dumps({"port": squatter.port, "password": "hunter2-secret", "pid": 1}).encode())
        os.close(fd)
        url, started = server.ensure_running()
        client = redis.Redis.from_url(url)
        client.set("k", "v")
        client.close()
    finally:
        squatter.close()
    assert started
    assert squatter.connections == 0 and b"hunter2" not in squatter.received


def test_state_file_naming_a_foreign_socket_is_not_joined(tmp_path: Path, server: EmbeddedRedis) -> None:
    # A recorded socket path outside our private place is never connected to.
    rogue = tmp_path / "rogue.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(rogue))
    listener.listen(1)
    listener.settimeout(0.1)
    try:
        server.directory.mkdir(parents=True, mode=0o700)
        fd = os.open(server.state_path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, json.dumps({"socket": str(rogue), "pid": 1}).encode())
        os.close(fd)
        _url, started = server.ensure_running()
        assert started
        with pytest.raises(OSError):
            listener.accept()  # nobody knocked
    finally:
        listener.close()


def test_long_directory_puts_the_socket_in_a_private_runtime_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short, like /run/user/<uid>
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    emb = EmbeddedRedis(tmp_path / ("d" * 120), maxmemory=0)
    try:
        url, _ = emb.ensure_running()
        assert emb.socket_path.parent == runtime / "scrapy-dist"
        assert url == f"unix://{emb.socket_path}?db=0"
        assert os.stat(emb.socket_path.parent).st_mode & 0o777 == 0o700
    finally:
        emb.shutdown(save=False)
        shutil.rmtree(runtime, ignore_errors=True)


def test_runtime_dir_of_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # short enough for a socket path whatever pytest's tmp_path is (under xdist it is longer)
    runtime = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    (runtime / "scrapy-dist").mkdir(parents=True, mode=0o700)
    os.chown(runtime / "scrapy-dist", FOREIGN_UID, FOREIGN_UID)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    emb = EmbeddedRedis(tmp_path / ("d" * 120), maxmemory=0)
    with pytest.raises(RedisUnavailable) as err:
        emb.ensure_running()
    assert str(runtime / "scrapy-dist") in _one_line(err.value)


# -- maxmemory ----------------------------------------------------------------------------------------------
def test_server_runs_with_maxmemory_and_noeviction(server: EmbeddedRedis) -> None:
    url, _ = server.ensure_running()
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        assert int(client.config_get("maxmemory")["maxmemory"]) == 64 * 1024**2
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    finally:
        client.close()
    # A process joining with another limit applies it to the running server.
    joiner = EmbeddedRedis(server.directory, maxmemory=128 * 1024**2)
    joiner.ensure_running()
    # One that leaves the setting alone (a CLI command) does not undo it.
    EmbeddedRedis(server.directory).ensure_running()
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        assert int(client.config_get("maxmemory")["maxmemory"]) == 128 * 1024**2
    finally:
        client.close()


def test_maxmemory_setting() -> None:
    assert parse_maxmemory("2gb") == 2 * 1024**3
    assert parse_maxmemory(" 512MB ") == 512 * 1024**2
    assert parse_maxmemory(0) == 0
    assert parse_maxmemory(100_000_000) == 100_000_000
    default = parse_maxmemory(None)
    assert 64 * 1024**2 <= default <= 2 * 1024**3
    for bad in ("lots", "-1", "1tb", "1.5gb", True, 10):
        with pytest.raises(ValueError, match="REDIS_EMBEDDED_MAXMEMORY="):
            parse_maxmemory(bad)
    with pytest.raises(RedisUnavailable, match="REDIS_EMBEDDED_MAXMEMORY='lots'"):
        EmbeddedRedis.for_settings({"REDIS_EMBEDDED_MAXMEMORY": "lots"})
