"""Capacity model: how one Redis master (or a 3-master cluster with ``SCHEDULER_SHARDS=3``) carries N
workers, measured with the real scheduler and frontier code and no HTTP.

Each synthetic worker is a real :class:`scrapy_dist.scheduler.Scheduler` (its ledger, sync loop, dupefilter
and frontier, started by ``open_async`` as in a crawl) driven by an asyncio "engine" that fetches nothing:
it takes requests from ``next_request()``, holds each for ``FETCH_S`` seconds (up to ``CONCURRENCY`` at
once, like ``CONCURRENT_REQUESTS``), then hands the page's links to ``enqueue_request()`` -- a synthetic
link graph where every page has ``LINKS`` links, two of them to new pages and the rest to pages found
before, on hosts drawn from a Zipf distribution over 10,000 hosts -- and lets the sync loop acknowledge
it. Workers are spread over a few processes (asyncio tasks in each). For N = 1, 2, 4, ... 64 workers,
each run lasts ``--capacity-seconds`` after a warm-up and reports:

* crawl pages/s (pages whose links were handed to the scheduler), summed over the workers;
* Redis CPU per page: ``used_cpu_user + used_cpu_sys`` of the server(s) over the run / pages, and how much
  of it the same servers spend with no client at all in as long (timers, a cluster's bus: measured for
  ``IDLE_SECONDS`` before the points);
* p50 / p99 / max duration of one ``sync`` script call, from the server's SLOWLOG (every call is longer
  than its threshold, ``SCRIPT_TIMING_US``; the commands inside scripts mostly are not) -- the time that
  call held the server and every other worker waited.

On a machine with few cores, the workers' Python and Redis share the cores: pages/s is bound by the
machine, while Redis CPU per page and call durations are properties of the frontier; the capacity table
in docs/capacity.md extrapolates from those (and says so). With ``--capacity-pin`` (the default on two
cores or more) the Redis server(s) run on core 0 -- SCHED_RR where allowed, ahead of whatever else the
machine runs there -- and the workers on the others, so that a call is not slowed down by other Python;
each point then reports the CPU each side used and how busy the workers' cores were, and a point whose
workers' cores were saturated is marked client-bound (the workers slow down, their rounds grow and the
calls with them). ``--capacity-rate`` caps the workers' total pages/s (each worker gets its share) so
that many workers fit on the cores they have and the server's latency is what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import glob
import hashlib
import json
import multiprocessing
import os
import statistics
import time
from typing import Any

import redis

from benchmarks.redis_server import (
    IDLE_SECONDS,
    RedisProcess,
    call_percentiles,
    idle_cpu_rate,
    local_cluster,
    script_call_durations,
    server_cpu,
    time_script_calls,
)

TITLE = "Capacity: N synthetic workers on one Redis master (and 3 shards on a 3-master cluster)"
LINKS = 10
HOSTS = 10_000
CONCURRENCY = 16
FETCH_S = 0.05
SPIDER = "cap"


class _Engine:
    """The :class:`scrapy_dist.frontier.engine.Engine` of a synthetic worker: what it holds is in progress."""

    def __init__(self) -> None:
        self.held: set[Any] = set()
        self.woken = asyncio.Event()

    def inprogress(self) -> Any:
        return self.held

    def wake(self) -> None:
        self.woken.set()

    def close(self, reason: str) -> None:
        pass

    def slot_load(self, request: Any) -> int:
        return 0

    def take_unstarted(self, which: Any) -> list[Any]:
        return []  # nothing waits in a downloader: a held request is being "fetched"


def _cumulative_zipf() -> list[float]:
    weights = [1 / (r + 1) for r in range(HOSTS)]  # Zipf, s = 1
    total, acc, out = sum(weights), 0.0, []
    for w in weights:
        acc += w
        out.append(acc / total)
    return out


def _url(page: int, zipf: list[float]) -> str:
    """Page ``page`` always has the same URL: its host drawn from the Zipf hosts by a hash of the id."""
    u = int.from_bytes(hashlib.blake2b(page.to_bytes(8, "big"), digest_size=8).digest(), "big") / 2**64
    return f"http://h{bisect.bisect_left(zipf, u)}.test/p/{page}"


def _page(url: str) -> int:
    return int(url.rsplit("/", 1)[1])


def _host(url: str) -> int:
    """The Zipf rank of the URL's host (``h<rank>.test``): 0 is the most linked-to."""
    return int(url[8:url.index(".", 8)])


def _links(page: int, zipf: list[float]) -> list[str]:
    """A binary tree (children 2p+1, 2p+2: new pages, so the frontier grows by one per page) plus
    ``LINKS - 2`` links to the page's ancestors (the dupefilter's daily work). Every ancestor was fetched
    before the page (a page is found only from its parent), so each page inserts exactly two new requests
    whatever order the frontier hands pages out in -- politeness changes that order, and links to pages
    merely older by id would make it insert more."""
    targets = [2 * page + 1, 2 * page + 2]
    up = page
    while len(targets) < LINKS:
        up = (up - 1) // 2 if up > 0 else 0
        targets.append(up)
    return [_url(t, zipf) for t in targets]


