"""Seeds: how fast ``scrapy-dist push`` feeds Redis, and how soon a pushed seed is requested.

* **Push throughput** -- :func:`scrapy_dist.cli.push.push_seeds` (what ``scrapy-dist push`` runs: local
  validation with the spider's rules, multi-value ``RPUSH`` commands pipelined) with a loopback
  ``redis-server``, for ``--seeds-count`` seeds (200,000 by default): plain URLs, and JSON seeds with
  meta and priority. Also the whole command (``scrapy-dist push --file``, process start-up included).
* **Push-to-request latency** -- a running ``scrapy crawl`` worker (a RedisSpider, scrapy-dist's scheduler,
  nothing else to do) and a local HTTP server; for each of ``--seeds-pushes`` pushes (20 by default, at
  random moments 0.2-0.6 s apart so they land anywhere in the worker's loops): the time from just
  before the client's ``LPUSH`` until the request reaches the server (``time.monotonic()`` is one clock
  for every process of a machine). Seeds key as a LIST (blocking ``BLMOVE``) and as a ZSET (polled every
  0.1 s), and scrapy-redis 0.9.1's RedisSpider for comparison (it reads seeds on ``spider_idle``, which
  an idle engine signals every 5 seconds).

``python -m benchmarks.seeds [--quick]`` prints the figures; ``run(args)`` is the harness entry point.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import redis

from benchmarks.processes import interrupt
from benchmarks.redis_server import RedisProcess

TITLE = "Seeds: push throughput (scrapy-dist push) and push-to-request latency"

SPIDERS = """
from scrapy_dist.spiders import RedisSpider


class BenchSeeds(RedisSpider):
    name = "benchseeds"

    def parse(self, response):
        pass


class BenchZSeeds(BenchSeeds):
    name = "benchzseeds"
    custom_settings = {"REDIS_START_URLS_AS_ZSET": True}
"""

SCRAPY_REDIS_SPIDERS = """
from scrapy_redis.spiders import RedisSpider


class BenchSeedsScrapyRedis(RedisSpider):
    name = "benchseeds_sr"

    def parse(self, response):
        pass
