"""Crawl-wide politeness: a rate-limited host stays polite across workers, another runs at full speed.

Three real ``scrapy crawl`` workers (the ``links`` spider of ``tests/crawlproject.py``, every worker given
the same seeds: every page of the limited host, so its backlog is full from the start and the limit, not
link discovery, paces it; and the free host's first page) crawl two local hosts at once:

* the **limited** host: ``SiteGraph(40, links=3)`` on 127.0.0.2, answering after 20 ms (so two requests
  "at once" overlap at the server and can be counted), limited to one request at a time, 0.2 s apart;
* the **free** host: ``SiteGraph(1500, links=10)`` on 127.0.0.3, answering after 5 ms, no limit.

Three configurations, each against a fresh ``redis-server`` and fresh site servers:

* **A** -- ``SCHEDULER_POLITENESS = "cluster"``, ``DOMAIN_LIMITS = {"127.0.0.2": {"delay": 0.2,
  "concurrency": 1, "jitter": 0}}``, ``CONCURRENT_REQUESTS_PER_DOMAIN = 48``;
* **B** -- the same settings, crawling only the free host (on 127.0.0.4): the full-speed baseline;
* **C** -- ``SCHEDULER_POLITENESS = "process"`` with Scrapy's per-process equivalent, ``DOWNLOAD_SLOTS =
  {"127.0.0.2": {"delay": 0.2, "concurrency": 1, "jitter": 0}}``: each worker is polite on its own.

Everything is measured at the servers (``time.monotonic()``, one clock): for the limited host the gaps
between consecutive request arrivals and the most requests in flight at once (arrival to response
ready); for the free host its pages/s over the middle 80% of its requests (the workers start a little
apart and the crawl tails off), and that rate relative to B.

``python -m benchmarks.politeness [--quick]`` prints the table; ``run(args)`` is the harness entry point.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from itertools import pairwise
from pathlib import Path
from typing import Any

from benchmarks.redis_server import RedisProcess
from scrapy_dist.demo.site import SiteGraph, SiteServer

TITLE = "Politeness: one host limited crawl-wide (0.2 s, 1 at a time) while another runs at full speed"

WORKERS = 3
DELAY = 0.2
LIMITED_PAGES = 40
#: the limited host's response time: long enough that two requests sent "at once" overlap at the server
LIMITED_LATENCY = 0.02
FREE_PAGES = 1500
FREE_LATENCY = 0.005
CRAWL_TIMEOUT = 150.0
#: the crawl's own processes keep ~2 cores busy; a higher 1-minute load average means someone else's too
NOISY_LOAD = 3.0

_CRAWLPROJECT = Path(__file__).resolve().parent.parent / "tests" / "crawlproject.py"


def _load_crawlproject():
    """``tests/crawlproject.py`` (``make_project``), imported by path: ``tests`` is not a package (its own
    imports, ``helpers``, are found in that directory)."""
    name = "scrapy_dist_tests_crawlproject"
    if name in sys.modules:
        return sys.modules[name]
    if str(_CRAWLPROJECT.parent) not in sys.path:
        sys.path.append(str(_CRAWLPROJECT.parent))
    spec = importlib.util.spec_from_file_location(name, _CRAWLPROJECT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class TimedSiteServer(SiteServer):
    """A :class:`SiteServer` that also records when each request arrived (``arrivals``).

    :attr:`SiteServer.log` holds the time each response was ready, so a request is in flight at the
    server from its arrival to its log entry.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.arrivals: list[tuple[float, str]] = []
        self._arrivals_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def respond(self, path: str) -> tuple[int, bytes, float]:
        now = time.monotonic()
        with self._arrivals_lock:
            self.arrivals.append((now, path))
        return super().respond(path)


