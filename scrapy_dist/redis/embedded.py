"""The embedded Redis (no Redis setting given): one private ``redis-server`` per Scrapy project, shared by its
crawls and kept running between them (docs/connection.md); its files are in :mod:`.private_files`."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from scrapy.exceptions import NotConfigured
from scrapy.utils.project import data_path

from scrapy_dist.exceptions import RedisUnavailable
from scrapy_dist.redis import private_files as files
from scrapy_dist.redis.private_files import redis_cli_binary, redis_server_binary  # noqa: F401 - re-exported
from scrapy_dist.settings import defaults

children: dict[int, subprocess.Popen[bytes]] = {}  #: Popen of servers started here (reaped after shutdown())


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):
        return False
    except PermissionError:
        return True
    if (child := children.get(pid)) is not None:
        return child.poll() is None
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def pid_is_redis(pid: int, directory: Path) -> bool:
    """Whether ``pid`` is a live redis-server working in ``directory`` (not a recycled pid)."""
    if not pid_alive(pid):
        return False
    try:
        return ("redis" in Path(f"/proc/{pid}/comm").read_text()
                and os.path.realpath(f"/proc/{pid}/cwd") == os.path.realpath(directory))
    except OSError:  # no /proc (macOS) or not ours to inspect: ask ps for the name only
        try:
            return "redis" in subprocess.run(["ps", "-o", "comm=", "-p", str(pid)], capture_output=True,
                                             text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            return True


logger = logging.getLogger(__name__)
DEFAULT_DIRNAME = "scrapy_dist"  #: Directory name under the project's ``.scrapy`` data directory.
_thread_lock = threading.Lock()  # between the threads of this process (server.lock is per process)


def embedded_dir(settings: Any) -> Path:
    """The embedded server's directory for these settings (``REDIS_EMBEDDED_DIR``, absolute or relative to
    the project's ``.scrapy`` directory; ``./.scrapy/scrapy_dist`` outside a project)."""
    configured = settings.get("REDIS_EMBEDDED_DIR", defaults.REDIS_EMBEDDED_DIR) or DEFAULT_DIRNAME
    try:
        path = Path(data_path(configured))
    except NotConfigured:  # SCRAPY_SETTINGS_MODULE set, but no scrapy.cfg to anchor .scrapy to
        path = Path(".scrapy", configured)
    path = path.absolute()
    return path.parent.resolve() / path.name


def _probe_client(state: dict[str, Any]) -> redis.Redis:
    return redis.Redis(unix_socket_path=state["socket"], socket_connect_timeout=2, socket_timeout=5,
                       retry=Retry(NoBackoff(), 0), decode_responses=True)


