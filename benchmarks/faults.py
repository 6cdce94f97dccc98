"""Faults survived: real partitions, pauses, kills and a failover, each in a crawl on namespaced hosts.

Every fault runs a fresh crawl (:class:`benchmarks.faultcrawl.FaultCrawl`: Redis, the site and 3-4
workers, each in its own network namespace with its own address and hostname) of a site with items
through ``RedisPipeline``; once a quarter of the site is fetched the fault is injected, healed if it
heals, and the crawl must close by itself. :func:`benchmarks.faultcheck.check` then judges it from the
site's access log, the items in Redis and the workers' logs. Timings scale with the lease
(``SCHEDULER_LEASE_SECONDS``): a short partition lasts 0.4 lease, a long one, a pause 1.5 lease.

``python -m benchmarks faults [--faults NAME,...] [--faults-repeat N]``; needs root (network namespaces),
else it stops with one line saying why. See docs/operations.md ("Faults survived").
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.faultcheck import Verdict, check
from benchmarks.faultcrawl import CrawlConfig, FaultCrawl
from benchmarks.netns import HarnessUnavailable, Network, check_available

TITLE = "Faults survived: partitions, pauses, kills, failover and latency on namespaced hosts"

#: Flip to True once items are written exactly once (a zombie's items refused): every fault must then
#: end with no duplicate item, not only those in :data:`DUPLICATE_FREE_TODAY`.
EXACTLY_ONCE_ITEMS = True
#: Faults that already end with no duplicate item: under the others, requests held by a faulted worker are
#: crawled again and their items written again, and an item batch whose reply was lost is written twice.
DUPLICATE_FREE_TODAY = frozenset({"latency"})
#: Seconds Redis is cut off from every worker (at most 0.75 lease in a short crawl).
REDIS_CUT_SECONDS = 30.0
VICTIM = "w2"


@dataclass
class Fault:
    """One fault: how to inject it, which workers it hits and how the crawl is set up for it."""

    name: str
    title: str
    inject: Callable[[FaultCrawl], dict[str, Any]]
    victims: Callable[[CrawlConfig], list[str]]
    killed: bool = False
    config: dict[str, Any] = field(default_factory=dict)

    def duplicate_items_allowed(self) -> bool:
        return not EXACTLY_ONCE_ITEMS and self.name not in DUPLICATE_FREE_TODAY


def _one(_cfg: CrawlConfig) -> list[str]:
    return [VICTIM]


def _every(cfg: CrawlConfig) -> list[str]:
    return [f"w{i}" for i in range(1, cfg.workers + 1)]


#: after a fault cuts a worker off, a command it sent just before may still run: the leases it holds are
#: counted once that had time to land (well within a lease, before any of them can expire)
HELD_SETTLE = 0.3


def _held_once_cut(crawl: FaultCrawl, names: list[str]) -> int:
    """What the workers ``names`` hold once the fault took them off Redis: what the fault can cost."""
    time.sleep(HELD_SETTLE)
    return sum(crawl.held_by(name) for name in names)


def _partition(nets: tuple[str, ...] | None, lease_fraction: float) -> Callable[[FaultCrawl], dict[str, Any]]:
    def inject(crawl: FaultCrawl) -> dict[str, Any]:
        seconds = lease_fraction * crawl.cfg.lease
        crawl.net.cut(VICTIM, nets)
        held = _held_once_cut(crawl, [VICTIM])
        time.sleep(seconds - HELD_SETTLE)
        status = crawl.status()
        crawl.net.heal(VICTIM, nets)
        return {"fault_seconds": seconds, "status_during": status, "held_at_fault": held}

    return inject


def _pause(crawl: FaultCrawl) -> dict[str, Any]:
    seconds = 1.5 * crawl.cfg.lease
    proc = crawl.workers[VICTIM]
    proc.send_signal(signal.SIGSTOP)
    held = _held_once_cut(crawl, [VICTIM])
    time.sleep(seconds - HELD_SETTLE)
    status = crawl.status()
    proc.send_signal(signal.SIGCONT)
    return {"fault_seconds": seconds, "status_during": status, "held_at_fault": held}


def _kill(count: int) -> Callable[[FaultCrawl], dict[str, Any]]:
    def inject(crawl: FaultCrawl) -> dict[str, Any]:
        names = [f"w{i}" for i in range(2, 2 + count)]
        for name in names:
            crawl.workers[name].send_signal(signal.SIGKILL)
        for name in names:
            crawl.workers[name].wait()
        held = _held_once_cut(crawl, names)
        time.sleep(max(0.0, min(5.0, crawl.cfg.lease / 2) - HELD_SETTLE))
        return {"fault_seconds": 0.0, "status_during": crawl.status(), "held_at_fault": held}

    return inject


def _redis_cut(crawl: FaultCrawl) -> dict[str, Any]:
    seconds = min(REDIS_CUT_SECONDS, 0.75 * crawl.cfg.lease)
    crawl.net.cut("redis")
    time.sleep(seconds)
    crawl.net.heal("redis")
    return {"fault_seconds": seconds}


def _redis_kill(crawl: FaultCrawl) -> dict[str, Any]:
    proc = crawl.servers["redis"]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    started = time.monotonic()
    time.sleep(2.0)
    crawl.start_redis("redis")
    crawl.wait_redis("redis")
    return {"fault_seconds": round(time.monotonic() - started, 1), "status_during": crawl.status()}


def _failover(crawl: FaultCrawl) -> dict[str, Any]:
    """Cut the master's host off, wait for the Sentinels to promote the replica, heal the old master a
    few seconds later and wait until it is a replica again; counts the writes the cut master held."""

    def _replication(host: str) -> dict[str, Any]:
        return dict(crawl.redis(host, lambda c: c.info("replication")))

    before = _replication("redis")
    crawl.net.cut("redis")
    started = time.monotonic()
    crawl._wait_until(lambda: crawl.sentinel_master() == "replica", 60, "the replica's promotion")
    promoted = time.monotonic() - started
    crawl.master = "replica"
    # the replica's offset when it was promoted: what the old master had beyond it is what Redis drops
    crawl._wait_until(
        lambda: _replication("replica").get("second_repl_offset", -1) > 0, 30, "the promoted replica's offset"
    )
    promoted_at = int(_replication("replica")["second_repl_offset"])
    time.sleep(5.0)
    old = _replication("redis")
    crawl.net.heal("redis")
    crawl._wait_until(
        lambda: _replication("redis").get("role") == "slave", 60,
        "the old master to become a replica",
    )
    return {
        "fault_seconds": round(time.monotonic() - started, 1),
        "promoted_after_s": round(promoted, 1),
        "old_master_offset_at_cut": before.get("master_repl_offset"),
        "old_master_offset_at_heal": old.get("master_repl_offset"),
        "replica_offset_at_promotion": promoted_at,
        "replication_bytes_lost": max(0, int(old.get("master_repl_offset", 0)) - promoted_at + 1),
        "status_during": crawl.status(),
    }


def _nothing(crawl: FaultCrawl) -> dict[str, Any]:
    return {"fault_seconds": 0.0}


FAULTS: dict[str, Fault] = {f.name: f for f in [
    Fault("partition-short", "worker partitioned 0.4 lease, healed", _partition(None, 0.4), _one),
    Fault("partition-zombie", "worker cut from Redis 1.5 lease, downloading, healed",
          _partition(("data",), 1.5), _one),
    Fault("redis-partition", "Redis cut from every worker", _redis_cut, _every),
    Fault("sigstop", "worker SIGSTOPped 1.5 lease, resumed", _pause, _one),
    Fault("kill-one", "SIGKILL of one worker", _kill(1), _one, killed=True),
    Fault("kill-two", "SIGKILL of two workers at once", _kill(2), lambda cfg: ["w2", "w3"], killed=True),
    Fault("kill-redis", "SIGKILL of Redis (AOF everysec), restarted", _redis_kill, _every,
          config={"aof": True}),
    Fault("failover", "Sentinel failover: master cut off, replica promoted, old master healed", _failover,
          _every, config={"sentinel": True}),
    Fault("latency", "20 ms +- 10 ms RTT to Redis, whole crawl", _nothing, _every,
          config={"rtt_ms": 20.0, "jitter_ms": 10.0}),
]}


@dataclass
class FaultRun:
    """The outcome of one fault: the checker's verdict and what the harness saw."""

    fault: str
    verdict: Verdict
    duration_s: float
    held_at_fault: int
    info: dict[str, Any]
    exit_codes: dict[str, int | None]
    nominal_bound: int = 0

    def problems(self) -> list[str]:
        return self.verdict.problems(FAULTS[self.fault].duplicate_items_allowed())


