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

import contextlib
import json
import os
import re
import shutil
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

#: The scripts a crawl calls, by the names their header lines give (fragments have other names).
SCRIPT_NAMES = frozenset({
    "sync", "clusterstats", "errors", "idle", "finish", "seeds_take", "seeds_adopt", "dupe", "dupe_batch",
    "items_xadd", "cookies_read", "cookies_write", "polite", "foreign",
})


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
        load_sources(client, sources)
        time_script_calls(client)
        client.config_resetstat()
        t0, cpu0 = time.monotonic(), server_cpu(client)
        for sha, keys, args in calls:
            send(client, sha, keys, args)
        cpu = server_cpu(client) - cpu0
        seconds = time.monotonic() - t0
        durations = script_call_durations(client)
        by_script = _by_script(client, sources, calls, pages)
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
        "by_script": by_script,
    }


#: a recorded call's script key for a FUNCTION library's function (FCALL) rather than a SHA1 (EVALSHA)
FCALL = "fcall:"


def load_sources(client: Any, sources: dict[str, str]) -> None:
    """Load recorded scripts (SCRIPT LOAD, checked against their SHA1) and libraries (FUNCTION LOAD)."""
    for key, source in sources.items():
        if key.startswith(FCALL):
            client.function_load(source, replace=True)
        elif client.script_load(source) != key:
            raise ValueError(f"recorded script {key} does not hash to its SHA1")


def send(client: Any, key: str, keys: list[bytes], args: list[bytes]) -> Any:
    """One recorded call: FCALL of a library's function or EVALSHA of a script (by its recorded key)."""
    if key.startswith(FCALL):
        return client.fcall(key.removeprefix(FCALL), len(keys), *keys, *args)
    return client.evalsha(key, len(keys), *keys, *args)


def record_library_calls(record: Any) -> None:
    """Make ``record(at, key, source, keys, args)`` (``at``: monotonic time it was sent) see every FCALL
    of :class:`scrapy_dist.redis.scripts.Library` in this process (its EVALSHA fallback goes through
    redis-py's ``AsyncScript``, hooked apart)."""
    from scrapy_dist.redis.scripts import Library

    original = Library.__call__

    async def call(lib: Any, keys: Any, args: Any) -> Any:
        at = time.monotonic()
        result = await original(lib, keys, args)
        if lib.functions:
            record(at, FCALL + lib.function, lib.code, keys, args)
        return result

    Library.__call__ = call  # type: ignore[method-assign,assignment]


def script_name(source: str) -> str:
    """A script's name: the first ``-- <name>: ...`` header line naming one of the package's scripts (a
    script assembled from fragments starts with theirs), else ``?``."""
    for line in source.splitlines():
        m = re.match(r"-- (\w+): ", line)
        if m and m.group(1) in SCRIPT_NAMES:
            return m.group(1)
    return "sync" if "(sync.lua)" in source else "?"


def _by_script(client: Any, sources: dict[str, str], calls: list[Any], pages: int) -> dict[str, dict]:
    """Per script (by name): calls and the SLOWLOG time of its calls per crawled page -- which part of
    the replay is the frontier's sync rounds and which the monitoring extensions' flushes."""
    out: dict[str, dict] = {}
    for sha, source in sources.items():
        n = sum(1 for c in calls if c[0] == sha)
        if not n:
            continue
        us = sum(script_call_durations(client, sha))
        row = out.setdefault(script_name(source), {"calls": 0, "us_per_page": 0.0})
        row["calls"] += n
        row["us_per_page"] += us / pages
    return out


def replay_instructions(path: Path, pages: int, only: str | None = None) -> dict[str, Any]:
    """The same replay on a redis-server run under ``valgrind --tool=callgrind``: instructions the server
    executes per crawled page for the recorded calls (of script ``only`` if given), less what the same
    server executes starting, loading the scripts and shutting down with no call at all. Instruction counts
    do not move with what else the machine is doing, so two trees compare on a busy machine."""
    sources, calls = _load(path)
    if only:
        calls = [c for c in calls if script_name(sources[c[0]]) == only]
    return {"calls": len(calls), "instructions_per_page": callgrind_instructions(sources, calls) / pages,
            "only": only or "all scripts"}


def callgrind_instructions(
    sources: dict[str, str], calls: list[Any], skip: int = 0, cluster: bool = False
) -> int:
    """Instructions a fresh redis-server under callgrind executes for ``calls[skip:]`` (sha, keys, args)
    once the first ``skip`` have run: less what it executes starting, loading ``sources``, running those
    and shutting down. ``cluster``: the server runs in cluster mode, one node owning every slot, so the
    figure includes what cluster mode adds to each command (the slot checks of its keys, inside scripts
    too) for calls a cluster's masters shared."""
    return _callgrind_run(sources, calls, cluster) - _callgrind_run(sources, calls[:skip], cluster)


def _callgrind_run(sources: dict[str, str], calls: list[Any], cluster: bool = False) -> int:
    import subprocess
    import tempfile

    from benchmarks.redis_server import cluster_port, free_port, redis_server_binary

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        port = cluster_port() if cluster else free_port()  # a cluster node's bus port is port + 10000
        proc = subprocess.Popen(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", redis_server_binary(),
             "--port", str(port), "--save", "", "--appendonly", "no", "--dir", tmp,
             *(["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"] if cluster else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=port)
        try:
            deadline = time.monotonic() + 60
            wait_ready(client, deadline)
            if cluster:
                _own_every_slot(client, deadline)
            load_sources(client, sources)
            for sha, keys, args in calls:
                send(client, sha, keys, args)
            with contextlib.suppress(redis.ConnectionError):
                client.shutdown(nosave=True)
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:  # it failed on the way: no server is left behind
                proc.kill()
                proc.wait()
        keep = os.environ.get("BENCH_CALLGRIND_KEEP")  # a path: keep the profile (callgrind_annotate it)
        if keep and calls:
            shutil.copy(out, keep)
        for line in out.read_text().splitlines():
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise RuntimeError("callgrind wrote no instruction total")


def wait_ready(client: Any, deadline: float) -> None:
    """Wait until a server just started (slow under valgrind) answers; its ``ConnectionError`` after
    ``deadline`` (monotonic)."""
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _own_every_slot(client: Any, deadline: float) -> None:
    """A lone cluster node takes every slot and waits until its cluster is up (``CLUSTER ADDSLOTS``:
    Redis 6.2 has no ``ADDSLOTSRANGE``)."""
    client.execute_command("CLUSTER", "ADDSLOTS", *range(16384))
    while client.cluster("info").get("cluster_state") != "ok":
        if time.monotonic() > deadline:
            raise RuntimeError("a lone cluster node owning every slot did not come up")
        time.sleep(0.1)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Replay recorded script calls: server instructions per page")
    parser.add_argument("calls", type=Path, help="a BENCH_SCRIPT_CALLS_FILE of a crawl")
    parser.add_argument("--pages", type=int, required=True, help="pages that crawl fetched")
    parser.add_argument("--only", help="one script's calls (its name: sync, clusterstats, errors, ...)")
    a = parser.parse_args()
    print(json.dumps(replay_instructions(a.calls, a.pages, a.only)))
