"""Replays a crawl's recorded Lua script calls back to back on a fresh redis-server: what the very same
work costs a master that is never idle.

During the crawl benchmark one worker makes a sync call every ~70 ms; between two calls the server sleeps
and the crawler (a busy Python process on the same two cores) evicts its caches, so each call runs cold.
A master carrying many workers runs calls back to back, warm -- the case capacity planning is about. The
crawl's scrapy-dist run records its calls (``benchbot.extensions.RecordScriptCalls``: script SHA1, KEYS,
ARGV); this module loads the same scripts into a fresh server, sends the calls in their order, one after
the other, and measures the server's CPU (``INFO cpu``) per crawled page and each call's duration
(SLOWLOG, :data:`~benchmarks.redis_server.SCRIPT_TIMING_US`). The calls ask the server for its time
(``now`` = ''), so leases and delays are relative to the replay, as they were to the crawl.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import redis

from benchmarks.redis_server import (
    RedisProcess,
    call_percentiles,
    script_call_durations,
    server_cpu,
    time_script_calls,
)


def _load(path: Path) -> tuple[dict[str, str], list[tuple[str, list[bytes], list[bytes]]]]:
    sources = json.loads(Path(f"{path}.scripts.json").read_text())
    calls = []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            enc = [k.encode("latin-1") for k in rec["keys"]], [a.encode("latin-1") for a in rec["args"]]
            calls.append((rec["sha"], *enc))
    return sources, calls


def replay(path: Path, pages: int, idle: float = 0.0) -> dict[str, Any]:
    """Replay the calls recorded in ``path`` on a fresh server; figures per page of the recorded crawl
    (``idle``: CPU s/s the same server build spends idle, for the share of that in the figure)."""
    sources, calls = _load(path)
    server = RedisProcess().start()
    try:
        client = redis.Redis(port=server.port)
        for sha, source in sources.items():
            if client.script_load(source) != sha:
                raise ValueError(f"recorded script {sha} does not hash to its SHA1")
        time_script_calls(client)
        client.config_resetstat()
        t0, cpu0 = time.monotonic(), server_cpu(client)
        for sha, keys, args in calls:
            client.evalsha(sha, len(keys), *keys, *args)
        cpu = server_cpu(client) - cpu0
        seconds = time.monotonic() - t0
        durations = script_call_durations(client)
        stats = client.info("commandstats")
        client.close()
    finally:
        server.stop()
    evalsha = stats.get("cmdstat_evalsha", {})
    return {
        "calls": len(calls), "timed_calls": len(durations),
        "redis_cpu_us_per_page": 1e6 * cpu / pages, "seconds": seconds,
        "idle_us_per_page": 1e6 * idle * seconds / pages,
        "evalsha_us_per_page": evalsha.get("usec", 0) / pages,
        **call_percentiles(durations),
    }
