"""Crawl throughput of one worker with Scrapy's own scheduler, scrapy-redis, and scrapy-dist.

Every contestant crawls the same generated site (``SiteGraph``: ``/page/<i>``, 10 links a page, every page
reachable from ``/page/0``) served by nginx, with a real ``scrapy crawl`` of the same plain spider
(``benchmarks/bench_project``); only the scheduler, dupefilter and Redis settings differ. Redis contestants
run twice against a fresh ``redis-server``: directly on loopback, and behind ``benchmarks/proxy.py`` which
adds 1 ms of round-trip time and counts the round trips. Afterwards, Redis memory per queued request is
measured separately by queueing the same 20,000 plain GET requests with each contestant's queue code.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import redis

from benchmarks import redis_memory, replay
from benchmarks.machine import CpuMeter
from benchmarks.proxy import ProxyProcess, measure_rtt
from benchmarks.redis_server import (
    IDLE_SECONDS,
    SCRIPT_TIMING_US,
    RedisProcess,
    call_percentiles,
    idle_cpu_rate,
    script_call_durations,
    server_cpu,
    time_script_calls,
)
from benchmarks.static_site import StaticSite

TITLE = "crawl throughput, Redis round trips and memory: Scrapy vs scrapy-redis vs scrapy-dist"

REPO = Path(__file__).resolve().parent.parent
PROJECT = Path(__file__).resolve().parent / "bench_project"
SPIDER = "bench"
LINKS_PER_PAGE = 10
#: Requests queued for the bytes-per-queued-request measurement (the same N in quick and full runs).
QUEUE_MEMORY_N = 20_000

#: Average cores used by something other than the crawler above which a run is flagged as noisy. The
#: crawler's own helpers (nginx, redis-server, the proxy) use up to ~0.3 of a core.
BUSY_CORES = 0.5

#: Targets from the frontier issue, checked in the report (scrapy-dist vs the others).
TARGETS = {
    "ratio_rtt": 0.90,  # >= 0.90x Scrapy's pages/s at 1 ms RTT
    "ratio_loopback": 0.95,  # >= 0.95x on loopback
    "round_trips_per_page": 0.25,  # <= 0.25 Redis round trips per crawled page
    "queue_memory_vs_scrapy_redis": 0.40,  # <= 40% of scrapy-redis's bytes per queued request
}


@dataclass(frozen=True)
class Contestant:
    """One scheduler setup: the settings it crawls with and how to measure its Redis memory."""

    name: str
    uses_redis: bool
    settings: Callable[[str], dict[str, object]]  # redis URL -> extra Scrapy settings
    #: None when it can run, else why not (shown in the report).
    unavailable: Callable[[], str | None] = lambda: None
    #: glob of the dupefilter's keys left in Redis after a persistent crawl
    dupefilter_keys: str | None = None
    #: requests -> writer for redis_memory.bytes_per_entry, or None
    queue_writer: Callable[[list], Callable[[redis.Redis], None]] | None = None
    queue_unavailable: Callable[[], str | None] = lambda: None


def _missing(*targets: str) -> str | None:
    """None if every ``module:attribute`` imports, else what is missing."""
    for target in targets:
        module_name, _, attr = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            return f"`{module_name}` cannot be imported yet ({type(exc).__name__}: {exc})"
        if attr and not hasattr(module, attr):
            return f"`{module_name}` has no `{attr}` yet"
    return None


def _scrapy_redis_unavailable() -> str | None:
    missing = _missing("scrapy_redis.scheduler:Scheduler")
    if missing:
        return missing + "; install the `bench` extra"
    return None


CONTESTANTS: dict[str, Contestant] = {
    "scrapy": Contestant(
        name="scrapy",
        uses_redis=False,
        settings=lambda url: {},  # Scrapy's default scheduler, memory queues, RFPDupeFilter
    ),
    "scrapy-redis": Contestant(
        name="scrapy-redis",
        uses_redis=True,
        settings=lambda url: {
            "SCHEDULER": "scrapy_redis.scheduler.Scheduler",
            "SCHEDULER_QUEUE_CLASS": "scrapy_redis.queue.PriorityQueue",
            "DUPEFILTER_CLASS": "scrapy_redis.dupefilter.RFPDupeFilter",
            "REDIS_URL": url,
            # keep the keys after the crawl so the dupefilter's memory can be measured
            "SCHEDULER_PERSIST": True,
        },
        unavailable=_scrapy_redis_unavailable,
        dupefilter_keys=f"{SPIDER}:dupefilter",
        queue_writer=redis_memory.scrapy_redis_queue,
    ),
    # Enabled automatically once the lead's modules exist (see docs/benchmarks.md).
    "scrapy-dist": Contestant(
        name="scrapy-dist",
        uses_redis=True,
        settings=lambda url: {
            "SCHEDULER": "scrapy_dist.scheduler.Scheduler",
            "DUPEFILTER_CLASS": "scrapy_dist.dupefilter.BloomDupeFilter",
            "BLOOMFILTER_CAPACITY": 1_000_000,
            "REDIS_URL": url,
            "SCHEDULER_PERSIST": True,
            "SCHEDULER_DENY_NETWORKS": "[]",  # the local site is on loopback: denied by default
        },
        unavailable=lambda: _missing(
            "scrapy_dist.frontier.scheduler:Scheduler", "scrapy_dist.dupefilter:BloomDupeFilter"
        ),
        dupefilter_keys=f"{{{SPIDER}}}:bloom*",  # CrawlKeys(SPIDER).bloom and its bitmap blocks
        queue_writer=redis_memory.scrapy_dist_queue,
        queue_unavailable=lambda: _missing("scrapy_dist.wire.codec:encode_request"),
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("crawl benchmark")
    group.add_argument(
        "--crawl-contestants",
        default=",".join(CONTESTANTS),
        metavar="NAME[,NAME]",
        help=f"which of {', '.join(CONTESTANTS)} (default: all; unavailable ones are skipped)",
    )
    group.add_argument(
        "--crawl-rtt",
        metavar="MS[,MS]",
        help="Redis network conditions: 0 = loopback, N = behind the proxy adding N ms RTT "
        "(default 0,1; 0 with --quick)",
    )
    group.add_argument(
        "--crawl-timeout",
        type=float,
        metavar="S",
        help="give up on one crawl after S seconds (default: max(120, pages / 20))",
    )
    group.add_argument(
        "--crawl-repeat",
        type=int,
        default=1,
        metavar="N",
        help="crawl every configuration N times, in N interleaved rounds, and keep the fastest (default 1)",
    )
    group.add_argument(
        "--crawl-server",
        choices=("nginx", "python"),
        default="nginx",
        help="web server for the site (default nginx; python if nginx is not installed)",
    )


# -- one crawl ---------------------------------------------------------------------------------------
_LOG_LINE = re.compile(r"^\S+ \S+ \[([^\]]+)\] (WARNING|ERROR|CRITICAL): (.*)$")


def _problems(log_text: str, limit: int = 12) -> list[str]:
    """Distinct WARNING/ERROR/CRITICAL log lines and traceback tails, digits normalised."""
    seen: dict[str, None] = {}
    lines = log_text.splitlines()
    for i, line in enumerate(lines):
        m = _LOG_LINE.match(line)
        if m:
            text = f"{m.group(2)} [{m.group(1)}] {m.group(3)}"
        elif line.startswith("Traceback"):
            tail = next((t for t in lines[i + 1 : i + 60] if t and not t.startswith(" ")), "?")
            text = f"Traceback: {tail}"
        else:
            continue
        seen.setdefault(re.sub(r"\d+", "N", text)[:300])
    return list(seen)[:limit]


def run_crawl(
    contestant: Contestant, start_url: str, redis_url: str | None, args: argparse.Namespace, tag: str,
    extra: dict | None = None,
) -> dict:
    """One ``scrapy crawl`` subprocess (``extra``: more ``-s`` settings); returns its stats, timings and
    problems."""
    stats_file = args.tmp_dir / f"crawl-{tag}.stats.json"
    log_file = args.tmp_dir / f"crawl-{tag}.log"
    stats_file.unlink(missing_ok=True)
    settings = {
        "BENCH_STATS_FILE": str(stats_file),
        "CLOSESPIDER_TIMEOUT": int(args.crawl_timeout),
        **contestant.settings(redis_url or ""),
        **(extra or {}),
    }
    cmd = [sys.executable, "-m", "scrapy", "crawl", SPIDER, "-a", f"start_url={start_url}"]
    for k, v in settings.items():
        cmd += ["-s", f"{k}={v}"]
    env = dict(os.environ)
    # The working tree's scrapy_dist, whatever is installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    meter = CpuMeter().start()
    t = time.perf_counter()
    with open(log_file, "w") as log:
        try:
            proc = subprocess.run(
                cmd,
                cwd=PROJECT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=args.crawl_timeout + 60,
            )
            returncode: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            returncode = None
    wall = time.perf_counter() - t
    log_text = log_file.read_text(errors="replace")
    out: dict = {
        "returncode": returncode,
        "wall_s": wall,
        "log": str(log_file),
        "problems": _problems(log_text),
        "command": " ".join(cmd),
    }
    if not stats_file.exists():
        out["error"] = "crawl wrote no stats (crashed or timed out); see " + str(log_file)
        return out
    s = json.loads(stats_file.read_text())
    stats = s["stats"]
    pages = int(stats.get("response_received_count", 0))
    elapsed = None
    if s["t_first_response"] is not None and s["t_last_response"] is not None:
        elapsed = s["t_last_response"] - s["t_first_response"]
    out.update(
        finish_reason=s["reason"],
        pages=pages,
        ok_unique_pages=s["ok_unique_pages"],
        unique_urls=s.get("unique_urls"),
        elapsed_s=elapsed,
        pages_per_s=pages / elapsed if elapsed else None,
        startup_s=s["t_first_response"],  # extension built -> first response
        close_s=(s["t_closed"] - s["t_last_response"]) if s["t_last_response"] is not None else None,
        cpu_s=s["cpu_seconds"],
        cpu_ms_per_page=1000 * s["cpu_seconds"] / pages if pages else None,
        max_rss_mib=s["max_rss_mib"],
        download_latency_ms=s.get("download_latency_ms"),
        machine_load=meter.stop(s["cpu_seconds"], wall),
        stats=stats,
    )
    return out


def _redis_cost(client: redis.Redis, result: dict, cpu0: float, t0: float, idle: float, timed: bool) -> None:
    """Redis CPU per page (INFO cpu; and the share of it an idle server spends in the same time: ``idle``
    CPU s/s since ``t0``), the per-command breakdown (INFO commandstats), and with ``timed`` the p50/p99
    duration of one frontier sync call (SLOWLOG): into ``result``."""
    pages = result.get("pages")
    if not pages:
        return
    result["redis_cpu_us_per_page"] = 1e6 * (server_cpu(client) - cpu0) / pages
    seconds = time.monotonic() - t0
    result["redis_idle"] = {
        "cpu_us_per_s": 1e6 * idle, "seconds": seconds, "us_per_page": 1e6 * idle * seconds / pages,
    }
    commands = {}
    for name, c in client.info("commandstats").items():
        name = name.removeprefix("cmdstat_")
        if name in ("info", "config", "slowlog", "memory", "scan"):
            continue  # the benchmark's own
        commands[name] = {"calls_per_page": c["calls"] / pages, "us_per_page": c["usec"] / pages}
    result["redis_commands"] = dict(sorted(commands.items(), key=lambda kv: -kv[1]["us_per_page"]))
    if timed:
        sync = script_call_durations(client)
        if sync:
            result["script_call_us"] = {
                "calls": len(sync), **call_percentiles(sync),
                "evalsha_calls": commands.get("evalsha", {}).get("calls_per_page", 0) * pages,
                "note": f"every EVALSHA over {SCRIPT_TIMING_US} us (SLOWLOG): sync rounds, seeds, stats",
            }


def _range(values: list, digits: int = 1) -> str:
    got = [v for v in values if v is not None]
    return f"{min(got):.{digits}f}-{max(got):.{digits}f}" if got else "-"


def _redis_cost_table(runs: list[dict]) -> dict | None:
    """scrapy-dist's Redis cost per page as crawled (one worker: a call every ~70 ms, cold) and replayed
    back to back (the same calls on a master that is never idle), with the durations of its calls."""
    rows = []
    gaps = []
    for r in runs:
        if r["contestant"] != "scrapy-dist" or r.get("rtt_ms") or not r.get("script_call_us"):
            continue
        calls = r["script_call_us"]
        if calls["calls"] and r.get("elapsed_s"):
            gaps.append(r["elapsed_s"] * 1000 / calls["calls"])
        idle = r.get("redis_idle", {}).get("us_per_page")
        rows.append(["during the crawl (one worker)", r.get("redis_cpu_us_per_page"), idle, calls["calls"],
                     calls["p50"], calls["p99"], calls["max"]])
        again = r.get("replayed")
        if again:
            rows.append(["the same calls replayed back to back (a busy master)",
                         again["redis_cpu_us_per_page"], again.get("idle_us_per_page"), again["timed_calls"],
                         again["p50"], again["p99"], again["max"]])
    if not rows:
        return None
    gap = f"~{min(gaps):.0f} ms (crawl time / calls)" if gaps else "few tens of ms"
    spread = []
    for r in runs:
        parts = (r.get("replayed") or {}).get("by_script")
        if r["contestant"] == "scrapy-dist" and not r.get("rtt_ms") and parts:
            spread.append("Back to back, by script (calls, µs/page): " + "; ".join(
                f"{name} {v['calls']}, {v['us_per_page']:.1f}"
                for name, v in sorted(parts.items(), key=lambda kv: -kv[1]["us_per_page"])))
    for r in runs:
        repeated = r.get("repeats_redis_cpu_us_per_page")
        if r["contestant"] == "scrapy-dist" and not r.get("rtt_ms") and repeated:
            spread.append(
                f"Over the {len(repeated)} crawls of this run (the table shows the"
                f" fastest): Redis CPU {_range(repeated)} µs/page during the crawl,"
                f" {_range(r['repeats_replayed_us_per_page'])} back to back; call p99 during the crawl"
                f" {_range(r['repeats_script_call_p99'], 0)} µs. One worker's figures move with the machine"
                " (how cold the server's caches are at each call); the back-to-back ones hardly do."
            )
    return {
        "title": "scrapy-dist: Redis CPU per page and script call durations, as crawled and on a busy master",
        "columns": [
            "Redis", "Redis CPU µs/page", "of which an idle server's µs/page", "script calls",
            "call p50 µs", "call p99 µs", "call max µs",
        ],
        "rows": rows,
        "notes": [
            f"During the crawl one worker makes a call every {gap}: between calls the"
            " server idles and the crawler, on the same two cores, evicts its caches, so every call runs"
            " cold. A master serving "
            "many workers runs calls back to back: the crawl's recorded calls (KEYS and ARGV, in order) are "
            "replayed on a fresh server of the same build (benchmarks/replay.py). That is the cost to divide "
            "a master's core by when planning capacity.",
            "Of which an idle server's: what the same server spends with no client at all, for as long as"
            f" the crawl (or the replay) took, measured for {IDLE_SECONDS:g} s before the crawl: serverCron"
            " and the other timers run 10 times a second (`hz`) whatever the load, so this part is per"
            " second, not per page, and vanishes per page on a busy master.",
            f"Call durations: SLOWLOG of every EVALSHA over {SCRIPT_TIMING_US} µs (every sync call takes"
            " longer).",
            *spread,
        ],
    }


def _dupefilter_bytes(client: redis.Redis, pattern: str | None) -> int | None:
    if not pattern:
        return None
    total = 0
    for key in client.scan_iter(match=pattern, count=1000):
        total += client.memory_usage(key, samples=0) or 0
    return total


def run_redis_contestant(
    contestant: Contestant, start_url: str, rtt_ms: float, args: argparse.Namespace
) -> dict:
    """Fresh redis-server (+ proxy when ``rtt_ms`` > 0), one crawl, then round trips and dupefilter memory."""
    server = RedisProcess().start()
    proxy = None
    try:
        client = redis.Redis(port=server.port)
        client.flushall()
        # scrapy-dist's script calls are timed by the server itself (SLOWLOG, see SCRIPT_TIMING_US): their
        # p50/p99 is how long one call holds Redis
        timed = contestant.name == "scrapy-dist"
        if timed:
            time_script_calls(client)
        idle = idle_cpu_rate(client)
        client.config_resetstat()
        t0, cpu0 = time.monotonic(), server_cpu(client)
        network: dict = {"rtt_ms": rtt_ms, "ping_direct": measure_rtt(server.port)}
        url = server.url
        if rtt_ms > 0:
            proxy = ProxyProcess(server.port, rtt_ms).start()
            network["ping_proxied"] = measure_rtt(proxy.port)
            proxy.reset()
            url = proxy.url
        tag = f"{contestant.name}-rtt{rtt_ms:g}"
        calls_file = args.tmp_dir / f"crawl-{tag}.calls.jsonl"
        # scrapy-dist's script calls on loopback are recorded, to be replayed back to back afterwards
        extra = {"BENCH_SCRIPT_CALLS_FILE": str(calls_file)} if timed and rtt_ms <= 0 else {}
        result = run_crawl(contestant, start_url, url, args, tag=tag, extra=extra)
        result["network"] = network
        try:
            _redis_cost(client, result, cpu0, t0, idle, timed)
            if extra and result.get("pages") and calls_file.exists():
                result["replayed"] = replay.replay(calls_file, result["pages"], idle)
            if proxy is not None:
                counters = proxy.stats()
                result["proxy"] = counters
                if result.get("pages"):
                    result["round_trips_per_page"] = counters["round_trips"] / result["pages"]
            df_bytes = _dupefilter_bytes(client, contestant.dupefilter_keys)
            result["dupefilter_bytes"] = df_bytes
            if df_bytes and result.get("ok_unique_pages"):
                result["dupefilter_bytes_per_url"] = df_bytes / result["ok_unique_pages"]
        except (redis.RedisError, OSError, ValueError) as exc:  # e.g. BUSY: a script that never returned
            result["post_crawl_error"] = f"{type(exc).__name__}: {exc}"
        client.close()
        return result
    finally:
        if proxy is not None:
            proxy.stop()
        server.stop()


# -- the benchmark ----------------------------------------------------------------------------------
def _network_label(rtt_ms: float) -> str:
    return "loopback" if rtt_ms <= 0 else f"+{rtt_ms:g} ms RTT"


def run(args: argparse.Namespace) -> dict:
    from scrapy_dist.demo.site import SiteGraph

    pages = args.pages or (2_000 if args.quick else 20_000)
    rtts = [float(x) for x in (args.crawl_rtt or ("0" if args.quick else "0,1")).split(",")]
    if args.crawl_timeout is None:
        args.crawl_timeout = max(120.0, pages / 20)
    wanted = [n.strip() for n in args.crawl_contestants.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in CONTESTANTS]
    if unknown:
        raise ValueError(f"unknown contestant(s) {unknown}; known: {list(CONTESTANTS)}")
    notes: list[str] = []
    skipped: dict[str, str] = {}
    contestants = []
    for name in wanted:
        reason = CONTESTANTS[name].unavailable()
        if reason:
            skipped[name] = reason
            notes.append(f"**{name} skipped**: {reason}.")
        else:
            contestants.append(CONTESTANTS[name])

    graph = SiteGraph(pages, links=LINKS_PER_PAGE, seed=1)
    runs: list[dict] = []
    with StaticSite(graph, prefer=args.crawl_server) as site:
        print(
            f"   site: {pages:,} pages, {LINKS_PER_PAGE} links/page, served by {site.server} at {site.url}",
            flush=True,
        )
        if not site.server.startswith("nginx"):
            notes.append(f"Site served by {site.server}: slower than nginx, pages/s may be server-bound.")
        start_url = f"{site.url}/page/0"
        # (contestant, rtt): Scrapy's own scheduler uses no Redis, so it crawls once per round.
        configs: list[tuple[Contestant, float | None]] = [(c, None) for c in contestants if not c.uses_redis]
        configs += [(c, rtt) for rtt in rtts for c in contestants if c.uses_redis]
        attempts: dict[int, list[dict]] = {i: [] for i in range(len(configs))}
        # Rounds, not back-to-back repeats: on a shared machine the load drifts, and interleaving keeps
        # every configuration's best-of-N drawn from the same stretch of time.
        for round_no in range(max(1, args.crawl_repeat)):
            for i, (c, rtt) in enumerate(configs):
                where = "no Redis" if rtt is None else f"Redis {_network_label(rtt)}"
                suffix = f" (round {round_no + 1}/{args.crawl_repeat})" if args.crawl_repeat > 1 else ""
                print(f"   {c.name}: crawling, {where}{suffix} ...", flush=True)
                if rtt is None:
                    crawl = partial(run_crawl, c, start_url, None, args, tag=c.name)
                else:
                    crawl = partial(run_redis_contestant, c, start_url, rtt, args)
                attempts[i].append(_attempt(crawl))
        for i, (c, rtt) in enumerate(configs):
            runs.append({"contestant": c.name, "rtt_ms": rtt, **_best(attempts[i])})

    memory = measure_memory(contestants, skipped)
    return build_result(graph, site.server, runs, rtts, memory, notes, skipped, args)


def _attempt(crawl: Callable[[], dict]) -> dict:
    """One crawl; an exception becomes an ``error`` result (it must not lose the other contestants')."""
    try:
        result = crawl()
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    _print_run(result)
    return result


def _best(results: list[dict]) -> dict:
    """The fastest of a configuration's crawls (errors only if all failed), with every pages/s in
    ``repeats`` when there were several."""
    ok = [r for r in results if not r.get("error")] or results
    best = max(ok, key=lambda r: r.get("pages_per_s") or 0)
    if len(results) > 1:
        best["repeats"] = [r.get("pages_per_s") for r in results]
        best["repeats_redis_cpu_us_per_page"] = [r.get("redis_cpu_us_per_page") for r in results]
        best["repeats_replayed_us_per_page"] = [
            r.get("replayed", {}).get("redis_cpu_us_per_page") for r in results
        ]
        best["repeats_script_call_p99"] = [r.get("script_call_us", {}).get("p99") for r in results]
    return best


def _print_run(r: dict) -> None:
    if r.get("error"):
        print(f"     ERROR: {r['error']}", flush=True)
        return
    if not r.get("pages_per_s"):
        print(f"     {r['pages']:,} pages, finish reason {r['finish_reason']}; see {r['log']}", flush=True)
        return
    rt = r.get("round_trips_per_page")
    print(
        f"     {r['pages']:,} pages ({r['ok_unique_pages']:,} distinct) in {r['elapsed_s']:.1f} s = "
        f"{r['pages_per_s']:.0f} pages/s, CPU {r['cpu_ms_per_page']:.1f} ms/page"
        + (f", {rt:.2f} Redis round trips/page" if rt is not None else "")
        + (f", Redis CPU {r['redis_cpu_us_per_page']:.0f} us/page" if r.get("redis_cpu_us_per_page") else "")
        + f", other load {r['machine_load']['other_cores']} cores"
        + (f", {len(r['problems'])} distinct warnings/errors in {r['log']}" if r["problems"] else ""),
        flush=True,
    )


def measure_memory(contestants: list[Contestant], skipped: dict[str, str]) -> dict[str, dict]:
    """Bytes per queued request for every Redis contestant that has a queue writer."""
    out: dict[str, dict] = {}
    requests = redis_memory.plain_requests(QUEUE_MEMORY_N)
    for c in contestants:
        if not c.uses_redis or c.queue_writer is None:
            continue
        reason = c.queue_unavailable()
        if reason:
            out[c.name] = {"skipped": reason}
            continue
        print(
            f"   {c.name}: queueing {QUEUE_MEMORY_N:,} plain GET requests for the memory measurement",
            flush=True,
        )
        try:
            out[c.name] = redis_memory.bytes_per_entry(c.queue_writer(requests), QUEUE_MEMORY_N)
        except Exception as exc:  # the crawl figures still count
            out[c.name] = {"skipped": f"failed: {type(exc).__name__}: {exc}"}
            print(f"     ERROR: {out[c.name]['skipped']}", flush=True)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def build_result(
    graph,
    server: str,
    runs: list[dict],
    rtts: list[float],
    memory: dict[str, dict],
    notes: list[str],
    skipped: dict[str, str],
    args: argparse.Namespace,
) -> dict:
    baseline = next((r for r in runs if r["contestant"] == "scrapy" and not r.get("error")), None)
    base_pps = baseline["pages_per_s"] if baseline else None
    rows = []
    noisy: list[str] = []
    for r in runs:
        if r["rtt_ms"] is None:
            network = "none (in-memory)"
        else:
            network = _network_label(r["rtt_ms"])
            proxied = r.get("network", {}).get("ping_proxied")
            if proxied:
                network += f" (PING {proxied['median_ms']:.2f} ms)"
        if r.get("error"):
            rows.append([r["contestant"], network, "FAILED: " + r["error"], *[None] * 6])
            continue
        complete = r["ok_unique_pages"] == graph.ok_pages and r["finish_reason"] == "finished"
        crawled = f"{r['pages']:,} / {graph.ok_pages:,}" + (
            "" if complete else f" INCOMPLETE ({r['finish_reason']})"
        )
        r["ratio_vs_scrapy"] = _ratio(r["pages_per_s"], base_pps)
        rows.append(
            [
                r["contestant"],
                network,
                crawled,
                r["elapsed_s"],
                r["pages_per_s"],
                r["ratio_vs_scrapy"],
                r.get("round_trips_per_page"),
                r["cpu_ms_per_page"],
                r.get("redis_cpu_us_per_page"),
            ]
        )
        r["complete"] = complete
        if not complete:
            notes.append(
                f"**{r['contestant']} ({network}) did not crawl the whole site**: "
                f"{r['ok_unique_pages']:,} of {graph.ok_pages:,} distinct pages; see {r['log']}."
            )
        if (r["machine_load"]["other_cores"] or 0) > BUSY_CORES:
            noisy.append(f"{r['contestant']} ({network}): {r['machine_load']['other_cores']} cores")
        if r.get("post_crawl_error"):
            notes.append(
                f"{r['contestant']} ({network}): measuring after the crawl failed: {r['post_crawl_error']}"
            )
        statuses = {
            k.rsplit("/", 1)[1]: v
            for k, v in r["stats"].items()
            if k.startswith("downloader/response_status_count/") and not k.endswith("/200")
        }
        if statuses:
            notes.append(f"{r['contestant']} ({network}) got non-200 responses: {statuses}; see {r['log']}.")
        again = r["pages"] - r.get("unique_urls", r["pages"])
        if again > 0:
            notes.append(f"{r['contestant']} ({network}) fetched {again:,} URLs more than once.")

    crawl_table = {
        "title": f"Crawl of a {graph.pages:,}-page site ({LINKS_PER_PAGE} links/page), one worker, "
        "CONCURRENT_REQUESTS=32",
        "columns": [
            "Contestant",
            "Redis",
            "Pages crawled / site",
            "Elapsed s",
            "Pages/s",
            "vs Scrapy",
            "Redis round trips/page",
            "Crawler CPU ms/page",
            "Redis CPU µs/page",
        ],
        "rows": rows,
        "notes": [
            "Elapsed = first response to last response (startup and shutdown excluded; "
            "both are in latest.json).",
            "vs Scrapy = pages/s divided by Scrapy's default scheduler's pages/s. That crawl uses no Redis, "
            "so it runs once and is the baseline for every network condition.",
            "Round trips are counted by the latency proxy, so only for proxied runs: see docs/benchmarks.md.",
            "Redis CPU µs/page = growth of the redis-server's INFO used_cpu_sys + used_cpu_user during the"
            " crawl / pages; the per-command breakdown (INFO commandstats) and scrapy-dist's script call"
            " durations (SLOWLOG, p50/p99) are in latest.json under each run.",
        ],
    }

    sr_queue = memory.get("scrapy-redis", {}).get("bytes_per_entry")
    mem_rows: list[list[object]] = []
    ran = {r["contestant"] for r in runs}
    for c in [n for n in CONTESTANTS if CONTESTANTS[n].uses_redis and (n in ran or n in skipped)]:
        m = memory.get(c)
        df = next(
            (
                r.get("dupefilter_bytes_per_url")
                for r in runs
                if r["contestant"] == c and r.get("dupefilter_bytes_per_url")
            ),
            None,
        )
        if c in skipped:
            mem_rows.append([c, "skipped", None, None])
        elif m is None or "skipped" in m:
            mem_rows.append([c, "not measured" + (f": {m['skipped']}" if m else ""), None, df])
        else:
            mem_rows.append([c, m["bytes_per_entry"], _ratio(m["bytes_per_entry"], sr_queue), df])
    memory_table = {
        "title": f"Redis memory: {QUEUE_MEMORY_N:,} queued plain GET requests; dupefilter after the crawl",
        "columns": [
            "Contestant",
            "Bytes/queued request",
            "vs scrapy-redis",
            "Dupefilter bytes/URL (this crawl)",
        ],
        "rows": mem_rows,
        "notes": [
            "Bytes/queued request = growth of INFO used_memory of an empty Redis after queueing the requests "
            "with the contestant's own queue code, divided by their number.",
            "Dupefilter bytes/URL = MEMORY USAGE of the dupefilter keys after the crawl / distinct URLs "
            f"seen ({graph.ok_pages:,}). A Bloom filter sized for BLOOMFILTER_CAPACITY=1,000,000 is mostly "
            "empty here; the `dupefilter` benchmark measures it at capacity.",
        ]
        + [f"{name} queued through {m['method']}." for name, m in memory.items() if m.get("method")],
    }

    if noisy:
        notes.insert(
            0,
            "**Noisy: something else used the machine during these crawls** (average cores busy "
            "outside the crawler, nginx/Redis/proxy included): "
            + "; ".join(noisy)
            + ". Re-run on an idle machine (or with --crawl-repeat 3) before comparing.",
        )
    targets_table = _targets(runs, memory, rtts)
    charts = _charts(runs, rtts, memory, base_pps)
    sr_problems = sorted(
        {p for r in runs if r["contestant"] == "scrapy-redis" for p in r.get("problems", [])}
    )
    if sr_problems:
        notes.append("scrapy-redis 0.9.1 on Scrapy 2.19 logged: " + "; ".join(f"`{p}`" for p in sr_problems))
    elif any(r["contestant"] == "scrapy-redis" for r in runs):
        notes.append(
            "scrapy-redis 0.9.1 ran on Scrapy 2.19 (asyncio reactor, plain Spider with `async start()`) "
            "without warnings or errors."
        )
    for r in runs:
        if r["contestant"] != "scrapy-redis" and r.get("problems"):
            notes.append(
                f"{r['contestant']} ({_network_label(r['rtt_ms'] or 0)}) logged: "
                + "; ".join(f"`{p}`" for p in r["problems"])
            )
    tables = [crawl_table, memory_table]
    cost_table = _redis_cost_table(runs)
    if cost_table:
        tables.insert(1, cost_table)
    if targets_table:
        tables.append(targets_table)
    for r in runs:  # keep latest.json readable: only the stats that matter
        r["stats"] = {
            k: v
            for k, v in r.get("stats", {}).items()
            if k.startswith(
                (
                    "scheduler/",
                    "dupefilter/",
                    "downloader/response_status",
                    "finish",
                    "response_received",
                    "item_scraped",
                    "log_count/",
                    "elapsed",
                )
            )
        }
    failed = [r["contestant"] for r in runs if r.get("error") or not r.get("complete")]
    return {
        "title": TITLE,
        "failed": bool(failed),
        "summary": f"Site: {graph.pages:,} pages served by {server}. "
        "Crawler: `scrapy crawl` of a plain Spider, CONCURRENT_REQUESTS=32, "
        "CONCURRENT_REQUESTS_PER_DOMAIN=32, DOWNLOAD_DELAY=0, no AutoThrottle, no robots.txt, "
        "LOG_LEVEL=INFO. Each Redis run uses a fresh redis-server.",
        "tables": tables,
        "charts": charts,
        "notes": notes,
        "data": {
            "pages": graph.pages,
            "links_per_page": LINKS_PER_PAGE,
            "server": server,
            "rtts_ms": rtts,
            "runs": runs,
            "queue_memory": memory,
            "skipped": skipped,
            "crawl_timeout_s": args.crawl_timeout,
        },
    }


def _find(runs: list[dict], contestant: str, rtt: float | None) -> dict | None:
    return next(
        (r for r in runs if r["contestant"] == contestant and r["rtt_ms"] == rtt and not r.get("error")), None
    )


def _targets(runs: list[dict], memory: dict[str, dict], rtts: list[float]) -> dict | None:
    """The frontier issue's targets for scrapy-dist (rows with no measurement say so)."""
    if not any(r["contestant"] == "scrapy-dist" for r in runs):
        return None
    rows = []

    def row(what: str, limit: str, value: float | None, ok: bool | None) -> None:
        rows.append([what, limit, value, "—" if ok is None else ("met" if ok else "**missed**")])

    proxied = [x for x in rtts if x > 0]
    if proxied:
        r = _find(runs, "scrapy-dist", proxied[0])
        v = r.get("ratio_vs_scrapy") if r else None
        row(
            f"pages/s vs Scrapy at +{proxied[0]:g} ms RTT",
            f">= {TARGETS['ratio_rtt']}",
            v,
            None if v is None else v >= TARGETS["ratio_rtt"],
        )
        rt = r.get("round_trips_per_page") if r else None
        row(
            "Redis round trips per crawled page",
            f"<= {TARGETS['round_trips_per_page']}",
            rt,
            None if rt is None else rt <= TARGETS["round_trips_per_page"],
        )
    if 0 in rtts:
        r = _find(runs, "scrapy-dist", 0.0)
        v = r.get("ratio_vs_scrapy") if r else None
        row(
            "pages/s vs Scrapy on loopback",
            f">= {TARGETS['ratio_loopback']}",
            v,
            None if v is None else v >= TARGETS["ratio_loopback"],
        )
    sd = memory.get("scrapy-dist", {}).get("bytes_per_entry")
    sr = memory.get("scrapy-redis", {}).get("bytes_per_entry")
    v = _ratio(sd, sr)
    row(
        "bytes per queued request vs scrapy-redis",
        f"<= {TARGETS['queue_memory_vs_scrapy_redis']}",
        v,
        None if v is None else v <= TARGETS["queue_memory_vs_scrapy_redis"],
    )
    return {
        "title": "Targets for scrapy-dist (frontier issue)",
        "columns": ["Target", "Required", "Measured", ""],
        "rows": rows,
    }


def _charts(
    runs: list[dict], rtts: list[float], memory: dict[str, dict], base_pps: float | None
) -> list[dict]:
    names = [n for n in CONTESTANTS if any(r["contestant"] == n for r in runs)]
    cats = [_network_label(x) for x in rtts]
    series = {}
    for n in names:
        if CONTESTANTS[n].uses_redis:
            series[n] = [(_find(runs, n, x) or {}).get("pages_per_s") for x in rtts]
        else:
            series[n] = [base_pps for _ in rtts]  # no Redis: the same crawl is the baseline everywhere
    charts = [
        {"title": "pages/s (higher is better)", "ylabel": "pages/s", "categories": cats, "series": series}
    ]
    proxied = [x for x in rtts if x > 0]
    if proxied:
        charts.append(
            {
                "title": "Redis round trips per crawled page (lower is better)",
                "ylabel": "round trips / page",
                "categories": [_network_label(x) for x in proxied],
                "series": {
                    n: [(_find(runs, n, x) or {}).get("round_trips_per_page") for x in proxied]
                    for n in names
                    if CONTESTANTS[n].uses_redis
                },
            }
        )
    mem_names = [n for n in memory if "bytes_per_entry" in memory[n]]
    if mem_names:
        charts.append(
            {
                "title": f"Redis bytes per queued request (N={QUEUE_MEMORY_N:,}, lower is better)",
                "ylabel": "bytes",
                "categories": ["queued request"],
                "series": {n: [memory[n]["bytes_per_entry"]] for n in mem_names},
            }
        )
    return charts