async def _worker(
    url: str, shards: int, politeness: str, index: int, stop_at: float, counts: dict, rate: float = 0.0
) -> None:
    from scrapy import Request, Spider
    from scrapy.utils.test import get_crawler

    from scrapy_dist.frontier.scheduler import Scheduler

    settings = {
        "REDIS_URL": url, "DUPEFILTER_CLASS": "scrapy_dist.dupefilter.BloomDupeFilter",
        "BLOOMFILTER_CAPACITY": 10_000_000, "SCHEDULER_SHARDS": shards, "SCHEDULER_PERSIST": True,
        "SCHEDULER_POLITENESS": politeness, "LOG_LEVEL": "WARNING",
    }
    spider_cls = type("CapSpider", (Spider,), {"name": SPIDER})
    crawler = get_crawler(spider_cls, settings)
    crawler.spider = crawler._create_spider()
    sched = Scheduler.from_crawler(crawler)
    engine = _Engine()
    sched.engine = engine
    await sched.open_async(crawler.spider)
    zipf = _cumulative_zipf()
    if index == 0:
        sched.enqueue_request(Request(_url(0, zipf)))
    busy: set[asyncio.Task] = set()

    found = counts["found"]

    async def fetch(request: Any) -> None:
        began = time.monotonic()
        await asyncio.sleep(FETCH_S)
        page = _page(request.url)
        counts["fetches"].append((page, _host(request.url), began, time.monotonic()))
        for link in _links(page, zipf):
            sched.enqueue_request(Request(link))
            found.setdefault(_page(link), began)
        engine.held.discard(request)
        counts["pages"] += 1
        if rate:
            engine.woken.set()

    next_at = time.monotonic()  # with ``rate``: when the next fetch may start
    while time.monotonic() < stop_at:
        while len(busy) < CONCURRENCY and (not rate or time.monotonic() >= next_at):
            request = sched.next_request()
            if request is None:
                break
            if rate:
                next_at = max(next_at, time.monotonic() - 0.1) + 1.0 / rate
            engine.held.add(request)
            task = asyncio.ensure_future(fetch(request))
            busy.add(task)
            task.add_done_callback(busy.discard)
        engine.woken.clear()
        # throttled, a worker sleeps until its next fetch may start or a slot frees (many fit on a core)
        # (a finished fetch and a round that leased wake it)
        pause = max(0.05, next_at - time.monotonic()) if rate else 0.01
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(engine.woken.wait(), pause)
    for task in list(busy):
        task.cancel()
    await sched.close_async("finished")


async def _process(
    url: str, shards: int, politeness: str, first: int, count: int, window: tuple[float, float], out: Any,
    rate: float = 0.0,
) -> None:
    """``count`` workers; puts the pages they crawled inside the measured ``window`` (monotonic) and the
    CPU seconds this process used in it."""
    counts: dict[str, Any] = {"pages": 0, "fetches": [], "found": {}}
    marks: dict[str, tuple[int, float]] = {}

    async def mark(name: str, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        marks[name] = counts["pages"], time.process_time()

    await asyncio.gather(
        mark("start", window[0]), mark("end", window[1]),
        *(_worker(url, shards, politeness, first + i, window[1], counts, rate) for i in range(count)),
    )
    (p0, c0), (p1, c1) = marks["start"], marks["end"]
    out.put((p1 - p0, counts["pages"], counts["fetches"], counts["found"], c1 - c0))


def _pin(pids: list[int], cpus: set[int] | None, first: bool = False) -> str:
    """Bind processes to ``cpus`` (None: leave them be); with ``first``, also put them before every
    ordinary process on those cores (SCHED_RR, else nice -10, where allowed: their core is shared with
    whatever else the machine runs, and the servers use a small part of it). Returns how they run."""
    how = "bound"
    for pid in pids if cpus else ():
        os.sched_setaffinity(pid, cpus)
        if not first:
            continue
        try:
            os.sched_setscheduler(pid, os.SCHED_RR, os.sched_param(1))
            how = "bound, SCHED_RR"
        except (OSError, AttributeError):
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, pid, -10)
                how = "bound, nice -10"
    return how


def _cores_busy(cpus: set[int]) -> tuple[float, float]:
    """(busy, total) jiffies of ``cpus`` so far, from /proc/stat (every process, not only the benchmark's)."""
    busy = total = 0.0
    with contextlib.suppress(OSError), open("/proc/stat") as f:
        for line in f:
            name, *values = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                ticks = [float(v) for v in values[:8]]
                busy, total = busy + sum(ticks) - ticks[3] - ticks[4], total + sum(ticks)
    return busy, total


def _run_process(
    args: tuple[str, int, str, int, int, tuple[float, float], Any, float], record: str = "",
    cpus: set[int] | None = None,
) -> None:
    _pin([0], cpus)
    calls: list[tuple[float, str, list[Any], list[Any]]] = []
    sources: dict[str, str] = {}
    if record:
        from redis.commands.core import AsyncScript

        original = AsyncScript.__call__

        async def call(script: Any, keys: Any = None, args: Any = None, client: Any = None) -> Any:
            text = script.script
            sources.setdefault(script.sha, text if isinstance(text, str) else text.decode())
            calls.append((time.monotonic(), script.sha, [_latin1(k) for k in keys or []],
                          [_latin1(a) for a in args or []]))
            return await original(script, keys=keys, args=args, client=client)

        AsyncScript.__call__ = call  # type: ignore[method-assign]

        def fcall(at: float, key: str, code: str, keys: Any, args: Any) -> None:
            sources.setdefault(key, code)
            calls.append((at, key, [_latin1(k) for k in keys], [_latin1(a) for a in args]))

        from benchmarks.replay import record_library_calls

        record_library_calls(fcall)
    asyncio.run(_process(*args))
    if record:
        with open(f"{record}.{args[3]}.json", "w") as f:
            json.dump({"sources": sources, "calls": calls}, f)


