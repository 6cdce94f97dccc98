"""Continuous crawling: a site whose pages change, revisited for a few simulated cycles, with and without
conditional requests; and the Redis memory a remembered URL costs with expiring fingerprints.

**Revisits.** A local site of ``--continuous-pages`` pages (10,000 by default) where, every cycle of
``--continuous-cycle`` seconds (a stand-in for a day), a share of the pages (``--continuous-change``, 10%)
changes: new content, new ``ETag`` and ``Last-Modified``; it answers ``304`` to a matching
``If-None-Match``. One ``scrapy crawl`` worker crawls it from page 0 with ``REVISIT_AFTER = {"*": cycle}``
and ``SCHEDULER_IDLE_BEFORE_CLOSE = None`` until every page has been fetched ``cycles + 1`` times (the
first crawl and ``cycles`` revisits), once with ``REVISIT_CONDITIONAL = True`` and once without. Reported per
fetch round (round 0 = the first crawl): pages fetched, 200s, 304s, bytes of body downloaded, and whether
any page that had changed was answered 304 (it must not be).

**Memory per remembered URL.** A fresh ``redis-server`` per configuration; URLs arrive at
``--continuous-urls`` per TTL (the filter's ``BLOOMFILTER_CAPACITY``) through the dupefilter's own batched
path with injected time, for two TTLs, so every generation has filled; then the live generations' keys
are measured with ``MEMORY USAGE`` and divided by the URLs remembered over one TTL. Compared with the
filter without a TTL holding the same number of URLs.
"""

from __future__ import annotations

import argparse
import email.utils
import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import redis

from benchmarks.processes import interrupt
from benchmarks.redis_server import RedisProcess

TITLE = "Continuous crawling: revisits, conditional requests, memory of expiring fingerprints"
REPO = Path(__file__).resolve().parent.parent
PROJECT = Path(__file__).resolve().parent / "bench_project"
#: padding that brings a page to a realistic size (bytes of body per page)
PAGE_BYTES = 12_000
LINKS = 5
#: turns a conditional revisit's 304 into "not modified" (the add-on enables it; the bench project has none)
MIDDLEWARE = "scrapy_dist.middlewares.ConditionalRevisitMiddleware"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("continuous")
    g.add_argument("--continuous-pages", type=int, metavar="N", help="pages of the site (default 10,000)")
    g.add_argument("--continuous-cycle", type=float, metavar="S", help="seconds per simulated cycle (90)")
    g.add_argument("--continuous-cycles", type=int, metavar="N",
                   help="revisit cycles after the first crawl (3)")
    g.add_argument("--continuous-change", type=float, default=0.1, metavar="F",
                   help="share of the pages that change each cycle (default 0.1)")
    g.add_argument("--continuous-urls", type=int, metavar="N",
                   help="URLs per TTL for the memory measurement (default 500,000)")