#: key -> (description, crawls the limited host, settings on top of the common ones)
CONFIGS: dict[str, tuple[str, bool, dict[str, Any]]] = {
    "A": (
        "cluster: both hosts",
        True,
        {
            "SCHEDULER_POLITENESS": "cluster",
            "DOMAIN_LIMITS": {"127.0.0.2": {"delay": DELAY, "concurrency": 1, "jitter": 0}},
            "CONCURRENT_REQUESTS_PER_DOMAIN": 48,
        },
    ),
    "B": (
        "cluster: free host alone",
        False,
        {
            "SCHEDULER_POLITENESS": "cluster",
            "DOMAIN_LIMITS": {"127.0.0.2": {"delay": DELAY, "concurrency": 1, "jitter": 0}},
            "CONCURRENT_REQUESTS_PER_DOMAIN": 48,
        },
    ),
    "C": (
        "process: DOWNLOAD_SLOTS per worker",
        True,
        {
            "SCHEDULER_POLITENESS": "process",
            "DOWNLOAD_SLOTS": {"127.0.0.2": {"delay": DELAY, "concurrency": 1, "jitter": 0}},
            "CONCURRENT_REQUESTS_PER_DOMAIN": 48,
        },
    ),
}

COMMON_SETTINGS: dict[str, Any] = {
    "CONCURRENT_REQUESTS": 16,
    "SCHEDULER_IDLE_BEFORE_CLOSE": 2,
    "CLOSESPIDER_TIMEOUT": int(CRAWL_TIMEOUT - 20),
    "LOG_LEVEL": "INFO",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--politeness-pages",
        type=int,
        metavar="N",
        help=f"pages of the free host (default {FREE_PAGES:,}; 600 with --quick)",
    )


# -- measures ----------------------------------------------------------------------------------------
def gaps(times: list[float]) -> list[float]:
    """Seconds between consecutive times (sorted first)."""
    return [b - a for a, b in pairwise(sorted(times))]


def max_in_flight(spans: list[tuple[float, float]]) -> int:
    """The most (start, end) intervals open at one moment (an end at the same instant as a start closes
    first: back-to-back is not "at once")."""
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda ev: (ev[0], ev[1]))
    most = cur = 0
    for _, step in events:
        cur += step
        most = max(most, cur)
    return most


def spans_of(server: TimedSiteServer) -> list[tuple[float, float]]:
    """(arrival, response ready) per request, paired per path in order."""
    ends: dict[str, list[float]] = defaultdict(list)
    for t, path, _ in server.log:
        ends[path].append(t)
    starts: dict[str, list[float]] = defaultdict(list)
    for t, path in server.arrivals:
        starts[path].append(t)
    out = []
    for path, ss in starts.items():
        es = sorted(ends.get(path, []))
        for i, s in enumerate(sorted(ss)):
            out.append((s, es[i] if i < len(es) else s))
    return out


def middle_rate(times: list[float]) -> float | None:
    """Requests per second over the middle 80% of ``times``."""
    ordered = sorted(times)
    lo, hi = len(ordered) // 10, len(ordered) - len(ordered) // 10 - 1
    if hi <= lo or ordered[hi] <= ordered[lo]:
        return None
    return (hi - lo) / (ordered[hi] - ordered[lo])


def limited_figures(server: TimedSiteServer) -> dict[str, Any]:
    arrivals = [t for t, _ in server.arrivals]
    g = gaps(arrivals)
    return {
        "requests": len(arrivals),
        "pages_200": len(server.fetch_counts()),
        "min_gap_s": min(g) if g else None,
        "median_gap_s": statistics.median(g) if g else None,
        "gaps_below_delay": sum(1 for x in g if x < DELAY),
        "max_in_flight": max_in_flight(spans_of(server)),
        "span_s": (max(arrivals) - min(arrivals)) if arrivals else None,
        "gaps_s": [round(x, 4) for x in g],
    }


def free_figures(server: TimedSiteServer) -> dict[str, Any]:
    times = [t for t, _, _ in server.log]
    counts = server.fetch_counts()
    return {
        "requests": len(times),
        "pages_200": len(counts),
        "fetched_twice": sum(1 for n in counts.values() if n > 1),
        "pages_per_s": middle_rate(times),
        "span_s": (max(times) - min(times)) if times else None,
    }