def _latin1(v: Any) -> str:
    return v.decode("latin-1") if isinstance(v, bytes) else str(v)


def _instructions(record: str, pages: int, window: tuple[float, float] | None = None,
                  cluster: bool = False) -> float:
    """Server instructions per page for the recorded calls of every process, replayed in the order they
    were made on a redis-server under callgrind (benchmarks/replay.py): a figure that does not move with
    what else the machine does. With ``window``: only the calls made in it (``pages``: its pages), the ones
    before replayed first and counted apart. ``cluster``: the calls of a cluster's masters, replayed on one
    cluster-mode node owning every slot."""
    from benchmarks.replay import callgrind_instructions

    sources: dict[str, str] = {}
    calls: list[Any] = []
    for path in sorted(glob.glob(f"{record}.*.json")):
        with open(path) as f:
            got = json.load(f)
        sources.update(got["sources"])
        calls += got["calls"]
        if not os.environ.get("BENCH_CALLGRIND_KEEP"):
            os.unlink(path)
    calls.sort(key=lambda c: c[0])
    if window:
        calls = [c for c in calls if c[0] < window[1]]
    enc = [(sha, [k.encode("latin-1") for k in keys], [a.encode("latin-1") for a in args])
           for _, sha, keys, args in calls]
    skip = sum(1 for c in calls if c[0] < window[0]) if window else 0
    return callgrind_instructions(sources, enc, skip, cluster) / pages


def _sync_names() -> tuple[str, str]:
    """The sync script's SHA1 (EVALSHA) and its library function's name (FCALL)."""
    import hashlib

    from scrapy_dist.frontier.shard import sync_prelude
    from scrapy_dist.redis import scripts

    prelude = sync_prelude()
    return (hashlib.sha1(scripts.source("sync", prelude).encode()).hexdigest(),
            scripts.library_name(scripts.source("sync", prelude, library=True)))


