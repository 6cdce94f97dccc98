"""Items through chaos: every page's items counted while workers are killed and stopped past their lease.

Three ``scrapy crawl`` workers (each page yields 3 items) crawl a local site of ``--pages`` pages (default
2,000) with 4 s leases. Every 2-4 s one of them, at random, is SIGKILLed (and a new worker started in its
place) or SIGSTOPped for the lease plus 2 s and resumed; half way through the crawl the Redis server
(``appendonly yes``) is restarted. Outputs, one crawl each per run: ``RedisPipeline`` to a LIST, to a
STREAM, and feed exports to one local JSON Lines file per worker process.

Reported per crawl: pages fetched, items kept, **lost items** (of the 3 x pages expected), **duplicate
items**, duplicate fetches (200 answers beyond the first for a page), items/s (distinct items kept per
second of the crawl), and the chaos done.

``python -m benchmarks chaos [--pages N] [--chaos-runs N]``; results in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.processes import link_spider

TITLE = ("Items through chaos: RedisPipeline LIST/STREAM and FEEDS jsonl under SIGKILL, SIGSTOP and a Redis"
         " restart")
OUTPUTS = ("list", "stream", "feeds")
LEASE = 4
ITEMS_PER_PAGE = 3
REPO = Path(__file__).resolve().parent.parent

SPIDER = link_spider('ChaosSpider', 'chaos', ITEMS_PER_PAGE)



def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("chaos benchmark")
    group.add_argument("--chaos-runs", type=int, metavar="N",
                       help="crawls per output (default 3; 1 with --quick)")
    group.add_argument("--chaos-outputs", default=",".join(OUTPUTS), metavar="NAME[,NAME]",
                       help=f"which of {', '.join(OUTPUTS)} (default: all)")


def _project(root: Path) -> None:
    pkg = root / "chaosproj"
    (pkg / "spiders").mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "spiders" / "__init__.py").write_text(textwrap.dedent(SPIDER))
    (pkg / "settings.py").write_text(textwrap.dedent("""
        BOT_NAME = "chaosproj"
        SPIDER_MODULES = ["chaosproj.spiders"]
        ROBOTSTXT_OBEY = False
        LOG_LEVEL = "INFO"
        TELNETCONSOLE_ENABLED = False
        SCHEDULER_DENY_NETWORKS = []
        SCHEDULER = "scrapy_dist.scheduler.Scheduler"
        DUPEFILTER_CLASS = "scrapy_dist.dupefilter.BloomDupeFilter"
        CONCURRENT_REQUESTS = 8
        SCHEDULER_IDLE_BEFORE_CLOSE = 3
    """))
    (root / "scrapy.cfg").write_text("[settings]\ndefault = chaosproj.settings\n")


class _Workers:
    def __init__(self, root: Path, url: str, output: str) -> None:
        self.root, self.url, self.output = root, url, output
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, seed: str | None = None) -> subprocess.Popen[bytes]:
        n = len(self.procs)
        settings = {"REDIS_URL": self.url, "SCHEDULER_LEASE_SECONDS": LEASE}
        if self.output == "feeds":
            settings["FEEDS"] = json.dumps({str(self.root / f"feed-{n}.jsonl"): {"format": "jsonlines"}})
        else:
            settings["ITEM_PIPELINES"] = json.dumps({"scrapy_dist.pipelines.RedisPipeline": 300})
            settings["REDIS_ITEMS_STREAM"] = str(self.output == "stream")
        cmd = [sys.executable, "-m", "scrapy", "crawl", "chaos"]
        for k, v in settings.items():
            cmd += ["-s", f"{k}={v}"]
        if seed:
            cmd += ["-a", f"seed={seed}"]
        path = os.pathsep.join([str(self.root), str(REPO), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "PYTHONPATH": path}
        env.pop("SCRAPY_SETTINGS_MODULE", None)
        with open(self.root / f"worker-{n}.log", "wb") as log:
            proc = subprocess.Popen(cmd, cwd=self.root, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs.append(proc)
        return proc

    def alive(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in self.procs if p.poll() is None]

    def stop_all(self) -> None:
        for p in self.alive():
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()


def _items(output: str, client: Any, root: Path) -> list[tuple[str, int]]:
    out = []
    if output == "feeds":
        for path in sorted(root.glob("feed-*.jsonl")):
            for line in path.read_text().splitlines():
                try:
                    item = json.loads(line)
                except ValueError:  # a killed worker's last line may be cut short
                    continue
                out.append((item["url"], item["part"]))
    elif output == "stream":
        rows = client.xrange("chaos:items")
        out = [(d["url"], d["part"]) for d in (json.loads(f[b"item"]) for _, f in rows)]
    else:
        out = [(d["url"], d["part"]) for d in (json.loads(v) for v in client.lrange("chaos:items", 0, -1))]
    return out


def crawl_once(output: str, pages: int, seed: int) -> dict[str, Any]:
    """One crawl of ``pages`` pages with chaos; the counts of what reached the output."""
    import redis

    from benchmarks.redis_server import RedisProcess
    from scrapy_dist.demo.site import SiteGraph, SiteServer

    rng = random.Random(seed)
    server = RedisProcess(extra_args=["--appendonly", "yes", "--appendfsync", "everysec"]).start()
    site = SiteServer(SiteGraph(pages, 6), delay=0.02).start()
    root = Path(tempfile.mkdtemp(prefix=f"chaos-{output}-"))
    _project(root)
    workers = _Workers(root, server.url, output)
    chaos: Counter[str] = Counter()
    restarted = False
    started = time.monotonic()
    try:
        workers.start(site.page_url(0))
        workers.start()
        workers.start()
        next_chaos = time.monotonic() + rng.uniform(2, 4)
        deadline = started + max(300, pages / 5)
        while workers.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
            done = len(site.fetch_counts())
            if not restarted and done >= pages // 2:
                server.proc.terminate()  # SIGTERM: Redis writes its AOF out and exits
                server.proc.wait(30)
                time.sleep(1)
                server._spawn(30)  # same port, same directory: it loads the AOF
                restarted = True
                chaos["redis restarts"] += 1
            # chaos starts once the seed's page is in (a worker killed before that takes the seed along)
            if time.monotonic() < next_chaos or done < 20 or done >= pages * 0.95:
                continue
            next_chaos = time.monotonic() + rng.uniform(2, 4)
            victims = workers.alive()
            if not victims:
                break
            victim = rng.choice(victims)
            if rng.random() < 0.5:
                victim.send_signal(signal.SIGKILL)
                victim.wait()
                workers.start()
                chaos["SIGKILL"] += 1
            else:
                victim.send_signal(signal.SIGSTOP)
                time.sleep(LEASE + 2)
                victim.send_signal(signal.SIGCONT)
                chaos["SIGSTOP past the lease"] += 1
        elapsed = time.monotonic() - started
        timed_out = bool(workers.alive())
        client = redis.Redis.from_url(server.url)
        found = Counter(_items(output, client, root))
        client.close()
    finally:
        workers.stop_all()
        site_counts = site.fetch_counts()
        site.stop()
        server.stop()
    expected = {(site.page_url(i), part) for i in range(pages) for part in range(ITEMS_PER_PAGE)}
    kept = set(found) & expected
    return {
        "output": output, "pages": len(site_counts), "pages_expected": pages,
        "items": sum(found.values()), "lost_items": len(expected - kept),
        "duplicate_items": sum(n - 1 for n in found.values()),
        "duplicate_fetches": sum(n - 1 for n in site_counts.values()),
        "items_per_s": round(len(kept) / elapsed, 1), "seconds": round(elapsed, 1),
        "chaos": dict(chaos), "timed_out": timed_out, "logs": str(root),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    quick = getattr(args, "quick", False)
    pages = getattr(args, "pages", None) or (600 if quick else 2_000)
    runs = getattr(args, "chaos_runs", None) or (1 if quick else 3)
    outputs = [o for o in getattr(args, "chaos_outputs", ",".join(OUTPUTS)).split(",") if o in OUTPUTS]
    rows = []
    for i in range(runs):
        for output in outputs:
            r = crawl_once(output, pages, seed=1000 * i + OUTPUTS.index(output))
            print(json.dumps(r), flush=True)
            rows.append(r)
    # the guarantees: RedisPipeline exactly once, feeds nothing lost
    failed = any(
        r["timed_out"] or r["lost_items"] or (r["output"] != "feeds" and r["duplicate_items"]) for r in rows
    )
    chaos_text = lambda c: ", ".join(f"{n} {k}" for k, n in sorted(c.items()))  # noqa: E731
    return {
        "title": TITLE,
        "summary": "; ".join(
            f"{o}: {sum(r['lost_items'] for r in rows if r['output'] == o)} lost and"
            f" {sum(r['duplicate_items'] for r in rows if r['output'] == o)} duplicate items in"
            f" {sum(1 for r in rows if r['output'] == o)} runs" for o in outputs
        ),
        "tables": [{
            "title": f"{pages} pages x {ITEMS_PER_PAGE} items, 3 workers, {LEASE} s leases",
            "columns": ["output", "pages", "items", "lost items", "duplicate items", "duplicate fetches",
                        "items/s", "seconds", "chaos"],
            "rows": [[r["output"], r["pages"], r["items"], r["lost_items"], r["duplicate_items"],
                      r["duplicate_fetches"], r["items_per_s"], r["seconds"], chaos_text(r["chaos"])]
                     for r in rows],
        }],
        "notes": ["feeds: at least once by design (a page fetched again after a kill writes its items"
                  " again)"],
        "data": {"rows": rows},
        "failed": failed,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--pages", type=int)
    add_arguments(parser)
    result = run(parser.parse_args())
    print(result["summary"])