# -- one configuration ------------------------------------------------------------------------------
def run_config(key: str, free_pages: int, tmp: Path) -> dict[str, Any]:
    """Crawl one configuration with fresh servers and a fresh redis-server; the figures."""
    description, with_limited, settings = CONFIGS[key]
    crawlproject = _load_crawlproject()
    limited = (
        TimedSiteServer(SiteGraph(LIMITED_PAGES, links=3), host="127.0.0.2", delay=LIMITED_LATENCY)
        if with_limited
        else None
    )
    free = TimedSiteServer(
        SiteGraph(free_pages, links=10), host="127.0.0.3" if with_limited else "127.0.0.4", delay=FREE_LATENCY
    )
    servers = [s for s in (limited, free) if s is not None]
    redis_server = RedisProcess().start()
    root = Path(tempfile.mkdtemp(prefix=f"politeness-{key}-", dir=tmp))
    project = crawlproject.make_project(root, {"REDIS_URL": redis_server.url, **COMMON_SETTINGS, **settings})
    # every limited page is a seed: its backlog is full from the start, so the limit (not discovery) is
    # what paces it; the free host is discovered by crawling
    seeds = [limited.page_url(i) for i in range(LIMITED_PAGES)] if limited is not None else []
    seeds.append(free.page_url(0))
    for s in servers:
        s.start()
    load = os.getloadavg()[0]
    started = time.monotonic()
    codes: list[int | None] = []
    error = None
    try:
        for _ in range(WORKERS):
            project.crawl(args={"seeds": ",".join(seeds)})
        try:
            codes = project.wait_all(CRAWL_TIMEOUT)
        except AssertionError as exc:  # wait_all kills the late worker and raises
            error = str(exc).splitlines()[0]
        wall = time.monotonic() - started
    finally:
        project.stop_all()
        for s in servers:
            s.stop()
        redis_server.stop()
    stats = [project.stats(i) for i in range(len(project.procs))]
    penalized: Counter[str] = Counter()
    for st in stats:
        for name, value in st.items():
            if name.startswith("scheduler/politeness/penalized/"):
                penalized[name] += int(value)
    result: dict[str, Any] = {
        "description": description,
        "settings": settings,
        "exit_codes": codes,
        "finish_reasons": [st.get("finish_reason") for st in stats],
        "wall_s": wall,
        "load_before": load,
        "penalized": dict(penalized),
        "error": error,
        "logs": str(root),
        "free": free_figures(free),
        "limited": limited_figures(limited) if limited is not None else None,
    }
    problems = []
    if error:
        problems.append(error)
    if codes and any(c != 0 for c in codes):
        problems.append(f"exit codes {codes}")
    if any(r != "finished" for r in result["finish_reasons"]):
        problems.append(f"finish reasons {result['finish_reasons']}")
    if result["free"]["pages_200"] != free_pages:
        problems.append(f"free host: {result['free']['pages_200']} of {free_pages} pages")
    if limited is not None and result["limited"]["pages_200"] != LIMITED_PAGES:
        problems.append(f"limited host: {result['limited']['pages_200']} of {LIMITED_PAGES} pages")
    result["problems"] = problems
    return result