def measure(
    url: str, ports: list[int], shards: int, workers: int, seconds: float, warmup: float,
    politeness: str = "process", record: str = "", pin: tuple[set[int], set[int]] | None = None,
    rate: float = 0.0, idle: float = 0.0, window_instructions: bool = False,
) -> dict:
    """One point; ``pin``: (the Redis servers' cores, the workers' cores) when they are bound apart;
    ``idle``: the CPU seconds per second the same servers spent with no client (:func:`idle_cpu_rate`)."""
    nodes = [redis.Redis(port=p) for p in ports]
    for c in nodes:
        c.flushall()
    processes = min(workers, max(1, len(pin[1]) if pin else (os.cpu_count() or 2)))
    per = [workers // processes + (i < workers % processes) for i in range(processes)]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    # start-up (imports, open) and warm-up are not measured; CLOCK_MONOTONIC is system-wide on Linux
    start = time.monotonic() + STARTUP_S + warmup
    window = (start, start + seconds)
    procs, first = [], 0
    if record:  # one prefix per point: files kept for a profile (BENCH_CALLGRIND_KEEP) are never read again
        record = f"{record}.{shards}-{politeness}-{workers}"
    for count in per:
        work = (url, shards, politeness, first, count, window, out, rate)
        p = ctx.Process(target=_run_process, args=(work, record, pin[1] if pin else None))
        p.start()
        procs.append(p)
        first += count
    time.sleep(max(0.0, window[0] - time.monotonic()))
    cpu0 = server_cpu(*nodes)
    cores = pin or ({0}, set(range(1, os.cpu_count() or 1)))
    busy0 = [_cores_busy(side) for side in cores]
    for c in nodes:
        time_script_calls(c)
        c.config_resetstat()
    time.sleep(max(0.0, window[1] - time.monotonic()))
    cpu1 = server_cpu(*nodes)
    busy = [(b1 - b0) / (t1 - t0) if t1 > t0 else None
            for (b0, t0), (b1, t1) in zip(busy0, [_cores_busy(side) for side in cores], strict=True)]
    commands: dict[str, list[float]] = {}
    for c in nodes:
        for name, st in c.info("commandstats").items():
            calls_usec = commands.setdefault(name.removeprefix("cmdstat_"), [0.0, 0.0])
            calls_usec[0] += st["calls"]
            calls_usec[1] += st["usec"]
    names = _sync_names()
    durations = sorted(d for c in nodes for d in script_call_durations(c, names))
    got = [out.get(timeout=120) for _ in procs]
    total_pages = sum(window_pages for window_pages, *_ in got)
    fetches = [f for _, _, some, *_ in got for f in some]
    fairness = _fairness(fetches, [found for _, _, _, found, _ in got], window)
    for p in procs:
        p.join(60)
    for c in nodes:
        c.config_set("slowlog-log-slower-than", 10_000)
        c.close()
    rate = total_pages / seconds
    crawled = sum(n for _, n, *_ in got)
    counted = total_pages if window_instructions else crawled  # the window's pages, or the whole run's
    # a cluster's calls are replayed in cluster mode: what it adds to every command is the masters' cost
    instructions = (_instructions(record, counted, window if window_instructions else None, shards > 1)
                    if record and counted else None)
    return {
        "server_instructions_per_page": instructions,
        "workers": workers, "shards": shards, "politeness": politeness, "processes": processes,
        "pinned": bool(pin), "rate_per_worker": rate or None,
        # CPU over the window: cores the workers' processes used, and how busy (by anything on the
        # machine) the servers' and the workers' cores were (fractions of their cores; unpinned: core 0
        # and the rest)
        "workers_cpu_cores": round(sum(c for *_, c in got) / seconds, 2),
        "redis_cpu_cores": round((cpu1 - cpu0) / seconds, 2),
        "redis_cores_busy": _round2(busy[0]), "workers_cores_busy": _round2(busy[1]),
        "bound": _bound(bool(pin), [(cpu1 - cpu0) / seconds / len(cores[0]), busy[1]]),
        "pages": total_pages,
        "pages_per_s": rate, "redis_cpu_s": cpu1 - cpu0,
        "redis_cpu_us_per_page": 1e6 * (cpu1 - cpu0) / total_pages if total_pages else None,
        # what idle servers spend in as long (timers, a cluster's bus): paid per second, not per page
        "redis_idle_us_per_page": 1e6 * idle * seconds / total_pages if total_pages else None,
        "redis_cpu_less_idle_us_per_page": (1e6 * (cpu1 - cpu0 - idle * seconds) / total_pages
                                            if total_pages else None),
        "sync_calls": len(durations),
        **{f"sync_{name}_us": value for name, value in call_percentiles(durations).items()},
        "sync_mean_us": statistics.fmean(durations) if durations else None,
        "fairness": fairness,
        # INFO commandstats over the window: calls and microseconds per page, by command
        "commands": {name: {"calls_per_page": round(calls / total_pages, 3),
                            "us_per_page": round(usec / total_pages, 2)}
                     for name, (calls, usec) in sorted(commands.items(), key=lambda kv: -kv[1][1])
                     if total_pages},
    }


#: Zipf ranks reported one by one, then bands of ranks [lo, hi)
TOP_HOSTS = 3
BANDS = ((3, 100), (100, 1_000), (1_000, HOSTS))
#: Scrapy's CONCURRENT_REQUESTS_PER_DOMAIN (no DOWNLOAD_DELAY): crawl-wide politeness holds a domain to it
DOMAIN_CONCURRENCY = 8


def _fairness(fetches: list[tuple[int, int, float, float]], found: list[dict[int, float]],
              window: tuple[float, float]) -> list[dict]:
    """Per host (by Zipf rank) over the measured window, crawl-wide: fetches per second, the most fetches in
    flight at once (merged over every worker), how long a fetched page waited since a worker first found
    its link, and the pages found but not fetched by the window's end (count and oldest age): a starved
    domain shows as a large oldest age with few fetches."""
    first: dict[int, float] = {}
    for part in found:
        for page, at in part.items():
            if at < first.get(page, float("inf")):
                first[page] = at
    w0, w1 = window
    fetched = {page for page, *_ in fetches}
    rows = []
    groups = [(f"h{r}", r, r + 1) for r in range(TOP_HOSTS)]
    groups += [(f"h{lo}-h{hi - 1}", lo, hi) for lo, hi in BANDS]
    by_host: dict[int, list[tuple[int, float, float]]] = {}
    for page, host, t0, t1 in fetches:
        by_host.setdefault(host, []).append((page, t0, t1))
    for label, lo, hi in groups:
        hosts = [h for h in by_host if lo <= h < hi]
        in_window = [(p, t0) for h in hosts for p, t0, _ in by_host[h] if w0 <= t0 < w1]
        waits = sorted(t0 - first[p] for p, t0 in in_window if p in first)
        rates = [sum(w0 <= t0 < w1 for _, t0, _ in by_host[h]) / (w1 - w0) for h in hosts]
        pending = [w1 - at for page, at in first.items()
                   if page not in fetched and at < w1 and lo <= _host(_url_of(page)) < hi]
        rows.append({
            "hosts": label, "hosts_fetched": sum(r > 0 for r in rates),
            "fetches_per_s": round(len(in_window) / (w1 - w0), 1),
            "max_host_fetches_per_s": round(max(rates, default=0), 1),
            "max_in_flight": max((_most_at_once(by_host[h], w0, w1) for h in hosts), default=0),
            "wait_p50_s": _pct(waits, 0.5), "wait_p99_s": _pct(waits, 0.99),
            "pending": len(pending), "oldest_pending_s": round(max(pending), 2) if pending else None,
        })
    return rows


_ZIPF: list[float] = []


def _url_of(page: int) -> str:
    if not _ZIPF:
        _ZIPF.extend(_cumulative_zipf())
    return _url(page, _ZIPF)


def _most_at_once(intervals: list[tuple[int, float, float]], w0: float, w1: float) -> int:
    """The most intervals open at one moment inside [w0, w1)."""
    events = sorted([(max(t0, w0), 1) for _, t0, t1 in intervals if t1 > w0 and t0 < w1]
                    + [(min(t1, w1), -1) for _, t0, t1 in intervals if t1 > w0 and t0 < w1])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def _pct(values: list[float], q: float) -> float | None:
    return round(values[min(len(values) - 1, int(q * len(values)))], 3) if values else None


def _fairness_tables(results: dict[str, list[dict]], modes: list[str]) -> list[dict]:
    tables = []
    for m in modes:
        points = [r for r in results[m] if r.get("fairness")]
        if not points or MODES[m][2] != "cluster":
            continue
        r = points[-1]
        tables.append({
            "title": f"Per-domain fetch rate against its limit: {MODES[m][0]}, {r['workers']} workers",
            "columns": ["hosts (Zipf rank)", "hosts fetched", "fetches/s", "most fetches/s of one host",
                        "most in flight at once (limit)", "wait p50 s", "wait p99 s", "found, not fetched",
                        "oldest of those s"],
            "rows": [[f["hosts"], f["hosts_fetched"], f["fetches_per_s"], f["max_host_fetches_per_s"],
                      f"{f['max_in_flight']} ({DOMAIN_CONCURRENCY})", f["wait_p50_s"], f["wait_p99_s"],
                      f["pending"], f["oldest_pending_s"]] for f in r["fairness"]],
            "notes": [f"Crawl-wide over the measured window, merged over every worker. The limit is"
                      f" CONCURRENT_REQUESTS_PER_DOMAIN = {DOMAIN_CONCURRENCY} in flight (no DOWNLOAD_DELAY),"
                      f" at most {DOMAIN_CONCURRENCY / FETCH_S:.0f} fetches/s of one host at"
                      f" {FETCH_S * 1000:.0f} ms a fetch. Wait: from a worker first finding the link to a"
                      " worker taking the page."
                      " Found, not fetched: the frontier's backlog at the window's end (it grows by one page"
                      " per page by design); a starved band would show an oldest age near the run's length."],
        })
    return tables


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("capacity")
    g.add_argument("--capacity-seconds", type=float, metavar="S", help="measured seconds per N (default 12)")
    g.add_argument("--capacity-workers", metavar="N,N", help="worker counts (default 1,2,4,8,16,32,64)")
    g.add_argument("--capacity-instructions", action="store_true",
                   help="also replay each point's script calls under callgrind: server instructions per page"
                        " (a figure a busy machine does not move; needs valgrind)")
    g.add_argument("--capacity-window-instructions", action="store_true",
                   help="the instructions of the measured window's calls only, not of the whole run (start,"
                        " warm-up and close included): a second replay up to the window's start")
    g.add_argument("--capacity-modes", metavar="M,M",
                   help=f"frontiers to measure, of {','.join(MODES)} (default all)")
    g.add_argument("--capacity-pin", action=argparse.BooleanOptionalAction, default=None,
                   help="bind the Redis server(s) to core 0 and the workers to the other cores (default: on"
                        " with two cores or more)")
    g.add_argument("--capacity-rate", type=float, metavar="P",
                   help="cap the workers' pages/s at P in total (P/N each; default: no cap)")
    g.add_argument("--capacity-repeat", type=int, metavar="K", default=1,
                   help="measure every point K times, the modes taking turns (each turn every worker count"
                        " and mode of a server once; every other turn the modes the other way round): Redis"
                        " CPU per page is the median of the K, a ratio the median of the K turns' ratios,"
                        " the sync p99 at the most workers the median of the K (the callgrind replay, the"
                        " other latencies and the per-domain tables are the first turn's; each turn on"
                        " servers started for it; default 1)")


#: mode -> (label, shards, SCHEDULER_POLITENESS); the sharded modes run on a local 3-master cluster at the
#: last three worker counts only.
MODES = {
    "plain": ("1 master", 1, "process"),
    "polite": ("1 master, crawl-wide politeness", 1, "cluster"),
    "sharded": ("3 shards, 3-master cluster", 3, "process"),
    "sharded-polite": ("3 shards, crawl-wide politeness (by domain)", 3, "cluster"),
}


def run(args: argparse.Namespace) -> dict:
    quick = getattr(args, "quick", False)
    seconds = getattr(args, "capacity_seconds", None) or (4.0 if quick else 12.0)
    counts = [int(x) for x in (getattr(args, "capacity_workers", None) or ("1,4,16" if quick else
                                                                          "1,2,4,8,16,32,64")).split(",")]
    modes = (getattr(args, "capacity_modes", None) or ",".join(MODES)).split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"--capacity-modes: unknown {', '.join(unknown)} (known: {', '.join(MODES)})")
    repeat = getattr(args, "capacity_repeat", None) or 1
    if repeat < 1:
        raise SystemExit(f"--capacity-repeat: {repeat} is not a number of turns (1 or more)")
    turns: dict[str, dict[int, list[dict]]] = {m: {} for m in modes}  # mode -> workers -> each turn's point
    pin_on = getattr(args, "capacity_pin", None)
    cores = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()
    if pin_on is None:
        pin_on = len(cores) >= 2
    pin = ({min(cores)}, cores - {min(cores)}) if pin_on and len(cores) >= 2 else None
    total_rate = getattr(args, "capacity_rate", None) or 0.0
    server_sched = ""
    record = ""
    window_instructions = bool(getattr(args, "capacity_window_instructions", False))
    if getattr(args, "capacity_instructions", False) or window_instructions:
        import tempfile

        record = os.path.join(tempfile.mkdtemp(prefix="capacity-calls-"), "calls")

    def measure_block(turn: int, url: str, ports: list[int], points: list[tuple[int, str]],
                      idle: float) -> None:
        for n, m in points:
            r = measure(url, ports, MODES[m][1], n, seconds, _warmup(n), MODES[m][2],
                        record if turn == 0 else "", pin, total_rate / n, idle, window_instructions)
            turns[m].setdefault(n, []).append(r)
            _print_point(m, n, turn, r)

    def on_servers(turn: int, points: list[tuple[int, str]], url: str, ports: list[int],
                   pids: list[int]) -> str:
        """One turn's points of servers just started: pinned, their idle cost measured, then the points."""
        sched = _pin(pids, pin and pin[0], first=True)
        nodes = [redis.Redis(port=p) for p in ports]
        idle = idle_cpu_rate(*nodes)
        for node in nodes:
            node.close()
        measure_block(turn, url, ports, points, idle)
        return sched

    def on_one_master(turn: int, points: list[tuple[int, str]]) -> str:
        server = RedisProcess().start()
        try:
            return on_servers(turn, points, server.url, [server.port], [server.proc.pid])
        finally:
            server.stop()

    def on_cluster(turn: int, points: list[tuple[int, str]]) -> str:
        # Redis's own cluster-node-timeout (the suite's 1 s makes the bus ping its peers more often)
        cluster = local_cluster()(masters=3, node_timeout_ms=15_000).start()
        try:
            return on_servers(turn, points, cluster.nodes[0].url, [node.port for node in cluster.nodes],
                              [node.proc.pid for node in cluster.nodes])
        finally:
            cluster.stop()

    for turn, shards, points in turn_blocks(modes, counts, repeat):
        server_sched = (on_cluster if shards > 1 else on_one_master)(turn, points)
    results = {m: [combine_turns(points) for points in turns[m].values()] for m in modes}
    rows = [[MODES[m][0], r["workers"], round(r["pages_per_s"]), _round(r["redis_cpu_us_per_page"]),
             _round(r["redis_idle_us_per_page"]),
             _round(r["server_instructions_per_page"] and r["server_instructions_per_page"] / 1000),
             r["sync_calls"], r["sync_p50_us"], r["sync_p99_us"], r["sync_max_us"], r["redis_cpu_cores"],
             r["workers_cpu_cores"], _pct_of(r["workers_cores_busy"]), r["bound"]]
            + ([" / ".join(str(_round(t["redis_cpu_us_per_page"])) for t in r.get("turns", [r]))]
               if repeat > 1 else [])
            for m in modes for r in results[m]]
    plain = results.get("plain", [])
    figures = [r["redis_cpu_us_per_page"] for r in plain if r["redis_cpu_us_per_page"]]
    best, worst = (min(figures), max(figures)) if figures else (None, None)
    return {
        "title": TITLE,
        "summary": (
            f"Redis CPU per page {', '.join(str(_round(r['redis_cpu_us_per_page'])) for r in plain)} us for"
            f" N = {', '.join(str(r['workers']) for r in plain)} workers on one master"
            + (f": one master core carries {1e6 / worst:,.0f}-{1e6 / best:,.0f} pages/s at 100%"
               " (docs/capacity.md plans at 70% of the worst)" if best and worst else "") + "."
        ),
        "tables": [{
            "title": f"Synthetic workers (real scheduler, no HTTP; {CONCURRENCY} requests in flight each,"
                     f" {LINKS} links/page, {HOSTS:,} Zipf hosts), {seconds:g} s each",
            "columns": ["Redis", "workers", "pages/s", "Redis CPU µs/page", "of which idle servers' µs/page",
                        "server k-instructions/page",
                        "sync calls", "sync p50 µs", "sync p99 µs", "sync max µs", "Redis CPU (cores)",
                        "workers' CPU (cores)", "workers' cores busy", "bound by"]
                       + (["Redis CPU µs/page, each turn"] if repeat > 1 else []),
            "rows": rows,
            "notes": [_machine_note(pin, total_rate, server_sched)] + ([_turns_note(repeat)] if repeat > 1
                                                                      else []),
        }, *_ratio_table(results), *_latency_table(results, modes), *_fairness_tables(results, modes)],
        "charts": [{
            "title": "Redis CPU per page and sync p99 against workers (one master)",
            "ylabel": "µs", "categories": [str(r["workers"]) for r in plain],
            "series": {"Redis CPU µs/page": [r["redis_cpu_us_per_page"] for r in plain],
                       "sync p99 µs / 10": [(r["sync_p99_us"] or 0) / 10 for r in plain]},
        }] if plain else [],
        "data": {**results, "seconds": seconds},
    }


