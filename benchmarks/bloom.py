"""scrapy-dist's BloomDupeFilter at its declared capacity: memory, false-positive rate, checks/s.

Fills a fresh Redis with ``capacity`` random fingerprints through the batched path (the ``dupe_batch``
script, the same ``dupe.lua`` code the scheduler's sync script runs; batches of 500 as the scheduler
sends them), then

* bytes of Redis memory per URL, three ways: ``used_memory`` growth from the fresh server to the full
  filter / URLs inserted (everything the server allocated on the filter's behalf, default configuration,
  per-server fixed costs included), ``MEMORY USAGE`` of the filter's keys, and the ``used_memory`` freed by
  deleting them (what the filter itself holds); the difference is reported as fixed costs;
* false negatives: every inserted fingerprint is checked again (must be 0);
* measured false-positive rate: 100,000 fingerprints never inserted, checked without inserting;
* checks per second per process: fingerprints tested (and set) per second during the fill, and tested per
  second during the re-check, each from one Python process on loopback.

``python -m benchmarks.bloom [--quick] [--no-latency-tracking]`` prints the figures; ``run(args)`` is the
harness entry point.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import redis

from benchmarks.redis_server import RedisProcess, used_memory
from scrapy_dist.dupefilter import BloomDupeFilter
from scrapy_dist.dupefilter.bloom import fingerprint_hashes
from scrapy_dist.redis.keys import CrawlKeys

TITLE = "scrapy-dist BloomDupeFilter at declared capacity"
BATCH = 500


def _fps(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [fingerprint_hashes(rng.randbytes(20)) for _ in range(n)]


def measure(
    capacity: int, error_rate: float = 0.001, unseen: int = 100_000, latency_tracking: bool = True
) -> dict:
    server = RedisProcess().start()
    try:
        client = redis.Redis(port=server.port)
        if not latency_tracking and client.config_get("latency-tracking"):
            client.config_set("latency-tracking", "no")
        # Default server configuration (slow log on: each script call stays far below its 10 ms), and
        # the baseline is the fresh server: the growth counts the Lua VM, the script cache, the client's
        # buffers and, on Redis >= 7, one latency histogram (~24 KB) per command name ever run.
        before = used_memory(client)
        df = BloomDupeFilter(client, CrawlKeys("bench"), None, capacity=capacity, error_rate=error_rate)
        df.open()
        tokens = _fps(capacity, 1)
        t = time.perf_counter()
        first_seen = 0
        for i in range(0, len(tokens), BATCH):
            first_seen += sum(df.seen_tokens(tokens[i : i + BATCH]))
        fill_s = time.perf_counter() - t
        memory = used_memory(client) - before
        key_memory = sum(client.memory_usage(k, samples=0) or 0 for k in client.keys("*"))
        t = time.perf_counter()
        false_negatives = 0
        for i in range(0, len(tokens), BATCH):
            false_negatives += sum(not s for s in df.seen_tokens(tokens[i : i + BATCH], add=False))
        check_s = time.perf_counter() - t
        probes = _fps(unseen, 2)
        fp = 0
        for i in range(0, len(probes), BATCH):
            fp += sum(df.seen_tokens(probes[i : i + BATCH], add=False))
        # what the filter itself holds: used_memory freed by deleting its keys
        held_before = used_memory(client)
        client.delete(*client.keys("*bloom*"))
        held = held_before - used_memory(client)
        client_config = {k: str(v) for k, v in client.config_get("latency-tracking").items()}
        client.close()
    finally:
        server.stop()
    return {
        "capacity": capacity,
        "error_rate": error_rate,
        "inserted": capacity - first_seen,
        "bytes_per_url": memory / capacity,
        "key_bytes_per_url": key_memory / capacity,
        "held_bytes_per_url": held / capacity,
        "planned_bytes_per_url": df.plan.bytes_per_item_at_capacity,
        "fixed_cost_bytes": memory - held,
        "latency_tracking": client_config.get("latency-tracking", "n/a (Redis < 7)"),
        "false_negatives": false_negatives,
        "measured_fpr": fp / unseen,
        "estimated_fpr": df.plan.false_positive_rate(capacity),
        "test_and_set_per_s": capacity / fill_s,
        "checks_per_s": capacity / check_s,
        "filters": len(df.plan.filters_for(capacity - 1)),
    }


def run(args: argparse.Namespace) -> dict:
    quick = getattr(args, "quick", False)
    r = measure(
        100_000 if quick else 1_000_000,
        unseen=20_000 if quick else 100_000,
        latency_tracking=not getattr(args, "no_latency_tracking", False),
    )
    rows = [[
        r["capacity"], round(r["bytes_per_url"], 3), round(r["key_bytes_per_url"], 3),
        round(r["held_bytes_per_url"], 3), round(r["fixed_cost_bytes"] / 1024), r["false_negatives"],
        round(r["measured_fpr"], 5), round(r["test_and_set_per_s"]), round(r["checks_per_s"]),
    ]]
    return {
        "title": TITLE,
        "tables": [{
            "title": "Bloom filter at capacity (error rate 0.001, loopback, one process, batches of 500)",
            "columns": ["URLs", "bytes/URL (used_memory growth from a fresh server)",
                        "bytes/URL (MEMORY USAGE)", "bytes/URL (freed by DEL)", "fixed costs (KB)",
                        "false negatives", "measured FPR", "test-and-set/s", "checks/s"],
            "rows": rows,
        }],
        "data": r,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--no-latency-tracking", action="store_true",
        help="Redis >= 7: CONFIG SET latency-tracking no first (its per-command histograms are a fixed cost)",
    )
    print(json.dumps(run(parser.parse_args())["data"], indent=2))