class EmbeddedRedis:
    """The private redis-server whose files live in ``directory``: joined or started (not tied to this
    process) by :meth:`ensure_running`, stopped by :meth:`shutdown`; every step re-checks the trust rules.
    ``maxmemory`` in bytes (0: no limit; ``None``: the default)."""

    def __init__(self, directory: str | os.PathLike[str], binary: str | None = None,
                 maxmemory: int | None = None) -> None:
        path = Path(directory).absolute()
        self.directory = path.parent.resolve() / path.name  # the last component must not be a symlink
        self.state_path, self.lock_path, self.conf_path, self.log_path, self.pid_path = (
            self.directory / name
            for name in ("server.json", "server.lock", "redis.conf", "redis.log", "redis.pid"))
        self.binary = binary
        self.maxmemory = files.default_maxmemory() if maxmemory is None else maxmemory
        self.maxmemory_explicit = maxmemory is not None  # only a chosen limit is pushed onto a server joined

    @classmethod
    def for_settings(cls, settings: Any) -> EmbeddedRedis:
        raw = settings.get("REDIS_EMBEDDED_MAXMEMORY", defaults.REDIS_EMBEDDED_MAXMEMORY)
        try:
            maxmemory = files.parse_maxmemory(raw)
        except ValueError as exc:
            raise RedisUnavailable(f"scrapy-dist: {exc}") from None
        return cls(embedded_dir(settings), maxmemory=None if raw in (None, "") else maxmemory)

    @property
    def socket_path(self) -> Path:
        return files.socket_path_for(self.directory)

    def _read_state(self) -> dict[str, Any] | None:
        try:
            state = json.loads(files.read_private(self.state_path) or "null")
        except ValueError:
            return None
        # only where we would put the socket ourselves: never a TCP port, which anyone may hold
        return state if isinstance(state, dict) and state.get("socket") == str(self.socket_path) else None

    @staticmethod
    def _url(state: dict[str, Any]) -> str:
        return f"unix://{state['socket']}?db=0"

    def _answers(self, state: dict[str, Any], loading_timeout: float) -> bool:
        """Whether the server in ``state`` serves this directory, waiting while it loads (``LOADING``)."""
        try:
            files.check_private_dir(self.socket_path.parent)  # still one only we control
        except RedisUnavailable:
            return False
        deadline = time.monotonic() + loading_timeout
        with _probe_client(state) as client:
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

    def _apply_maxmemory(self) -> None:
        if not self.maxmemory_explicit or (state := self._read_state()) is None:
            return
        with _probe_client(state) as client, contextlib.suppress(redis.RedisError, OSError, ValueError):
            if (current := int(client.config_get("maxmemory").get("maxmemory") or 0)) != self.maxmemory:
                client.config_set("maxmemory", self.maxmemory)
                logger.info("Embedded Redis in %s: maxmemory set to %d bytes (was %d)", self.directory,
                            self.maxmemory, current)

    def url(self, loading_timeout: float = 60.0) -> str | None:
        """URL of the running server, or ``None`` if none answers (never starts one)."""
        if not os.path.lexists(self.directory):
            return None
        files.check_private_dir(self.directory)
        state = self._read_state()
        return self._url(state) if state is not None and self._answers(state, loading_timeout) else None

    def status(self) -> dict[str, Any]:
        """What ``scrapy-dist embedded status`` shows: directory, running, socket, pid, memory."""
        out: dict[str, Any] = {"directory": str(self.directory), "running": False}
        if not (url := self.url(loading_timeout=5.0)) or (state := self._read_state()) is None:
            return out
        out.update(running=True, url=url, socket=state["socket"], pid=state.get("pid"))
        with _probe_client(state) as client, contextlib.suppress(redis.RedisError, OSError):
            info = client.info("memory")
            out.update(used_memory=info.get("used_memory"), maxmemory=info.get("maxmemory"),
                       keys=client.dbsize())
        return out

    def ensure_running(self, timeout: float = 60.0) -> tuple[str, bool]:
        """Join the running server or start one: ``(url, started_by_this_call)``."""
        files.make_private_dir(self.directory)
        if not (url := self.url()):
            if self.socket_path.parent != self.directory:
                files.make_private_dir(self.socket_path.parent)
            with _thread_lock, files.file_lock(self.lock_path, timeout):
                if not (url := self.url()):  # another process may have started it meanwhile
                    self._wait_for_old_server()
                    return self._start(timeout), True
        self._apply_maxmemory()
        return url, False

    def _wait_for_old_server(self, grace: float = 10.0) -> None:
        """Refuse to start a second server on the same data files while an old one still runs."""
        try:
            pid = int(self.pid_path.read_text().strip())
        except (OSError, ValueError):
            return
        deadline = time.monotonic() + grace
        while pid_is_redis(pid, self.directory):
            if time.monotonic() > deadline:
                raise RedisUnavailable(
                    f"The embedded redis-server (pid {pid}) in {self.directory} is running but does not "
                    f"answer (an older version's server?); stop it with: kill {pid}")
            time.sleep(0.1)

    def _log_tail(self, lines: int = 3) -> str:
        try:
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            return ""
        return " | ".join(line.strip() for line in tail)

    def _start(self, timeout: float) -> str:
        binary = self.binary or redis_server_binary()
        config = files.server_config(self.directory, self.socket_path, self.pid_path, self.log_path,
                                     self.maxmemory)
        files.write_private(self.conf_path, config)
        # its own session: it outlives us and does not get the terminal's Ctrl-C; its files private at birth
        proc = subprocess.Popen([binary, str(self.conf_path)], cwd=self.directory, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                umask=0o077)
        children[proc.pid] = proc
        state: dict[str, Any] = {"socket": str(self.socket_path), "pid": proc.pid}
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                children.pop(proc.pid, None)
                why = self._log_tail() or f"exit status {proc.returncode}"
                raise RedisUnavailable(f"The embedded Redis in {self.directory} failed to start ({why}); "
                                       f"see {self.log_path} or set REDIS_URL to use another Redis")
            if self._answers(state, loading_timeout=max(0.0, deadline - time.monotonic())):
                files.write_private(self.state_path, json.dumps(state))
                return self._url(state)
            if time.monotonic() > deadline:
                proc.terminate()
                raise RedisUnavailable(
                    f"The embedded Redis in {self.directory} did not start within {timeout:.0f}s "
                    f"(see {self.log_path}); set REDIS_URL to use another Redis")
            time.sleep(0.02)

    def shutdown(self, save: bool = True, timeout: float = 10.0) -> bool:
        """Stop the server (saving its data unless ``save=False``). Returns whether one was running."""
        try:
            state = self._read_state() if self.url(loading_timeout=timeout) else None
        except RedisUnavailable:
            return False
        if state is None:
            return False
        with _probe_client(state) as client, contextlib.suppress(redis.RedisError):  # dropped as it exits
            client.shutdown(save=save, nosave=not save)
        if isinstance(pid := state.get("pid"), int):
            if (child := children.pop(pid, None)) is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout)
            deadline = time.monotonic() + timeout
            while pid_alive(pid):
                if time.monotonic() > deadline:  # a failed final save: keep the state file pointing at it
                    raise RedisUnavailable(f"The embedded redis-server (pid {pid}) in {self.directory} did "
                                           f"not stop (see {self.log_path})")
                time.sleep(0.05)
        with contextlib.suppress(OSError):
            self.state_path.unlink()
        return True