def _ratio_table(results: dict[str, list[dict]]) -> list[dict]:
    """The frontier's costs against each other at the same worker counts: politeness vs plain (same
    shards), 3 shards vs one master."""
    pairs = [("polite", "plain", "crawl-wide politeness / plain, one master", "≤ 1.25"),
             ("sharded-polite", "sharded", "crawl-wide politeness / plain, 3 shards", "≤ 1.25"),
             ("sharded", "plain", "3 shards / one master (all masters' CPU)", "≤ 1.15")]
    rows = []
    turns = any(r.get("turns") for points in results.values() for r in points)
    for a, b, label, target in pairs:
        base = {r["workers"]: r for r in results.get(b, [])}
        for r in results.get(a, []):
            other = base.get(r["workers"])
            if other:
                rows.append([label, r["workers"], _ratio(r, other, "redis_cpu_us_per_page"),
                             _ratio(r, other, "redis_cpu_less_idle_us_per_page"),
                             _ratio(r, other, "server_instructions_per_page"), target]
                            + ([_each_turn(r, other)] if turns else []))
    if not rows:
        return []
    return [{"title": "Redis cost per page, one frontier against another (same run, same worker count)",
             "columns": ["ratio", "workers", "Redis CPU", "Redis CPU less idle servers'",
                         "server instructions", "target"] + (["Redis CPU, each turn"] if turns else []),
             "rows": rows,
             "notes": ["Redis CPU moves with what else the machine runs (the workers share its cores);"
                       " instructions, counted by replaying the recorded calls under callgrind"
                       " (--capacity-instructions; a cluster's calls on one cluster-mode node owning every"
                       " slot, so that what cluster mode adds to each command is counted), do not. Less"
                       " idle servers': without what the same servers spent with no client for as long"
                       f" ({IDLE_SECONDS:g} s measured before the points): their timers and a cluster's bus,"
                       " paid per second whatever the pages/s, which weigh most at a capped rate."]
             + (["Redis CPU ratios are the medians of the turns' ratios, turn i of one mode against turn i"
                 " of the other (each turn listed); instructions are the first turn's."] if turns else [])}]


