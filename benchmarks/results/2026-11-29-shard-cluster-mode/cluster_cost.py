"""What a capacity point's recorded calls cost Redis, by how the servers run: standalone or cluster mode, one
server or split by slot over three, under callgrind (instructions) or timed on one core (CPU).

Run from the repository's root on a point recorded by ``record.py`` (its ``<prefix>-window.json`` next to
its call files)::

    python benchmarks/results/2026-11-29-shard-cluster-mode/cluster_cost.py instructions PREFIX
    python benchmarks/results/2026-11-29-shard-cluster-mode/cluster_cost.py cpu PREFIX --repeats 5

``instructions``: callgrind instructions per window page of the window's calls (the calls before it replayed
first and subtracted, as the benchmark does) into (i) one standalone server, (ii) one cluster-enabled
server owning every slot, (iii) three cluster-enabled servers each owning a third of the slots and getting
the calls whose first key hashes there, summed, and the same split into three standalone servers. With
each: inclusive instructions of a few functions (the binary's dynamic symbols), from callgrind_annotate.

``cpu``: no valgrind; INFO used_cpu_user + used_cpu_sys deltas over the window's calls, servers bound to
core 0 (SCHED_RR, as the benchmark binds them), this client to core 1: (A) one standalone server, (B) a
3-master cluster (the benchmark's own ``LocalCluster``) getting the calls by slot in recorded order, (C) the
same cluster getting all of master 1's calls, then master 2's, then master 3's; (D, with ``--order``) one
cluster-enabled server owning every slot; the configurations in turn
``--repeats`` times. ``--paced``: A and B once more each, the window's calls sent at their recorded times.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT)]

import redis  # noqa: E402
from redis.crc import key_slot  # noqa: E402

from benchmarks import capacity, redis_server  # noqa: E402
from benchmarks.replay import load_sources, send, wait_ready  # noqa: E402

SLOTS = 16384
MASTERS = 3
#: functions whose inclusive instructions are reported (dynamic symbols of the stripped Debian binary)
FUNCTIONS = ("processCommand", "call", "fcallCommand", "luaCallFunction", "getNodeByQuery", "clusterCron",
             "clusterBeforeSleep", "serverCron", "beforeSleep", "readQueryFromClient", "writeToClient",
             "processInputBuffer", "slotToKeyAdd", "slotToKeyDel", "dbAdd", "aeProcessEvents")


def load_point(prefix: str) -> tuple[dict[str, str], list[Any], tuple[float, float], int, float]:
    """Sources, calls (ts, key, keys, args: bytes) up to the window's end, sorted by time; window, pages and
    the benchmark's instructions per page."""
    meta = json.loads(Path(f"{prefix}-window.json").read_text())
    sources: dict[str, str] = {}
    calls: list[Any] = []
    for path in sorted(glob.glob(f"{prefix}.*.json")):
        got = json.loads(Path(path).read_text())
        sources.update(got["sources"])
        calls += got["calls"]
    calls.sort(key=lambda c: c[0])
    w0, w1 = meta["window"]
    calls = [(ts, key, [k.encode("latin-1") for k in keys], [a.encode("latin-1") for a in args])
             for ts, key, keys, args in calls if ts < w1]
    return sources, calls, (w0, w1), meta["pages"], meta["instructions_per_page"]