# -- the harness entry point ------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    quick = getattr(args, "quick", False)
    free_pages = getattr(args, "politeness_pages", None) or (600 if quick else FREE_PAGES)
    tmp = Path(getattr(args, "tmp_dir", None) or tempfile.mkdtemp(prefix="bench-politeness-"))
    tmp.mkdir(parents=True, exist_ok=True)
    results = {key: run_config(key, free_pages, tmp) for key in CONFIGS}

    base = results["B"]["free"]["pages_per_s"]
    rows = []
    for key, r in results.items():
        lim, fr = r["limited"], r["free"]
        rate = fr["pages_per_s"]
        rows.append([
            f"{key}: {r['description']}",
            f"{lim['pages_200']}/{LIMITED_PAGES}" if lim else None,
            round(lim["min_gap_s"], 3) if lim and lim["min_gap_s"] is not None else None,
            round(lim["median_gap_s"], 3) if lim and lim["median_gap_s"] is not None else None,
            lim["gaps_below_delay"] if lim else None,
            lim["max_in_flight"] if lim else None,
            f"{fr['pages_200']}/{free_pages}",
            round(rate, 1) if rate else None,
            round(rate / base, 2) if rate and base else None,
            round(r["wall_s"], 1),
        ])
    notes = [
        f"{WORKERS} `scrapy crawl` workers (CONCURRENT_REQUESTS=16 each) started together, each given the"
        " same seeds (the shared dupefilter keeps one of each): all pages of the limited host and page 0 of"
        f" the free one. Limited host: 127.0.0.2, {LIMITED_PAGES} pages answering in"
        f" {LIMITED_LATENCY * 1000:.0f} ms, limit {DELAY} s / 1 at a time (jitter 0). Free host:"
        f" {free_pages:,} pages answering in {FREE_LATENCY * 1000:.0f} ms, discovered by crawling.",
        "Gaps are between consecutive arrivals at the limited host's server; in flight = arrival to"
        " response ready, so 2+ means two workers' requests overlapped at the server.",
        "Free pages/s: requests over the middle 80% of the free host's requests (server clock); vs B = the"
        " same rate with the free host crawled alone under the same cluster settings.",
        "A and B share CONCURRENT_REQUESTS_PER_DOMAIN=48, held crawl-wide in cluster mode and counting"
        " prefetched leases; C has no crawl-wide cap, so C vs B is not only the limited host's effect.",
    ]
    problems = [f"{key}: {p}" for key, r in results.items() for p in r["problems"]]
    broken = []
    a = results["A"]["limited"]
    if a and a["gaps_below_delay"]:
        broken.append(f"A: {a['gaps_below_delay']} gaps below {DELAY} s under crawl-wide politeness")
    if a and a["max_in_flight"] > 1:
        broken.append(f"A: {a['max_in_flight']} requests in flight at once under a concurrency-1 limit")
    notes += problems + broken
    for key, r in results.items():
        if r["penalized"]:
            notes.append(f"{key}: domains penalized (429/503): {r['penalized']}")
    noisy = {k: round(r["load_before"], 1) for k, r in results.items() if r["load_before"] > NOISY_LOAD}
    if noisy:
        notes.insert(
            0,
            f"**Noisy**: 1-minute load average above {NOISY_LOAD} before {noisy}; pages/s and their ratios"
            " are unreliable (the gaps and overlaps are not: they are limits, not speeds).",
        )
    notes.append(f"Crawl logs: {tmp}/politeness-*")
    c = results["C"]["limited"]
    summary = (
        f"Crawl-wide politeness held the limited host to one request at a time, at least"
        f" {a['min_gap_s']:.3f} s apart (limit {DELAY} s), while the free host ran at"
        f" {results['A']['free']['pages_per_s'] or 0:.0f} pages/s, {rows[0][8] or 0:.2f}x its speed alone."
        f" Scrapy's per-process limits (C) let the {WORKERS} workers hit it {c['gaps_below_delay']} times"
        f" less than {DELAY} s apart, up to {c['max_in_flight']} at once."
        if a and c and a["min_gap_s"] is not None
        else "Incomplete: see the notes."
    )
    return {
        "title": TITLE,
        "summary": summary,
        "tables": [
            {
                "title": "Limited host (127.0.0.2, 0.2 s / 1 at a time) and free host, 3 workers",
                "columns": [
                    "configuration",
                    "limited pages",
                    "min gap s",
                    "median gap s",
                    f"gaps < {DELAY} s",
                    "max in flight",
                    "free pages",
                    "free pages/s",
                    "vs B",
                    "wall s",
                ],
                "rows": rows,
            }
        ],
        "charts": [
            {
                "title": "free host pages/s (3 workers)",
                "ylabel": "pages/s",
                "categories": list(CONFIGS),
                "series": {"free host": [r["free"]["pages_per_s"] for r in results.values()]},
            },
            {
                "title": f"limited host: gaps between requests (limit {DELAY} s)",
                "ylabel": "seconds",
                "categories": [k for k, r in results.items() if r["limited"]],
                "series": {
                    "min gap": [r["limited"]["min_gap_s"] for r in results.values() if r["limited"]],
                    "median gap": [r["limited"]["median_gap_s"] for r in results.values() if r["limited"]],
                },
            },
        ],
        "notes": notes,
        "data": {"workers": WORKERS, "delay": DELAY, "free_pages": free_pages, "configs": results},
        "failed": bool(problems or broken),
    }


def main() -> None:
    from benchmarks.report import markdown_table

    parser = argparse.ArgumentParser(description=TITLE)
    parser.add_argument("--quick", action="store_true", help="a 600-page free host")
    add_arguments(parser)
    result = run(parser.parse_args())
    for table in result["tables"]:
        print(f"\n{table['title']}\n")
        print(markdown_table(table))
    print("\n" + result["summary"])
    for note in result["notes"]:
        print("note:", note)
    sys.exit(1 if result["failed"] else 0)


if __name__ == "__main__":
    main()