def _each_turn(a: dict, b: dict) -> str:
    return " / ".join(f"{x['redis_cpu_us_per_page'] / y['redis_cpu_us_per_page']:.2f}"
                      for x, y in zip(a.get("turns", []), b.get("turns", []), strict=False)
                      if x["redis_cpu_us_per_page"] and y["redis_cpu_us_per_page"])


#: the sync p99 the frontier aims at with many workers (µs)
SYNC_P99_TARGET_US = 2000


def _latency_table(results: dict[str, list[dict]], modes: list[str]) -> list[dict]:
    """Each mode's sync call durations at its largest worker count, against the target."""
    rows = []
    tops = {m: max(results[m], key=lambda point: point["workers"]) for m in modes if results[m]}
    turned = any(r.get("turns") for r in tops.values())
    for m, r in tops.items():
        p99, bound, each = r["sync_p99_us"], r["bound"], ["—"] if turned else []
        if turns := [t for t in r.get("turns", []) if t.get("sync_p99_us") is not None]:
            p99 = round(statistics.median(t["sync_p99_us"] for t in turns))
            bound = " / ".join(t["bound"] for t in turns)
            each = [" / ".join(f"{t['sync_p99_us']:,}" for t in turns)]
        rows.append([MODES[m][0], r["workers"], r["sync_p50_us"], p99, *each,
                     f"≤ {SYNC_P99_TARGET_US:,}", "yes" if p99 is not None and p99 <= SYNC_P99_TARGET_US
                     else "no", bound])
    if not rows:
        return []
    notes = ["A point bound by the client's cores measures this machine: its workers are late,"
             " their rounds carry more and last longer. See the first table's note."]
    if turned:
        notes.append("Measured in turns: sync p99 is the median of the turns' (each listed, with each turn's"
                     " bound), p50 the first turn's. With --capacity-instructions the first turn's workers"
                     " also record every call they make, which costs their cores.")
    return [{"title": "Sync call durations at the most workers (server time of each call, SLOWLOG)",
             "columns": ["Redis", "workers", "sync p50 µs", "sync p99 µs"]
                        + (["sync p99 µs, each turn"] if turned else [])
                        + ["target p99 µs", "met", "bound by"], "rows": rows, "notes": notes}]


