"""The sharded frontier's raw enqueue + dequeue rate (no HTTP): one shard on one node vs three shards on a
local 3-master Redis Cluster, measured in the same run.

``DRIVERS`` driver processes (the same number in both configurations) each loop for ``seconds``: one round
= new requests (fresh fingerprints, realistic ~50-byte payloads prepared before the clock starts) routed to
their shard by fingerprint (:func:`scrapy_dist.frontier.shard.shard_of`) and deduplicated by each shard's
bloom filter, the acknowledgement of what the previous round leased, and a lease of as many -- one
:meth:`Frontier.sync <scrapy_dist.frontier.shard.Frontier.sync>` per shard, sent concurrently, exactly what
the scheduler's batched path sends. The rate is (requests enqueued + requests acknowledged) per second, summed
over the drivers.

Beside the rate it records CPU: each server's ``used_cpu_user + used_cpu_sys`` and each driver's process
time, per second of wall time, so the report says which side is the bottleneck (a machine with few cores
runs clients and servers on the same cores: the ratio there is a floor, not the scaling of a real cluster).

``python -m benchmarks.shards [--quick]`` prints the figures; ``run(args)`` is the harness entry point.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import random
import time
from typing import Any

import msgpack
import redis

from benchmarks.redis_server import RedisProcess, local_cluster, server_cpu

TITLE = "Sharded frontier: raw enqueue + dequeue rate, 1 shard vs 3 shards on a 3-master cluster"
DRIVERS = 3
BATCH = 500
SHARDS = 3


def _payload(url: str) -> bytes:
    """A wire-format payload (version byte + msgpack map), as :func:`scrapy_dist.wire.codec.encode_request`
    writes a plain GET at depth 2."""
    return b"\x01" + msgpack.packb({"u": url, "M": {"depth": 2}})


async def _drive(
    url: str, cluster: bool, shards: int, seed: int, seconds: float, batch: int, start: Any
) -> dict:
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster

    from scrapy_dist.dupefilter import BloomDupeFilter
    from scrapy_dist.dupefilter.bloom import fingerprint_hashes
    from scrapy_dist.frontier.shard import Frontier, SyncBatch, shard_of
    from scrapy_dist.redis.keys import CrawlKeys
    from scrapy_dist.settings import SchedulerSettings

    rng = random.Random(seed)
    # prepared before the clock starts: the drivers measure the frontier, not fingerprinting
    rounds = max(1, int(seconds * 100))  # ~3x what a driver on a 2-core machine gets through
    prepared = []
    for r in range(rounds):
        per_shard: list[list[Any]] = [[] for _ in range(shards)]
        for i in range(batch):
            fp = rng.randbytes(20)
            t1, t2 = fingerprint_hashes(fp)
            per_shard[shard_of(fp, shards)].append(
                (t1, t2, 0.0, _payload(f"http://bench.test/{seed}/{r}/{i}"), "", "")
            )
        prepared.append(per_shard)
    gc.freeze()  # the prepared batches are permanent: keep the collector from walking them every round
    client: Any = RedisCluster.from_url(url) if cluster else Redis.from_url(url)
    sync_client: Any = redis.cluster.RedisCluster.from_url(url) if cluster else redis.Redis.from_url(url)
    keys = CrawlKeys("bench")
    base = BloomDupeFilter(sync_client, keys, None, capacity=10_000_000)
    frontiers = []
    for k in keys.shards(shards):
        df = base.for_shard(k, shards) if shards > 1 else base
        df.open()
        config = SchedulerSettings(lease_seconds=600)
        frontiers.append(Frontier(client, k, f"driver-{seed}", df, config, heartbeat=k == keys))
    sync_client.close()
    await frontiers[0].sync(SyncBatch())  # connected (and the scripts loaded) before the clock starts
    await asyncio.to_thread(start.wait)
    acks: list[list[bytes]] = [[] for _ in range(shards)]
    enqueued = acked = 0
    cpu0, t0 = time.process_time(), time.perf_counter()
    deadline = t0 + seconds
    r = 0
    while time.perf_counter() < deadline and r < rounds:
        batches = [
            SyncBatch(enqueue=prepared[r][s], ack=acks[s], lease=len(prepared[r][s])) for s in range(shards)
        ]
        results = await asyncio.gather(*(f.sync(b) for f, b in zip(frontiers, batches, strict=True)))
        for s, res in enumerate(results):
            enqueued += sum(res.new)
            acked += len(acks[s])
            acks[s] = [m for m, _ in res.leased]
        r += 1
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    await client.aclose()
    return {"enqueued": enqueued, "acked": acked, "wall": wall, "cpu": cpu, "rounds": r, "prepared": rounds}


def _driver(args: tuple[str, bool, int, int, float, int, Any]) -> dict:
    url, cluster, shards, seed, seconds, batch, start = args
    return asyncio.run(_drive(url, cluster, shards, seed, seconds, batch, start))


def _cpu_of(ports: list[int]) -> float:
    clients = [redis.Redis(port=port) for port in ports]
    try:
        return server_cpu(*clients)
    finally:
        for c in clients:
            c.close()


def measure(url: str, cluster: bool, shards: int, ports: list[int], seconds: float, drivers: int) -> dict:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        start = manager.Event()
        with ctx.Pool(drivers) as pool:
            pending = pool.map_async(
                _driver, [(url, cluster, shards, 100 + i, seconds, BATCH, start) for i in range(drivers)]
            )
            time.sleep(min(30.0, 3.0 + seconds))  # let them prepare their batches and connect
            server0, wall0 = _cpu_of(ports), time.perf_counter()
            start.set()
            out = pending.get(timeout=seconds * 10 + 120)
            server1, wall1 = _cpu_of(ports), time.perf_counter()
    if any(o["rounds"] == o["prepared"] for o in out):
        raise RuntimeError("a driver ran out of prepared rounds: raise the number prepared")
    wall = max(o["wall"] for o in out)
    ops = sum(o["enqueued"] + o["acked"] for o in out)
    return {
        "shards": shards,
        "nodes": len(ports),
        "drivers": drivers,
        "enqueued": sum(o["enqueued"] for o in out),
        "acked": sum(o["acked"] for o in out),
        "wall_s": round(wall, 2),
        "ops_per_s": ops / wall,
        # CPU seconds per wall second: 1.0 = one core busy all the time
        "server_cpu": round((server1 - server0) / (wall1 - wall0), 2),
        "client_cpu": round(sum(o["cpu"] for o in out) / wall, 2),
    }


def run(args: argparse.Namespace) -> dict:
    quick = getattr(args, "quick", False)
    seconds = getattr(args, "shards_seconds", None) or (4.0 if quick else 12.0)
    drivers = getattr(args, "shards_drivers", None) or DRIVERS
    results = []
    single = RedisProcess().start()
    try:
        results.append(measure(single.url, False, 1, [single.port], seconds, drivers))
    finally:
        single.stop()
    cluster = local_cluster()(masters=3).start()
    try:
        ports = [n.port for n in cluster.nodes]
        results.append(measure(cluster.nodes[0].url, True, SHARDS, ports, seconds, drivers))
    finally:
        cluster.stop()
    one, three = results
    ratio = three["ops_per_s"] / one["ops_per_s"]
    cores = os.cpu_count() or 1
    busy = three["server_cpu"] + three["client_cpu"]
    bound = "clients" if three["client_cpu"] > three["server_cpu"] else "servers"

    def us_per_request(r: dict, side: str) -> float:
        return r[side] / r["ops_per_s"] * 1e6

    # the most any placement of these processes could do on this machine: all cores busy at the measured
    # CPU cost per request of the 3-shard run (servers and drivers together)
    per_request = us_per_request(three, "server_cpu") + us_per_request(three, "client_cpu")
    ceiling = cores / per_request * 1e6
    notes = [
        f"{cores} CPU cores for {drivers} driver processes and {len(ports)} redis-servers: together they used"
        f" {busy:.2f} cores during the 3-shard run, so the {ratio:.2f}x ratio is bounded by the machine"
        f" ({bound} used the most CPU); on separate hosts each master adds its own core.",
        f"Measured CPU per request in the 3-shard run: {per_request:.1f} us (servers + drivers), so {cores}"
        f" cores cannot carry more than {ceiling:,.0f} requests/s here, {ceiling / one['ops_per_s']:.2f}x the"
        " 1-shard rate: the 2.5x target needs at least one core per master besides the drivers'.",
        "One request = one enqueue (new fingerprint, deduplicated by its shard's bloom filter) and one"
        " lease + ack; rate = enqueues + acks per second over all drivers.",
    ]
    return {
        "title": TITLE,
        "summary": f"{three['ops_per_s']:,.0f} vs {one['ops_per_s']:,.0f} requests/s: {ratio:.2f}x.",
        "tables": [{
            "title": f"Frontier enqueue + dequeue, {drivers} driver processes, batches of {BATCH}, loopback",
            "columns": ["configuration", "requests/s (enqueue + ack)", "server CPU (cores)",
                        "client CPU (cores)", "server CPU us/request"],
            "rows": [
                ["SCHEDULER_SHARDS=1, one redis-server", round(one["ops_per_s"]), one["server_cpu"],
                 one["client_cpu"], round(us_per_request(one, "server_cpu"), 1)],
                [f"SCHEDULER_SHARDS={SHARDS}, 3-master cluster", round(three["ops_per_s"]),
                 three["server_cpu"], three["client_cpu"], round(us_per_request(three, "server_cpu"), 1)],
                ["ratio", round(ratio, 2), "", "", ""],
            ],
            "notes": notes,
        }],
        "data": {
            "single": one, "sharded": three, "ratio": ratio, "cores": cores, "seconds": seconds,
            "ceiling_ops_per_s": ceiling, "ceiling_ratio": ceiling / one["ops_per_s"],
        },
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shards-seconds", type=float, metavar="S", help="shards: seconds per configuration")
    parser.add_argument(
        "--shards-drivers", type=int, metavar="N", help=f"shards: driver processes (default {DRIVERS})"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    add_arguments(parser)
    print(json.dumps(run(parser.parse_args())["data"], indent=2))
