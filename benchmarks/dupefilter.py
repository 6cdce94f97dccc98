"""Dupefilter memory and speed: scrapy-redis's RFPDupeFilter vs scrapy-dist's BloomDupeFilter.

scrapy-redis keeps every fingerprint, a 40-character hex SHA1, in one Redis SET (``SADD`` per request).
Its cost per URL is measured by filling a fresh Redis with N such fingerprints through pipelined ``SADD``
(1,000 members per command; a SET's memory does not depend on how members arrive) and dividing the growth
of ``used_memory`` by N. Computing N real ``request_fingerprint``s (JSON + ``canonicalize_url`` + SHA1) would
take minutes at N = 1,000,000 for the same bytes, so the fingerprints are SHA1 hex digests of the URLs; a
calibration row at 20,000 URLs goes through ``RFPDupeFilter.request_seen`` itself (one ``SADD`` round trip
each) and gives its checks/s on loopback.

The scrapy-dist side comes from ``benchmarks/bloom.py`` (the dupefilter's own module) via
``bloom.measure(capacity=N, unseen=U)``, which returns ``bytes_per_url``, ``measured_fpr`` and
``checks_per_s`` (see docs/benchmarks.md). Until that module exists the row says so.
"""

from __future__ import annotations

import argparse
import importlib

from benchmarks import redis_memory

TITLE = "dupefilter memory per URL, false positives and checks/s: RFPDupeFilter vs BloomDupeFilter"

#: URLs checked through the real request_seen() for the calibration row.
CALIBRATION_N = 20_000
SADD_MEMBERS = 1_000  # fingerprints per SADD command
PIPELINE_COMMANDS = 20  # SADD commands per pipeline round trip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dupefilter benchmark")
    group.add_argument(
        "--dupefilter-urls",
        type=int,
        metavar="N",
        help="URLs remembered (default 1,000,000; 20,000 with --quick)",
    )
    group.add_argument(
        "--dupefilter-unseen",
        type=int,
        metavar="N",
        help="never-seen URLs probed for the Bloom filter's false-positive rate "
        "(default 100,000; 10,000 with --quick)",
    )


def _sadd_fingerprints(n: int):
    fps = redis_memory.fingerprints(n)

    def write(client) -> None:
        pipe = client.pipeline(transaction=False)
        for k, i in enumerate(range(0, n, SADD_MEMBERS), start=1):
            pipe.sadd("bench:dupefilter", *fps[i : i + SADD_MEMBERS])
            if k % PIPELINE_COMMANDS == 0:
                pipe.execute()
        pipe.execute()
        assert client.scard("bench:dupefilter") == n

    return write


def scrapy_dist_side(n: int, unseen: int) -> dict:
    """HOOK: the BloomDupeFilter figures from ``benchmarks.bloom.measure`` (written by the dupefilter's
    engineer), or ``{"skipped": reason}``."""
    try:
        bloom = importlib.import_module("benchmarks.bloom")
    except ModuleNotFoundError as exc:
        if exc.name not in ("benchmarks.bloom", "scrapy_dist.dupefilter.bloom", "scrapy_dist.dupefilter"):
            raise
        return {"skipped": f"{exc.name} does not exist yet"}
    except ImportError as exc:  # scrapy_dist.dupefilter exists but lacks what bloom.py imports
        return {"skipped": f"benchmarks.bloom cannot be imported yet ({exc})"}
    if not hasattr(bloom, "measure"):
        return {"skipped": "benchmarks.bloom has no measure(capacity, unseen=...) yet"}
    return bloom.measure(capacity=n, unseen=unseen)


def run(args: argparse.Namespace) -> dict:
    n = args.dupefilter_urls or (20_000 if args.quick else 1_000_000)
    unseen = args.dupefilter_unseen or (10_000 if args.quick else 100_000)
    print(f"   scrapy-redis: {n:,} fingerprints by pipelined SADD", flush=True)
    synthetic = redis_memory.bytes_per_entry(_sadd_fingerprints(n), n)
    cal_n = min(n, CALIBRATION_N)
    print(f"   scrapy-redis: {cal_n:,} requests through RFPDupeFilter.request_seen", flush=True)
    requests = redis_memory.plain_requests(cal_n)
    calibration = redis_memory.bytes_per_entry(redis_memory.scrapy_redis_dupefilter(requests), cal_n)
    calibration["checks_per_s"] = cal_n / calibration["write_seconds"]
    print(f"   scrapy-dist: BloomDupeFilter at capacity {n:,}, {unseen:,} unseen URLs", flush=True)
    dist = scrapy_dist_side(n, unseen)

    sr = synthetic["bytes_per_entry"]
    rows = [
        ["scrapy-redis RFPDupeFilter (SET of hex SHA1)", n, sr, 1.0, "0 (exact)", None],
        [
            "scrapy-redis RFPDupeFilter via request_seen()",
            cal_n,
            calibration["bytes_per_entry"],
            calibration["bytes_per_entry"] / sr,
            "0 (exact)",
            calibration["checks_per_s"],
        ],
    ]
    notes = []
    if "skipped" in dist:
        rows.append(["scrapy-dist BloomDupeFilter", n, "skipped", None, None, None])
        notes.append(f"scrapy-dist side skipped: {dist['skipped']}.")
    else:
        rows.append(
            [
                f"scrapy-dist BloomDupeFilter (error rate {dist.get('error_rate', '?')})",
                dist.get("capacity", n),
                dist.get("bytes_per_url"),
                (dist.get("bytes_per_url") or 0) / sr,
                dist.get("measured_fpr"),
                dist.get("checks_per_s"),
            ]
        )
    return {
        "title": TITLE,
        "tables": [
            {
                "title": "Redis bytes per remembered URL (fresh Redis, used_memory growth / URLs)",
                "columns": [
                    "Filter",
                    "URLs",
                    "Bytes/URL",
                    "vs scrapy-redis",
                    "Measured FPR",
                    "Checks/s (loopback)",
                ],
                "rows": rows,
                "notes": [
                    "Row 1 fills the SET by pipelined SADD of SHA1 hex digests (same type and length "
                    "as RFPDupeFilter's fingerprints); row 2 calls request_seen() for real, one round trip "
                    "each, at a smaller N: a SET's bytes/URL steps with its hash table size, so rows "
                    "differ a little.",
                    "Checks/s: one Python process on loopback. For the Bloom filter, fingerprints are "
                    "tested in the batched path (see benchmarks/bloom.py).",
                ],
            }
        ],
        "charts": [
            {
                "title": f"Redis bytes per remembered URL (N={n:,}, lower is better)",
                "ylabel": "bytes",
                "categories": ["dupefilter"],
                "series": {"scrapy-redis": [sr], "scrapy-dist": [dist.get("bytes_per_url")]},
            }
        ],
        "notes": notes,
        "data": {
            "urls": n,
            "unseen": unseen,
            "scrapy_redis": synthetic,
            "scrapy_redis_request_seen": calibration,
            "scrapy_dist": dist,
        },
    }