def run_fault(name: str, cfg: CrawlConfig, root: Path) -> FaultRun:
    """One fresh crawl with fault ``name`` injected once a quarter of the site is fetched."""
    fault = FAULTS[name]
    cfg = replace(cfg, **fault.config)
    victims = fault.victims(cfg)
    started = time.monotonic()
    with Network() as net:
        crawl = FaultCrawl(net, cfg, root)
        crawl.build()
        crawl.start_workers()
        crawl.wait_pages(max(1, cfg.pages // 4), timeout=cfg.timeout)
        if fault.victims is _one or fault.killed:
            crawl._wait_until(lambda: all(crawl.held_by(v) > 0 for v in victims), 30, "the victim's leases")
        held = sum(crawl.held_by(v) for v in victims)
        info = fault.inject(crawl)
        # what they held when the fault hit (a sync may land between the count above and the fault)
        held = max(held, info.pop("held_at_fault", 0))
        codes = crawl.wait_workers(cfg.timeout)
        info["status_after"] = _status_digest(crawl.status())
        if "status_during" in info:
            info["status_during"] = _status_digest(info["status_during"])
        items = crawl.items()
        logs = {n: crawl.worker_log(n).read_text(errors="replace") for n in crawl.workers}
        verdict = check(
            cfg.pages, crawl.access(), items, logs, codes,
            faulted=victims if fault.killed else [],
            duplicate_fetch_bound=max(held, len(victims) * cfg.held_bound),
        )
    nominal = len(victims) * cfg.held_bound
    return FaultRun(name, verdict, round(time.monotonic() - started, 1), held, info, codes, nominal)


def _status_digest(status: dict[str, Any]) -> dict[str, Any]:
    """What ``status`` said of the workers: each one's id and state, and the crawl's state."""
    if "error" in status:
        return {"error": status["error"]}
    workers = status.get("workers") or []
    return {
        "state": status.get("state"),
        "workers": {w.get("id", "?"): w.get("state") for w in workers if isinstance(w, dict)},
    }


# -- the benchmark -----------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--faults", metavar="NAME[,NAME]",
                        help=f"faults to run (default all: {', '.join(FAULTS)})")
    parser.add_argument("--faults-repeat", type=int, default=1, metavar="N",
                        help="runs of each fault (default 1)")
    parser.add_argument("--faults-lease", type=float, default=40.0, metavar="S",
                        help="SCHEDULER_LEASE_SECONDS of the faulted crawls (default 40)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    try:
        check_available()
    except HarnessUnavailable as exc:
        return {"title": TITLE, "status": "skipped", "notes": [str(exc)], "failed": True}
    names = [n.strip() for n in (args.faults or ",".join(FAULTS)).split(",") if n.strip()]
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise ValueError(f"unknown fault(s) {', '.join(unknown)}; known: {', '.join(FAULTS)}")
    pages = args.pages or (400 if args.quick else 2000)
    cfg = CrawlConfig(pages=pages, lease=args.faults_lease, workers=4)
    runs: list[FaultRun] = []
    for repeat in range(args.faults_repeat):
        for name in names:
            root = Path(args.tmp_dir) / f"faults-{os.getpid()}" / f"{name}-{repeat}"
            print(f"   {name} (run {repeat + 1})", flush=True)
            result = run_fault(name, cfg, root)
            print(f"   -> {_row(result)[1:]}", flush=True)
            runs.append(result)
    return _report(cfg, runs)


def _row(r: FaultRun) -> list[Any]:
    v = r.verdict
    return [r.fault, v.pages_never_fetched, v.items_lost, v.duplicate_items, v.duplicate_fetches,
            v.duplicate_fetch_bound, r.nominal_bound, r.held_at_fault, "yes" if v.closed_by_itself else "NO",
            v.warnings, v.tracebacks, max((o for s in v.logs.values() for o in s.outages_s), default=0.0),
            r.duration_s, "; ".join(r.problems()) or "ok"]


def _report(cfg: CrawlConfig, runs: list[FaultRun]) -> dict[str, Any]:
    rows = [_row(r) for r in runs]
    failed = any(r.problems() for r in runs)
    by_fault: dict[str, list[FaultRun]] = {}
    for r in runs:
        by_fault.setdefault(r.fault, []).append(r)
    categories = list(by_fault)

    def worst(key: Callable[[FaultRun], float]) -> list[float | None]:
        return [max(key(r) for r in by_fault[c]) for c in categories]

    return {
        "title": TITLE,
        "summary": (
            f"{cfg.pages}-page site ({cfg.page_delay:g} s per page), {cfg.workers} workers of "
            f"{cfg.concurrency} concurrent requests, SCHEDULER_LEASE_SECONDS {cfg.lease:g}, socket_timeout "
            f"{cfg.socket_timeout:g} s; every worker, Redis and the site in a network namespace of its own. "
            f"Duplicate items counted honestly: EXACTLY_ONCE_ITEMS = {EXACTLY_ONCE_ITEMS}."
        ),
        "tables": [{
            "title": "Faults survived",
            "columns": ["fault", "pages never fetched", "items lost", "duplicate items", "duplicate fetches",
                        "bound", "faulted x (prefetch + in flight)", "leases held at fault",
                        "closed by itself",
                        "WARNING lines", "tracebacks", "longest outage logged (s)", "seconds",
                        "problems"],
            "rows": rows,
            "notes": [f"{f.name}: {f.title}" for f in FAULTS.values() if f.name in by_fault] + [
                "bound: the leases the faulted workers held when the fault struck, or their prefetch + in "
                "flight if that is more; a worker's leases also cover pages downloaded whose items wait for "
                "the pipeline's next batch, so they can exceed prefetch + in flight.",
            ],
        }],
        "charts": [{
            "title": "Re-work per fault (worst run)",
            "ylabel": "count",
            "categories": categories,
            "series": {
                "duplicate fetches": worst(lambda r: r.verdict.duplicate_fetches),
                "bound": worst(lambda r: r.verdict.duplicate_fetch_bound),
                "duplicate items": worst(lambda r: r.verdict.duplicate_items),
            },
        }],
        "notes": [] if _has_matplotlib() else ["chart skipped: matplotlib is not installed"],
        "data": {"runs": [{
            "fault": r.fault, "verdict": r.verdict.as_dict(), "duration_s": r.duration_s,
            "held_at_fault": r.held_at_fault, "info": r.info, "exit_codes": r.exit_codes,
            "problems": r.problems(),
        } for r in runs]},
        "failed": failed,
    }


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