class ChangingSite:
    """``/page/<i>`` for i < pages; page i changes in cycle c (c >= 1) when a hash of (i, c) falls under
    ``change``. Records (monotonic time, page, status, body bytes, changed since the previous fetch)."""

    def __init__(self, pages: int, cycle: float, change: float) -> None:
        self.pages, self.cycle, self.change = pages, cycle, change
        self.t0 = time.time()
        self.log: list[tuple[float, int, int, int]] = []
        self.lock = threading.Lock()
        self.last_version: dict[int, int] = {}
        self.changed_but_304 = 0
        site = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                site.serve(self)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.request_queue_size = 128
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def changes(self, i: int, c: int) -> bool:
        h = hashlib.blake2b(f"{i}:{c}".encode(), digest_size=8).digest()
        return int.from_bytes(h, "big") / 2**64 < self.change

    def version(self, i: int, now: float) -> tuple[int, float]:
        """(version, when it last changed) of page i at ``now``."""
        current = int((now - self.t0) // self.cycle)
        last = max((c for c in range(1, current + 1) if self.changes(i, c)), default=0)
        return last, self.t0 + last * self.cycle

    def serve(self, h: BaseHTTPRequestHandler) -> None:
        try:
            i = int(h.path.rsplit("/", 1)[1])
            assert h.path.startswith("/page/") and 0 <= i < self.pages
        except (ValueError, IndexError, AssertionError):
            h.send_response(404)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        version, since = self.version(i, time.time())
        etag = f'"{i}-{version}"'
        if h.headers.get("If-None-Match") == etag:
            status, body = 304, b""
        else:
            targets = [(i * 7 + k * 13 + 1) % self.pages for k in range(LINKS)]
            links = "".join(f'<a href="/page/{t}">l</a>' for t in targets)
            links += f'<a href="/page/{(i + 1) % self.pages}">next</a>'
            head = f"<html><head><title>page {i} v{version}</title></head><body>{links}<p>"
            body = (head + "x" * max(0, PAGE_BYTES - len(head) - 20) + "</p></body></html>").encode()
            status = 200
        with self.lock:
            before = self.last_version.get(i)
            if status == 304 and before is not None and before != version:
                self.changed_but_304 += 1
            self.last_version[i] = version
            self.log.append((time.monotonic(), i, status, len(body)))
        h.send_response(status)
        h.send_header("ETag", etag)
        h.send_header("Last-Modified", email.utils.formatdate(since, usegmt=True))
        h.send_header("Content-Type", "text/html")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if body:
            h.wfile.write(body)

    def fetches(self) -> Counter[int]:
        with self.lock:
            return Counter(i for _, i, _, _ in self.log)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _rounds(site: ChangingSite, rounds: int) -> list[dict]:
    """Per fetch round k (a page's k-th fetch): fetches, 200s, 304s, body bytes."""
    seen: Counter[int] = Counter()
    out: dict[int, Counter[str]] = defaultdict(Counter)
    with site.lock:
        log = list(site.log)
    for _, i, status, size in log:
        k = seen[i]
        seen[i] += 1
        if k >= rounds:
            continue
        out[k]["fetched"] += 1
        out[k][str(status)] += 1
        out[k]["bytes"] += size
    return [dict(out[k]) for k in range(rounds)]


def crawl_continuously(args: argparse.Namespace, conditional: bool, tag: str) -> dict:
    pages, cycle, cycles = args.c_pages, args.c_cycle, args.c_cycles
    site = ChangingSite(pages, cycle, args.continuous_change)
    server = RedisProcess().start()
    settings = {
        "SCHEDULER": "scrapy_dist.scheduler.Scheduler",
        "DUPEFILTER_CLASS": "scrapy_dist.dupefilter.BloomDupeFilter",
        "BLOOMFILTER_CAPACITY": max(10_000, pages * 2),
        "REDIS_URL": f"redis://127.0.0.1:{server.port}",
        "REVISIT_AFTER": json.dumps({"*": cycle}),
        "REVISIT_MIN_INTERVAL": 0,  # a cycle of seconds stands in for a day
        "SCHEDULER_DENY_NETWORKS": "[]",  # the local site is on loopback: denied by default
        "REVISIT_CONDITIONAL": conditional,
        "DOWNLOADER_MIDDLEWARES": json.dumps({MIDDLEWARE: 580}),
        "SCHEDULER_IDLE_BEFORE_CLOSE": "none",
        "SCHEDULER_IDLE_POLL_MAX": 1.0,
        "BENCH_STATS_FILE": str(args.tmp_dir / f"continuous-{tag}.stats.json"),
        "LOG_LEVEL": "INFO",
    }
    cmd = [sys.executable, "-m", "scrapy", "crawl", "bench", "-a", f"start_url={site.url}/page/0"]
    for k, v in settings.items():
        cmd += ["-s", f"{k}={v}"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    log_path = args.tmp_dir / f"continuous-{tag}.log"
    deadline = time.monotonic() + max(600.0, pages / 50) + cycle * cycles * 2
    t = time.monotonic()
    done = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=PROJECT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while time.monotonic() < deadline and proc.poll() is None:
                counts = site.fetches()
                # a bloom filter's false positives (~0.05% at this fill) leave a few pages never found:
                # done when every page found has been fetched cycles + 1 times
                if len(counts) >= pages * 0.99 and min(counts.values()) >= cycles + 1:
                    done = True
                    break
                time.sleep(1)
        finally:
            interrupt(proc, 60)
    wall = time.monotonic() - t
    client = redis.Redis(port=server.port)
    used = int(client.info("memory")["used_memory"])
    client.close()
    server.stop()
    site.stop()
    counts = site.fetches()
    return {
        "conditional": conditional,
        "complete": done,
        "wall_s": round(wall, 1),
        "pages_reached": len(counts),
        "pages_never_found": pages - len(counts),
        "rounds": _rounds(site, cycles + 1),
        "changed_but_304": site.changed_but_304,
        "redis_used_memory": used,
        "log": str(log_path),
    }


def memory_per_url(urls: int, ttl: float | None, generations: int, load: float = 1.0) -> dict:
    """Redis memory of a filter with ``BLOOMFILTER_CAPACITY = urls``: for a TTL, ``load * urls`` URLs
    arrive per TTL, evenly (each generation gets its share), for two TTLs, so every live generation has
    filled; without one, ``urls`` URLs are inserted. Memory is ``MEMORY USAGE`` of the live keys."""
    from scrapy_dist.dupefilter import BloomDupeFilter
    from scrapy_dist.redis.keys import CrawlKeys

    server = RedisProcess().start()
    client = redis.Redis(port=server.port)
    client.config_set("slowlog-log-slower-than", -1)
    keys = CrawlKeys("mem")
    df = BloomDupeFilter(client, keys, None, capacity=urls, ttl=ttl, generations=generations)
    df.open()
    rng = random.Random(1)
    if df.gens is None:
        steps = [(0.0, urls)]
    else:
        span, per_gen = df.gens.span, round(load * urls / (generations - 1))
        t0 = (int(time.time() / span) + 1) * span
        steps = [(t0 + g * span + span * j / 8, per_gen // 8 + (j < per_gen % 8))
                 for g in range(2 * (generations - 1)) for j in range(8)]
    start = time.perf_counter()
    total = 0
    for now, count in steps:
        for i in range(0, count, 2000):
            toks = [df.fingerprint_tokens(rng.randbytes(20)) for _ in range(min(2000, count - i))]
            df.run_batch("add", toks, now=now or None)
        total += count
    seconds = time.perf_counter() - start
    if df.gens is not None:
        live = df.gens.live(steps[-1][0])
        names = [keys.bloom_generation(e) for e in live]
        names += [k.decode() for e in live for k in client.keys(f"{keys.tag}:bloom:g{e}:*")]
        remembered = sum(int(client.hget(keys.bloom_generation(e), "n") or 0) for e in live)
    else:
        names = [k.decode() for k in client.keys(f"{keys.tag}:bloom:*")]
        remembered = urls
    used = sum(client.memory_usage(k, samples=0) or 0 for k in names)
    client.close()
    server.stop()
    return {
        "ttl": ttl, "generations": generations if ttl else None, "capacity": urls, "load": load,
        "bytes": used, "bytes_per_url_per_ttl": used / (urls * load), "items_in_live_generations": remembered,
        "insert_us": 1e6 * seconds / total,
    }


def run(args: argparse.Namespace) -> dict:
    args.c_pages = args.continuous_pages or (1000 if args.quick else 10_000)
    args.c_cycle = args.continuous_cycle or (12.0 if args.quick else 90.0)
    args.c_cycles = args.continuous_cycles or (2 if args.quick else 3)
    urls = args.continuous_urls or (50_000 if args.quick else 500_000)
    runs = {
        "conditional": crawl_continuously(args, True, "conditional"),
        "unconditional": crawl_continuously(args, False, "unconditional"),
    }
    rows = []
    for name, r in runs.items():
        for k, rnd in enumerate(r["rounds"]):
            rows.append([name, "first crawl" if k == 0 else f"revisit {k}", rnd.get("fetched", 0),
                         rnd.get("200", 0), rnd.get("304", 0), round(rnd.get("bytes", 0) / 1e6, 2)])
    revisit_bytes = {n: sum(x.get("bytes", 0) for x in r["rounds"][1:]) for n, r in runs.items()}
    saved = 1 - revisit_bytes["conditional"] / revisit_bytes["unconditional"] if revisit_bytes[
        "unconditional"] else None
    memory = [memory_per_url(urls, None, 4)]
    memory += [memory_per_url(urls, 86400.0 * 30, g) for g in (2, 4, 8)]
    memory += [memory_per_url(urls, 86400.0 * 30, 4, load=1.25)]
    mem_rows = [
        ["forever (no TTL)" if m["ttl"] is None else f"TTL, G = {m['generations']}"
         + (f", {m['load']:.0%} of capacity per TTL" if m["load"] != 1 else ""),
         "-" if m["ttl"] is None else f"{1:.0%} .. {m['generations'] / (m['generations'] - 1):.0%} of TTL",
         f"{m['bytes'] / 1e6:.1f}", f"{m['bytes_per_url_per_ttl']:.2f}", f"{m['insert_us']:.1f}"]
        for m in memory
    ]
    problems = [n for n, r in runs.items() if not r["complete"] or r["changed_but_304"]]
    return {
        "title": TITLE,
        "summary": (
            f"{args.c_pages:,} pages, {args.continuous_change:.0%} of them changing per {args.c_cycle:g} s"
            f" cycle, {args.c_cycles} revisit cycles. Conditional revisits downloaded"
            f" {revisit_bytes['conditional'] / 1e6:.1f} MB against"
            f" {revisit_bytes['unconditional'] / 1e6:.1f} MB"
            + (f" ({saved:.0%} saved)" if saved is not None else "") + "; changed pages answered 304: "
            + ", ".join(f"{n} {r['changed_but_304']}" for n, r in runs.items()) + "; pages never found (bloom"
            " filter false positives at BLOOMFILTER_ERROR_RATE 0.001): "
            + ", ".join(f"{n} {r['pages_never_found']}" for n, r in runs.items()) + "."
        ),
        "tables": [
            {"title": "Fetches per round", "rows": rows,
             "columns": ["crawl", "round", "fetched", "200", "304", "MB of body"]},
            {"title": f"Redis memory of the bloom filter, BLOOMFILTER_CAPACITY = {urls:,} URLs (per TTL),"
                      " error rate 0.001; bytes per URL seen per TTL",
             "columns": ["fingerprints", "forgotten after", "MB", "bytes per URL", "µs per insert (client)"],
             "rows": mem_rows},
        ],
        "notes": [f"{n}: not every page reached {args.c_cycles + 1} fetches or a changed page got 304"
                  for n in problems],
        "data": {"runs": runs, "memory": memory},
        "failed": bool(problems),
    }