"""

#: (label, spider name, key kind, spider module source, extra settings)
CONTESTANTS = [
    (
        "scrapy-dist RedisSpider, LIST (BLMOVE)",
        "benchseeds",
        "list",
        SPIDERS,
        {
            "SCHEDULER": "scrapy_dist.scheduler.Scheduler",
            "DUPEFILTER_CLASS": "scrapy_dist.dupefilter.BloomDupeFilter",
            "BLOOMFILTER_CAPACITY": 1_000_000,
            "SCHEDULER_DENY_NETWORKS": "[]",  # the local site is on loopback: denied by default
        },
    ),
    (
        "scrapy-dist RedisSpider, ZSET (polled)",
        "benchzseeds",
        "zset",
        SPIDERS,
        {
            "SCHEDULER": "scrapy_dist.scheduler.Scheduler",
            "DUPEFILTER_CLASS": "scrapy_dist.dupefilter.BloomDupeFilter",
            "BLOOMFILTER_CAPACITY": 1_000_000,
            "SCHEDULER_DENY_NETWORKS": "[]",  # the local site is on loopback: denied by default
        },
    ),
    (
        "scrapy-redis 0.9.1 RedisSpider, LIST",
        "benchseeds_sr",
        "list",
        SCRAPY_REDIS_SPIDERS,
        {
            "SCHEDULER": "scrapy_redis.scheduler.Scheduler",
            "DUPEFILTER_CLASS": "scrapy_redis.dupefilter.RFPDupeFilter",
        },
    ),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--seeds-count",
        type=int,
        metavar="N",
        help="seeds pushed in the throughput test (default 200,000; 20,000 with --quick)",
    )
    parser.add_argument(
        "--seeds-pushes",
        type=int,
        metavar="N",
        help="pushes timed per latency contestant (default 20; 8 with --quick)",
    )


# -- push throughput --------------------------------------------------------------------------------
def _plain(i: int) -> bytes:
    return f"https://shop{i % 97}.example.com/catalogue/category/books_{i % 50}/page-{i}.html".encode()


def _json(i: int) -> bytes:
    return json.dumps(
        {"url": _plain(i).decode(), "priority": i % 10, "meta": {"campaign": "spring", "rank": i}},
        separators=(",", ":"),
    ).encode()


def measure_push(redis_url: str, count: int, tmp: Path) -> dict[str, Any]:
    from scrapy_dist.cli.push import PushOptions, push_seeds

    client = redis.Redis.from_url(redis_url)
    rows = {}
    for label, make in (("plain URLs", _plain), ("JSON seeds (meta, priority)", _json)):
        client.delete("bench:start_urls")
        seeds = [(str(i), make(i)) for i in range(count)]
        report = push_seeds(client, "bench:start_urls", seeds, PushOptions())
        assert report.pushed == count and client.llen("bench:start_urls") == count, report
        rows[label] = {"seeds": count, "seconds": report.seconds, "per_second": count / report.seconds}
    # the whole command, reading a file, process start-up included
    path = tmp / "seeds.txt"
    path.write_bytes(b"\n".join(_plain(i) for i in range(count)) + b"\n")
    client.delete("bench:start_urls")
    started = time.perf_counter()
    command = [sys.executable, "-c", "from scrapy_dist.cli import main; main()"]
    subprocess.run(
        [*command, "--redis-url", redis_url, "push", "bench", "--file", str(path)],
        check=True,
        capture_output=True,
        cwd=tmp,
        timeout=600,
    )
    seconds = time.perf_counter() - started
    assert client.llen("bench:start_urls") == count
    rows["scrapy-dist push --file (whole command)"] = {
        "seeds": count,
        "seconds": seconds,
        "per_second": count / seconds,
    }
    client.delete("bench:start_urls")
    client.close()
    return rows


# -- latency ----------------------------------------------------------------------------------------
class _ArrivalServer:
    """Records when each path is first requested (``time.monotonic()``) and signals waiters."""

    def __init__(self) -> None:
        self.arrivals: dict[str, float] = {}
        self.cond = threading.Condition()
        bench = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802
                now = time.monotonic()
                with bench.cond:
                    bench.arrivals.setdefault(self.path, now)
                    bench.cond.notify_all()
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *a: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def wait_for(self, path: str, timeout: float) -> float | None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while path not in self.arrivals:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)
            return self.arrivals[path]

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _project(root: Path, spiders: str) -> None:
    pkg = root / "benchseedsproj"
    (pkg / "spiders").mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "spiders" / "__init__.py").write_text(textwrap.dedent(spiders))
    (pkg / "settings.py").write_text(
        'BOT_NAME = "benchseedsproj"\nSPIDER_MODULES = ["benchseedsproj.spiders"]\nROBOTSTXT_OBEY = False\n'
        'LOG_LEVEL = "INFO"\nTELNETCONSOLE_ENABLED = False\n'
    )
    (root / "scrapy.cfg").write_text("[settings]\ndefault = benchseedsproj.settings\n")


def measure_latency(
    redis_url: str,
    label: str,
    spider: str,
    kind: str,
    spiders: str,
    settings: dict[str, Any],
    pushes: int,
    tmp: Path,
) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="seeds-", dir=tmp))
    _project(root, spiders)
    server = _ArrivalServer()
    client = redis.Redis.from_url(redis_url)
    key = f"{spider}:start_urls"
    client.delete(key)

    def push(path: str) -> float:
        url = server.url + path
        t0 = time.monotonic()
        if kind == "zset":
            client.zadd(key, {url: 0})
        else:
            client.lpush(key, url)
        return t0

    cmd = [sys.executable, "-m", "scrapy", "crawl", spider, "-s", f"REDIS_URL={redis_url}"]
    for k, v in settings.items():
        cmd += ["-s", f"{k}={v}"]
    log = root / "worker.log"
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=root, stdout=fh, stderr=subprocess.STDOUT, env=env)
    latencies: list[float] = []
    try:
        push("/warmup")
        if server.wait_for("/warmup", 60) is None:
            raise RuntimeError(
                f"{label}: the worker never requested the warm-up seed; log:\n"
                + log.read_text(errors="replace")[-3000:]
            )
        rng = random.Random(7)
        for i in range(pushes):
            time.sleep(rng.uniform(0.2, 0.6))
            path = f"/seed/{i}"
            t0 = push(path)
            arrived = server.wait_for(path, 30)
            if arrived is None:
                raise RuntimeError(f"{label}: seed {i} not requested within 30 s")
            latencies.append(arrived - t0)
    finally:
        interrupt(proc, 30)
        server.stop()
        client.close()
    ordered = sorted(latencies)
    return {
        "pushes": len(latencies),
        "median_ms": statistics.median(latencies) * 1000,
        "p95_ms": ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))] * 1000,
        "max_ms": ordered[-1] * 1000,
        "all_ms": [round(x * 1000, 2) for x in latencies],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    quick = getattr(args, "quick", False)
    count = getattr(args, "seeds_count", None) or (20_000 if quick else 200_000)
    pushes = getattr(args, "seeds_pushes", None) or (8 if quick else 20)
    tmp = Path(getattr(args, "tmp_dir", None) or tempfile.mkdtemp(prefix="bench-seeds-"))
    tmp.mkdir(parents=True, exist_ok=True)
    server = RedisProcess().start()
    notes: list[str] = []
    try:
        push_rows = measure_push(server.url, count, tmp)
        latency: dict[str, Any] = {}
        for label, spider, kind, spiders, settings in CONTESTANTS:
            server_client = redis.Redis.from_url(server.url)
            server_client.flushdb()
            server_client.close()
            n = pushes if "scrapy-redis" not in label else max(4, pushes // 2)
            try:
                latency[label] = measure_latency(server.url, label, spider, kind, spiders, settings, n, tmp)
            except Exception as exc:  # the incumbent may not run on this Scrapy: note it, keep ours
                notes.append(f"{label}: not measured ({type(exc).__name__}: {str(exc)[:300]})")
    finally:
        server.stop()
    return {
        "title": TITLE,
        "summary": (
            f"`scrapy-dist push` validates and pushes {count:,} seeds over loopback; a RedisSpider worker"
            " that is waiting requests a pushed seed after the latency shown (client LPUSH -> request at"
            " the HTTP server)."
        ),
        "tables": [
            {
                "title": "Push throughput (loopback redis-server)",
                "columns": ["workload", "seeds", "seconds", "seeds/s"],
                "rows": [
                    [k, v["seeds"], round(v["seconds"], 3), round(v["per_second"])]
                    for k, v in push_rows.items()
                ],
            },
            {
                "title": "Push-to-request latency (idle worker, loopback)",
                "columns": ["reader", "pushes", "median ms", "p95 ms", "max ms"],
                "rows": [
                    [k, v["pushes"], round(v["median_ms"], 1), round(v["p95_ms"], 1), round(v["max_ms"], 1)]
                    for k, v in latency.items()
                ],
            },
        ],
        "notes": notes,
        "data": {"push": push_rows, "latency": latency},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=TITLE)
    parser.add_argument("--quick", action="store_true")
    add_arguments(parser)
    result = run(parser.parse_args())
    for table in result["tables"]:
        print(f"\n{table['title']}")
        print(" | ".join(table["columns"]))
        for row in table["rows"]:
            print(" | ".join(f"{c:,}" if isinstance(c, int) else str(c) for c in row))
    for note in result["notes"]:
        print("note:", note)


if __name__ == "__main__":
    main()