def _ratio(a: dict, b: dict, key: str) -> float | None:
    """``a``'s figure against ``b``'s: with several turns, the median of the turns' ratios (turn i of one
    mode against turn i of the other), else of the two points."""
    ta, tb = a.get("turns"), b.get("turns")
    if ta and tb and len(ta) == len(tb) and key in ta[0]:
        each = [x[key] / y[key] for x, y in zip(ta, tb, strict=True) if x.get(key) and y.get(key)]
        return round(statistics.median(each), 2) if each else None
    return round(a[key] / b[key], 2) if a.get(key) and b.get(key) else None


#: the figures every turn of a point measures again; the point gives their median over the turns
TURN_FIGURES = ("pages_per_s", "redis_cpu_us_per_page", "redis_idle_us_per_page",
                "redis_cpu_less_idle_us_per_page", "redis_cpu_cores", "workers_cpu_cores")


def combine_turns(points: list[dict]) -> dict:
    """One point measured in several turns: the first turn's point (its callgrind replay, latencies and
    per-domain figures), with the median over the turns of each of :data:`TURN_FIGURES` and every turn's
    own under ``turns``."""
    point = dict(points[0])
    if len(points) > 1:
        point["turns"] = [{k: p[k] for k in (*TURN_FIGURES, "sync_p99_us", "bound")} for p in points]
        for key in TURN_FIGURES:
            values = [p[key] for p in points if p[key] is not None]
            point[key] = statistics.median(values) if values else None
    return point