def shard_of(keys: list[bytes]) -> int:
    """Which of the MASTERS contiguous slot ranges (``LocalCluster``'s split) owns the call's first key."""
    slot = key_slot(keys[0])
    return next(i for i in range(MASTERS) if slot < (i + 1) * SLOTS // MASTERS)


def slot_range(shard: int) -> tuple[int, int]:
    return shard * SLOTS // MASTERS, (shard + 1) * SLOTS // MASTERS - 1


# -- instructions ------------------------------------------------------------------------------------------

def callgrind_run(sources: dict[str, str], calls: list[Any], cluster: tuple[int, int] | None) -> dict:
    """A fresh redis-server under callgrind (cluster-enabled owning slots ``cluster`` if given): load, send
    ``calls``, shut down. Total instructions and the inclusive instructions of :data:`FUNCTIONS`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        port = redis_server._redis_servers.cluster_port()
        extra = ["--cluster-enabled", "yes", "--cluster-config-file", f"{tmp}/nodes.conf",
                 "--cluster-require-full-coverage", "no", "--cluster-node-timeout", "15000"]
        proc = subprocess.Popen(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
             redis_server.redis_server_binary(), "--port", str(port), "--save", "", "--appendonly", "no",
             "--dir", tmp, *(extra if cluster else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            client = redis.Redis(port=port)
            wait_ready(client, time.monotonic() + 60)
            if cluster:
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", *cluster)
                while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                    time.sleep(0.1)
            load_sources(client, sources)
            t0 = time.monotonic()
            for _, key, keys, args in calls:
                send(client, key, keys, args)
            seconds = time.monotonic() - t0
            with contextlib.suppress(redis.ConnectionError):
                client.shutdown(nosave=True)
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        total = next(int(line.split()[1]) for line in out.read_text().splitlines()
                     if line.startswith(("summary:", "totals:")))
        annotated = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(out)],
                                   capture_output=True, text=True, check=True).stdout
    functions = dict.fromkeys(FUNCTIONS, 0)
    for line in annotated.splitlines():
        m = re.match(r"\s*([\d,]+)\s+\([^)]*\)\s+\?\?\?:(\w+) \[", line)
        if m and m.group(2) in functions:
            functions[m.group(2)] += int(m.group(1).replace(",", ""))
    return {"total": total, "functions": functions, "seconds": seconds}


def window_instructions(sources: dict[str, str], calls: list[Any], w0: float,
                        cluster: tuple[int, int] | None) -> dict:
    """Instructions of the calls from ``w0`` on: a run of all ``calls`` less a run of those before ``w0``."""
    full = callgrind_run(sources, calls, cluster)
    before = callgrind_run(sources, [c for c in calls if c[0] < w0], cluster)
    return {"total": full["total"] - before["total"],
            "functions": {f: full["functions"][f] - before["functions"][f] for f in FUNCTIONS},
            "seconds": full["seconds"] - before["seconds"]}


def add(a: dict, b: dict) -> dict:
    return {"total": a["total"] + b["total"], "seconds": a["seconds"] + b["seconds"],
            "functions": {f: a["functions"][f] + b["functions"][f] for f in FUNCTIONS}}


def instructions(prefix: str, out: Path, only: list[str]) -> None:
    sources, calls, (w0, _), pages, bench = load_point(prefix)
    parts = [[c for c in calls if shard_of(c[2]) == i] for i in range(MASTERS)]
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    results.update({"prefix": prefix, "pages": pages, "benchmark_per_page": bench,
                    "calls": len(calls), "window_calls": sum(c[0] >= w0 for c in calls),
                    "window_calls_by_shard": [sum(c[0] >= w0 for c in p) for p in parts]})
    configs = {
        "i-standalone": lambda: window_instructions(sources, calls, w0, None),
        "ii-cluster-one": lambda: window_instructions(sources, calls, w0, (0, SLOTS - 1)),
        "iii-cluster-split": lambda: _summed(sources, parts, w0, True),
        "iii-standalone-split": lambda: _summed(sources, parts, w0, False),
    }
    for name, run in configs.items():
        if only and name not in only:
            continue
        got = run()
        got["per_page"] = got["total"] / pages
        results[name] = got
        print(f"{name}: {got['per_page']:,.0f} instructions/page", flush=True)
        out.write_text(json.dumps(results, indent=1))


def _summed(sources: dict[str, str], parts: list[list[Any]], w0: float, cluster: bool) -> dict:
    total: dict | None = None
    per_shard = []
    for i, part in enumerate(parts):
        got = window_instructions(sources, part, w0, slot_range(i) if cluster else None)
        per_shard.append(got["total"])
        total = got if total is None else add(total, got)
    assert total is not None
    total["per_shard"] = per_shard
    return total


# -- CPU -------------------------------------------------------------------------------------------------

def cpu_run(sources: dict[str, str], calls: list[Any], w0: float, how: str, paced: bool = False) -> dict:
    """One replay of ``calls`` on fresh servers bound to core 0; CPU seconds of the window's calls.
    ``how``: A (one standalone server), B (3-master cluster, calls in order), C (cluster, one master at a
    time), D (one cluster-enabled server owning every slot)."""
    if how == "A":
        servers = [redis_server.RedisProcess().start()]
        stop = servers[0].stop
    elif how == "D":
        servers = [redis_server.RedisProcess(port=redis_server._redis_servers.cluster_port(), extra_args=[
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout",
            "15000"]).start()]
        stop = servers[0].stop
        with redis.Redis(port=servers[0].port) as c:
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, SLOTS - 1)
            while b"cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
                time.sleep(0.1)
    else:
        cluster = redis_server.local_cluster()(masters=MASTERS, node_timeout_ms=15_000).start()
        servers, stop = cluster.nodes, cluster.stop
    try:
        capacity._pin([s.proc.pid for s in servers], {0}, first=True)
        clients = [redis.Redis(port=s.port) for s in servers]
        # LocalCluster's masters hold contiguous slot ranges in node order (a call sent elsewhere: MOVED)
        for c in clients:
            load_sources(c, sources)
        route = (lambda keys: 0) if how in "AD" else shard_of
        before = [c for c in calls if c[0] < w0]
        window = [c for c in calls if c[0] >= w0]
        if how == "C":
            cpu = 0.0
            t0 = time.monotonic()
            for i, c in enumerate(clients):
                for _, key, keys, args in before:
                    if route(keys) == i:
                        send(c, key, keys, args)
                cpu0 = redis_server.server_cpu(c)
                for _, key, keys, args in window:
                    if route(keys) == i:
                        send(c, key, keys, args)
                cpu += redis_server.server_cpu(c) - cpu0
            seconds = time.monotonic() - t0
        else:
            for _, key, keys, args in before:
                send(clients[route(keys)], key, keys, args)
            time.sleep(0.5)
            cpu0 = redis_server.server_cpu(*clients)
            t0 = time.monotonic()
            for ts, key, keys, args in window:
                if paced:
                    time.sleep(max(0.0, t0 + ts - w0 - time.monotonic()))
                send(clients[route(keys)], key, keys, args)
            seconds = time.monotonic() - t0
            cpu = redis_server.server_cpu(*clients) - cpu0
        idle = redis_server.idle_cpu_rate(*clients, seconds=3.0)
        cs = [_ctx_switches(s.proc.pid) for s in servers]
        for c in clients:
            c.close()
    finally:
        stop()
    return {"how": how, "paced": paced, "cpu_s": cpu, "seconds": seconds, "idle_cpu_s_per_s": idle,
            "ctx_switches_total": [sum(x) for x in cs]}


def _ctx_switches(pid: int) -> tuple[int, int]:
    vol = nonvol = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches"):
                vol = int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches"):
                nonvol = int(line.split()[1])
    return vol, nonvol


def cpu(prefix: str, out: Path, repeats: int, paced: bool, order: str) -> None:
    sources, calls, (w0, _), pages, _ = load_point(prefix)
    os.sched_setaffinity(0, {1})
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    results.update({"prefix": prefix, "pages": pages})
    runs = results.setdefault("runs", [])
    for _ in range(repeats):
        for how in order:
            r = cpu_run(sources, calls, w0, how)
            r["us_per_page"] = 1e6 * r["cpu_s"] / pages
            runs.append(r)
            print(f"{how}: {r['us_per_page']:.1f} us/page in {r['seconds']:.2f} s", flush=True)
            out.write_text(json.dumps(results, indent=1))
    if paced:
        for how in "AB":
            r = cpu_run(sources, calls, w0, how, paced=True)
            r["us_per_page"] = 1e6 * r["cpu_s"] / pages
            runs.append(r)
            print(f"{how} paced: {r['us_per_page']:.1f} us/page in {r['seconds']:.2f} s", flush=True)
            out.write_text(json.dumps(results, indent=1))
    for how in "ABCD":
        got = [r["us_per_page"] for r in runs if r["how"] == how and not r["paced"]]
        if got:
            print(f"{how}: median {statistics.median(got):.1f} (min {min(got):.1f}, max {max(got):.1f})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["instructions", "cpu"])
    parser.add_argument("prefix", help="a point's record prefix (calls.3-process-16 in its temp dir)")
    parser.add_argument("--out", type=Path, required=True, help="JSON results (updated, not replaced)")
    parser.add_argument("--only", default="", help="instructions: configurations to run (comma-separated)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--paced", action="store_true")
    parser.add_argument("--order", default="ABC", help="cpu: configurations in each repeat (D: one"
                        " cluster-enabled server owning every slot)")
    a = parser.parse_args()
    if a.what == "instructions":
        instructions(a.prefix, a.out, [x for x in a.only.split(",") if x])
    else:
        cpu(a.prefix, a.out, a.repeats, a.paced, a.order)