Block = tuple[int, int, list[tuple[int, str]]]  #: (turn, shards, points (workers, mode)) on one server


def turn_blocks(modes: list[str], counts: list[int], repeat: int) -> list[Block]:
    """The run as (turn, shards, points (workers, mode)) blocks, each measured on servers started for it: in
    every turn the one master's points, then the 3-master cluster's (the last three worker counts), so a
    sharded point and the one-master point it is compared with run minutes apart however many turns."""
    blocks: list[Block] = []
    for turn in range(repeat):
        for sharded, worker_counts in ((False, counts), (True, counts[-3:])):
            server_modes = [m for m in modes if (MODES[m][1] > 1) == sharded]
            if server_modes:
                points = [(n, m) for n in worker_counts for m in _turn_order(server_modes, turn)]
                blocks.append((turn, MODES[server_modes[0]][1], points))
    return blocks


def _turn_order(modes: list[str], turn: int) -> list[str]:
    """The modes of a server in turn ``turn``: every other turn the other way round, so that what one point
    leaves the next (the server's memory, the machine's state) weighs on each mode alike."""
    return modes if turn % 2 == 0 else modes[::-1]


def _print_point(mode: str, workers: int, turn: int, r: dict) -> None:
    less_idle = _round(r["redis_cpu_less_idle_us_per_page"])
    print(f"  {mode} N={workers}{f' turn {turn + 1}' if turn else ''}: {r['pages_per_s']:.0f} pages/s,"
          f" {_round(r['redis_cpu_us_per_page'])} us/page ({less_idle} less idle), sync p50"
          f" {r['sync_p50_us']} p99 {r['sync_p99_us']} us", flush=True)


def _turns_note(repeat: int) -> str:
    return (f"Measured in {repeat} turns (--capacity-repeat): in each turn every worker count and mode of"
            " a server once, the modes in one order in the odd turns and the other way round in the even"
            " ones, each turn on servers started for it (the one master's points, then the 3-master"
            " cluster's): a mode's turn i runs within minutes of every other mode's."
            " Pages/s, Redis CPU and CPU (cores) are the medians of the turns; the rest (callgrind's"
            " instructions, sync latencies and calls in this table, the per-domain tables) is the first"
            " turn's. The sync p99 of the latency table is the median of the turns'.")


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def _pct_of(x: float | None) -> str | None:
    return None if x is None else f"{100 * x:.0f}%"


def _machine_note(pin: tuple[set[int], set[int]] | None, total_rate: float, server_sched: str) -> str:
    if pin:
        note = (f"Redis server(s) on core {min(pin[0])} ({server_sched}), the workers' processes bound to"
                f" core(s) {','.join(map(str, sorted(pin[1])))} (--capacity-pin). CPU (cores): what the"
                " servers and the workers used themselves; cores busy: the share of the window the workers'"
                " cores ran anything (this machine's other processes too). Bound by: client when the workers'"
                f" cores were busy >= {SATURATED:.0%} -- the workers wait for CPU, rounds grow and each call"
                " with them, so pages/s there is the machine's, not the frontier's; server when the servers"
                f" used >= {SATURATED:.0%} of their core; - when neither. The sync durations are"
                " SLOWLOG's, the time the server ran the call (never the client's wait), and still grow when"
                " something else takes the Redis core mid-call.")
    else:
        note = (f"{os.cpu_count()} cores run the workers and Redis together (--no-capacity-pin): pages/s is"
                " bound by the machine; Redis CPU per page and the call durations are the frontier's own"
                " figures.")
    if total_rate:
        note += (f" The workers' pages/s are capped at {total_rate:g} in total (--capacity-rate; each worker"
                 " its share), so that every point's workers fit on their cores.")
    return note


#: seconds the worker processes get to start (imports, open) before the warm-up: a loaded machine needs more
STARTUP_S = 10


def _warmup(workers: int) -> float:
    """Seconds the crawl runs before a point's window: it grows from one page (a generation per fetch and
    round), so more workers need longer before each has work."""
    return 2.0 + workers / 4


def _round2(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


#: a side whose cores were busier than this over the window is saturated
SATURATED = 0.9


def _bound(pinned: bool, busy: list[float | None]) -> str:
    """What limited a point (``busy``: the servers' own share of their core, the workers' cores' busy
    share): the workers' cores ("client"), the servers' core ("server"), both, or neither; unpinned,
    both sides share every core ("shared")."""
    if not pinned:
        return "shared"
    sides = [name for name, b in zip(("server", "client"), busy, strict=True) if b and b >= SATURATED]
    return "+".join(sides) or "-"
