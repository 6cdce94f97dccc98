"""``scrapy-dist demo``: a distributed crawl of a generated local website with a worker killed half way,
shown live and judged by the site's record (:mod:`~scrapy_dist.demo.site`), not the crawler's."""

from __future__ import annotations

import contextlib
import secrets
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Column, Table
from rich.text import Text
from scrapy import Request
from scrapy.utils.request import RequestFingerprinter

from scrapy_dist.demo import site
from scrapy_dist.demo.site import SPIDER, Summary, summarize
from scrapy_dist.dupefilter import BloomDupeFilter
from scrapy_dist.extensions.clusterstats import RateMeter
from scrapy_dist.monitor import dead_reasons, read_status
from scrapy_dist.redis.connection import mask_url
from scrapy_dist.redis.embedded import EmbeddedRedis
from scrapy_dist.redis.keys import CrawlKeys

REFRESH = 0.25  #: Seconds between two refreshes of the live view ...
PLAIN_EVERY = 2.0  #: ... and between two plain progress lines when the output is not a terminal (CI, a pipe).
PLAIN_WIDTH = 100  #: output width when not a terminal, whatever ``COLUMNS`` says
DEMO_LEASE_SECONDS = 10.0  #: the workers' SCHEDULER_LEASE_SECONDS (``DemoOptions.lease_seconds``)
LOADING_TIMEOUT = 60.0  #: Seconds to wait for a Redis that is loading its data file.


def verdict(s: Summary) -> tuple[str, str]:
    """The last line of the summary and its style: OK, or what failed."""
    if s.ok:
        return "OK: nothing lost.", "bold green"
    failed = {f"{s.lost:,} pages lost": s.lost, f"{len(s.workers_failed)} workers failed": s.workers_failed,
              "timed out": s.timed_out}
    return "FAILED: " + "; ".join(reason for reason, bad in failed.items() if bad) + ".", "bold red"


def render_summary(s: Summary) -> Table:
    """The summary as a two-column table (plus notes) that reads the same on any terminal width."""
    table = Table(Column(style="bold", no_wrap=True), Column(justify="right", no_wrap=True),
                  Column(style="dim"), title="Summary", title_justify="left", show_header=False,
                  box=box.SIMPLE, padding=(0, 1))
    table.add_row("pages crawled", f"{s.crawled:,} of {s.ok_pages:,}",
                  f"site: {s.site_pages:,} pages, {s.missing} missing (404)")
    table.add_row(Text("lost (must be 0)", style="bold"),
                  Text(f"{s.lost:,}", style="bold green" if s.lost == 0 else "bold red"),
                  "existing pages never answered 200")
    table.add_row("duplicate fetches", f"{s.duplicates:,}", "done by a killed worker, not acknowledged")
    table.add_row("retried", f"{s.retried:,}", "flaky pages' 503s, retried via the frontier")
    reasons = ", ".join(f"{r}: {n}" for r, n in sorted(s.dead_reasons.items()))
    if reasons and s.missing:
        reasons += " (each missing page at least once)"
    table.add_row("dead letters", f"{s.dead_letters:,}", reasons)
    note = (f"last new page at {s.crawl_seconds:.1f} s ({s.crawled / s.crawl_seconds:,.0f} pages/s)"
            if s.crawl_seconds else "")
    table.add_row("elapsed", f"{s.elapsed:.1f} s", note)
    table.add_row("workers", f"{s.workers_started}",
                  f"{s.workers_killed} killed by chaos, {len(s.workers_failed)} failed")
    return table


@dataclass
class WorkerRow:
    """One row of the live view's workers table."""

    number: int
    pid: int
    state: str
    pages: int | None
    rate: float | None
    leases: int | None


@dataclass
class Snapshot:
    """Everything the live view shows at one moment."""

    elapsed: float
    crawled: int
    total: int
    rate: float
    retried: int
    duplicates: int
    queued: int | None = None
    inflight: int | None = None
    delayed: int | None = None
    dead_letters: int | None = None
    workers: list[WorkerRow] = field(default_factory=list)
    redis_error: str = ""
    orphaned: int = 0  #: leases the killed worker still holds in Redis ...
    orphaned_expire_in: float = 0.0  #: ... and seconds until they have surely run out


def _num(value: int | float | None, fmt: str = ",") -> str:
    return "-" if value is None else format(value, fmt)


def combined_rate(workers: list[WorkerRow], fallback: float) -> float:
    """The crawl-wide pages/s: the sum of the per-worker rates shown, else ``fallback`` (the site's)."""
    rates = [w.rate for w in workers if w.rate is not None]
    return sum(rates) if rates else fallback


def orphan_note(s: Snapshot) -> str:
    """Why the crawl seems to stand still after the chaos kill (the killed worker's ``orphaned`` leases)."""
    when = f"in {s.orphaned_expire_in:.0f} s" if s.orphaned_expire_in >= 0.5 else "now"
    return f"waiting for the killed worker's {s.orphaned:,} leases to expire: back in the queue {when}"


def render_live(s: Snapshot) -> Group:
    """The live view: progress bar, crawl-wide figures, one row per worker (about 75 columns wide)."""
    head = Table.grid(padding=(0, 1))
    head.add_row(ProgressBar(total=max(1, s.total), completed=s.crawled, width=36),
                 Text(f"{s.crawled:,} / {s.total:,} pages", style="bold"),
                 f"{s.crawled / max(1, s.total):4.0%}", Text(f"{s.elapsed:5.1f} s", style="dim"))
    figures = Text.assemble(
        (f"{s.rate:,.0f}", "bold"), " pages/s   queued ", (_num(s.queued), "bold"),
        "   in flight ", (_num(s.inflight), "bold"), "   delayed ", (_num(s.delayed), "bold"),
        "\nretried ", (f"{s.retried:,}", "bold"), "   duplicate fetches ", (f"{s.duplicates:,}", "bold"),
        "   dead letters ", (_num(s.dead_letters), "bold"))
    if s.orphaned:
        figures.append("\n" + orphan_note(s), style="yellow")
    if s.redis_error:
        figures.append(f"\nRedis: {s.redis_error}", style="red")
    workers = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    for name in ("worker", "pid", "state", "pages", "pages/s", "leases"):
        workers.add_column(name, justify="left" if name == "state" else "right", no_wrap=name == "state")
    styles = {"running": "green", "killed": "bold red", "failed": "bold red", "starting": "yellow"}
    for w in s.workers:
        workers.add_row(str(w.number), str(w.pid), Text(w.state, style=styles.get(w.state.split()[0], "dim")),
                        _num(w.pages), _num(w.rate, ",.0f"), _num(w.leases))
    return Group(head, figures, workers)


def progress_line(s: Snapshot) -> str:
    """The live view as one plain line, for output that is not a terminal."""
    running = sum(1 for w in s.workers if w.state in ("running", "starting"))
    orphans = f"  ({orphan_note(s)})" if s.orphaned else ""
    return (f"[{s.elapsed:6.1f}s] {s.crawled:,}/{s.total:,} pages ({s.crawled / max(1, s.total):.0%})"
            f"  {s.rate:,.0f} pages/s  queued {_num(s.queued)}  in flight {_num(s.inflight)}"
            f"  delayed {_num(s.delayed)}  retried {s.retried:,}  workers running {running}{orphans}")


class Interrupted(Exception):  # noqa: N818 - a signal, not an error
    """The demo got SIGINT (Ctrl-C) or SIGTERM; ``status`` is the exit status to end with."""

    def __init__(self, signum: int, elapsed: float = 0.0) -> None:
        super().__init__(signal.Signals(signum).name)
        self.status, self.elapsed = 128 + signum, elapsed


@dataclass
class DemoOptions:
    """What ``scrapy-dist demo`` was asked to do."""

    workers: int = 3
    pages: int = 5000
    chaos: bool = True
    timeout: float = 170.0
    lease_seconds: float = DEMO_LEASE_SECONDS  #: the workers' SCHEDULER_LEASE_SECONDS
    redis_url: str | None = None  #: ``--redis-url`` / ``$REDIS_URL``; ``None``: the project's embedded Redis
    redis_source: str = ""  #: where ``redis_url`` came from (``--redis-url``, ...), for the header
    run_dir: Path | None = None  #: for the worker logs; ``None``: a new temporary one


class Demo:
    """One demo run: site, workers, Redis client and keys, console; :meth:`run` returns the exit status."""

    def __init__(self, options: DemoOptions) -> None:
        self.options = options
        console = Console()
        self.console = console if console.is_terminal else Console(width=PLAIN_WIDTH)
        self.run_dir = options.run_dir or Path(tempfile.mkdtemp(prefix="scrapy-dist-demo-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.project, self.project_copied = site.locate_project(self.run_dir)
        self.graph = site.demo_graph(options.pages)
        self.site = site.SiteServer(self.graph, quiet=True)
        self.tally = site.SiteTally(self.site)
        self.prefix = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}:"
        self.keys = CrawlKeys(SPIDER, prefix=self.prefix)
        self.fleet = site.WorkerFleet(self.project, self.run_dir)  # configured by connect()
        self.embedded: EmbeddedRedis | None = None
        self.started_redis = self.stopped_redis = self._chaos_done = False
        self.redis_url = ""
        self.client: Any = None
        self._seeded_at: float | None = None
        self._rates: dict[int, Any] = {}
        self._live: Live | None = None
        self.lost_explained: list[str] = []  #: why lost pages were lost (set by summary())

    def connect(self) -> None:
        """Join the given Redis or the embedded one (RedisUnavailable if none answers); start the site."""
        self.client, self.redis_url, self.embedded, self.started_redis = site.open_redis(
            self.options.redis_url, self.project, LOADING_TIMEOUT)
        self.fleet.configure(self.prefix, self.embedded, self.redis_url)
        self.fleet.settings["SCHEDULER_LEASE_SECONDS"] = str(self.options.lease_seconds)
        self.site.start()

    def chaos(self, leases: Mapping[int, int]) -> None:
        """SIGKILL the running worker holding the most leases and start a fresh one."""
        victim = max(self.fleet.running(), key=lambda w: leases.get(w.pid, 0))
        self.fleet.kill(victim)
        held = f", holding {n} leased requests" if (n := leases.get(victim.pid)) else ""
        self.event(f"chaos: SIGKILL worker {victim.number} (pid {victim.pid}){held}: they go back to the"
                   " queue once their leases run out")
        fresh = self.fleet.start()
        self.event(f"started worker {fresh.number} (pid {fresh.pid}) in its place")

    def elapsed(self) -> float:
        return 0.0 if self._seeded_at is None else time.monotonic() - self._seeded_at

    def event(self, message: str) -> None:
        self.say(Text(f"[{self.elapsed():6.1f}s] {message}", style="bold"))

    def say(self, text: str | Text) -> None:
        """Print one line as it is (above the live view): the terminal wraps it, not rich."""
        console = self._live.console if self._live is not None else self.console
        console.print(text, soft_wrap=True, highlight=False)

    def snapshot(self) -> Snapshot:
        """Read the site's tally and the crawl's state in Redis (a few pipelined round trips)."""
        now = time.monotonic()
        self.tally.update()
        snap = Snapshot(elapsed=self.elapsed(), crawled=self.tally.crawled, total=self.graph.ok_pages,
                        rate=self.tally.pages_per_second(now), retried=self.tally.retried,
                        duplicates=self.tally.duplicates)
        rows: dict[int, dict[str, Any]] = {}
        try:
            status = read_status(self.client, self.keys)
        except (RedisError, OSError) as exc:
            snap.redis_error = f"{type(exc).__name__}: {exc}"
        else:
            front = status["frontier"]
            snap.queued, snap.inflight, snap.delayed = front["queued"], front["inflight"], front["delayed"]
            snap.dead_letters = status["deadletter"]
            rows = {r["pid"]: r for r in status["workers"] if r.get("pid")}
        snap.workers = [self._row(snap, w, rows.get(w.pid), now) for w in self.fleet.workers]
        snap.rate = combined_rate(snap.workers, snap.rate)
        return snap

    def _row(self, snap: Snapshot, w: site.Worker, row: dict[str, Any] | None, now: float) -> WorkerRow:
        """``w``'s row; a killed worker's leases count in ``snap`` as orphaned until they expire."""
        state = w.state
        pages = leases = rate = None
        if row is not None:
            pages, leases = row["pages"], row["leases"]
            meter = self._rates.setdefault(w.pid, RateMeter(span=site.RATE_WINDOW))  # as the site tally
            meter.add(float(pages), now)
            rate = meter.per_minute() / 60.0
            if state == "running" and row["state"] == "closed":
                state = "closing"
        elif state == "running":
            state = "starting"
        if w.state == "killed":  # its leases stay listed until they expire: the crawl waits for them
            state, rate = "killed (chaos)", None
            if leases and w.killed_at is not None:
                snap.orphaned += leases
                expire = w.killed_at + self.options.lease_seconds - now
                snap.orphaned_expire_in = max(snap.orphaned_expire_in, expire)
        elif w.state in ("exited", "failed", "stopped"):
            state, rate, leases = f"{w.state} ({w.returncode})", None, None
        return WorkerRow(w.number, w.pid, state, pages, rate, leases)

    def header(self) -> list[tuple[str, str]]:
        """What the demo runs, as (label, text) lines."""
        o, g = self.options, self.graph
        where = mask_url(self.redis_url) + (f" ({o.redis_source})" if o.redis_source else "")
        if self.embedded is not None:
            state = "started for the demo" if self.started_redis else "already running"
            where += f" (embedded, {state}; data in {self.embedded.directory})"
        copied = " (a copy of example_project's demo)" if self.project_copied else ""
        return [
            ("site", f"{self.site.url}: {g.pages:,} pages, {g.links} links each; {len(g.slow)} slow, "
                     f"{len(g.flaky)} flaky (503 twice), {len(g.missing)} missing (404)"),
            ("redis", where),
            ("workers", f"{o.workers} x `scrapy crawl {SPIDER}` in {self.project}{copied}"),
            ("logs", str(self.run_dir)),
            ("seed", f"LPUSH {self.keys.start_urls} {self.site.page_url(0)} (what redis-cli lpush does)"),
            ("chaos", "on: half way, the busiest worker is SIGKILLed and a fresh one started"
                      if o.chaos else "off"),
        ]

    def run(self) -> int:
        """Run the demo (after :meth:`connect`); the exit status (0 ok, 1 lost / failed, 128 + signal)."""
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in previous:
            signal.signal(s, self._interrupt)
        try:
            try:
                self.say(Text.assemble(("scrapy-dist demo", "bold"), ": a distributed crawl, live"))
                for label, text in self.header():
                    self.say(Text.assemble((f"  {label:<8} ", "bold"), text))
                for _ in range(self.options.workers):
                    w = self.fleet.start()
                    self.event(f"started worker {w.number} (pid {w.pid})")
                self.client.lpush(self.keys.start_urls, self.site.page_url(0))
                self._seeded_at = time.monotonic()
                timed_out = self.watch()
                self.fleet.reap()
                if timed_out:
                    self.event(f"timed out after {self.options.timeout:.0f} s: stopping the workers")
                    self.fleet.stop()
                summary = self.summary(timed_out)
            finally:
                # no second Ctrl-C half way through the clean-up: it is bounded (STOP_GRACE)
                for s in previous:
                    signal.signal(s, signal.SIG_IGN)
                self.shutdown()
        except Interrupted as exc:
            self.say(f"Interrupted ({exc}) after {exc.elapsed:.1f} s with {self.tally.crawled:,} of "
                     f"{self.graph.ok_pages:,} pages crawled: stopped the workers, the site"
                     + (" and the embedded Redis." if self.stopped_redis else "."))
            return exc.status
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        self.console.print(render_summary(summary))
        for line in [*self.lost_explained, *(f"failed: {failure}" for failure in summary.workers_failed)]:
            self.say(Text(line, style="red"))
        text, style = verdict(summary)
        self.say(Text.assemble((text, style), f" Worker logs: {self.run_dir}"))
        return 0 if summary.ok else 1

    def _interrupt(self, signum: int, _frame: Any) -> None:
        raise Interrupted(signum, self.elapsed())

    def watch(self) -> bool:
        """Show progress until every worker has exited; True if the timeout came first."""
        deadline = time.monotonic() + self.options.timeout
        next_line, last_figures = 0.0, ""
        self._live = Live(console=self.console, auto_refresh=False) if self.console.is_terminal else None
        try:
            with self._live or contextlib.nullcontext():
                while True:
                    self.fleet.reap()
                    snap = self.snapshot()
                    half = snap.crawled * 2 >= self.graph.ok_pages
                    if self.options.chaos and not self._chaos_done and half and self.fleet.running():
                        self._chaos_done = True
                        self.chaos({w.pid: w.leases or 0 for w in snap.workers})
                        snap = self.snapshot()
                    now = time.monotonic()
                    if self._live is not None:
                        self._live.update(render_live(snap), refresh=True)
                    else:
                        line = progress_line(snap)
                        figures = line.split("]", 1)[1]
                        # every PLAIN_EVERY seconds, and once at the end unless it would repeat the last
                        if now >= next_line or (not self.fleet.running() and figures != last_figures):
                            self.say(line)
                            next_line, last_figures = now + PLAIN_EVERY, figures
                    if not self.fleet.running():
                        return False
                    if now > deadline:
                        return True
                    time.sleep(REFRESH)
        finally:
            self._live = None

    def summary(self, timed_out: bool) -> Summary:
        """The summary of the finished run (reads the dead letters from Redis)."""
        self.tally.update()
        try:
            reasons = dead_reasons(self.client, self.keys, 0)
        except Exception as exc:  # the summary must come out even if Redis went away
            self.say(Text(f"Could not read the dead letters: {exc}", style="red"))
            reasons = Counter()
        last_new, seeded = self.tally.last_new, self._seeded_at
        crawl_seconds = max(0.0, last_new - seeded) if last_new is not None and seeded is not None else None
        workers = self.fleet.workers
        summary = summarize(self.graph, self.site.fetch_counts(200), self.site.fetch_counts(503), reasons,
                            elapsed=self.elapsed(), crawl_seconds=crawl_seconds, workers_started=len(workers),
                            workers_killed=sum(1 for w in workers if w.state == "killed"),
                            workers_failed=[w.describe_failure() for w in workers if w.state == "failed"],
                            timed_out=timed_out)
        self.lost_explained = (self.explain_lost(summary.lost_pages, summary.lost)
                               if summary.lost_pages else [])
        return summary

    def explain_lost(self, pages: list[int], total: int) -> list[str]:
        """One line per lost page: did the crawl's bloom filter take it for a page already seen (a false
        positive, never queued)? Reads the filter, so it must run before the run's keys are deleted."""
        urls = [self.site.page_url(i) for i in pages]
        claimed = [False] * len(urls)
        try:
            fields = ("capacity", "error_rate", "block_bits", "n")
            capacity, rate, bits, n = self.client.hmget(self.keys.bloom, fields)
            if capacity is not None:
                df = BloomDupeFilter(self.client, self.keys, RequestFingerprinter(), capacity=int(capacity),
                                     error_rate=float(rate), block_bits=int(bits))
                df.observe(int(n or 0))
                claimed = df.seen_tokens([df.tokens(Request(u)) for u in urls], add=False)
        except Exception as exc:  # an explanation, not the verdict: never fail the summary over it
            self.say(Text(f"Could not check the bloom filter: {exc}", style="red"))
        why = {True: "the crawl's bloom filter took it for a page already seen (a false positive: it was"
                     " never queued; see BLOOMFILTER_ERROR_RATE)",
               False: "never answered 200 and not in the bloom filter: see the worker logs"}
        lines = [f"lost: {url} -- {why[bloom]}" for url, bloom in zip(urls, claimed, strict=True)]
        if total > len(urls):
            lines.append(f"... and {total - len(urls):,} more lost pages")
        return lines

    def shutdown(self) -> None:
        """Stop everything the demo started: workers, site, this run's keys, an embedded Redis it started."""
        self.fleet.reap()
        self.fleet.stop()
        with contextlib.suppress(Exception):
            self.site.stop()
        self.stopped_redis = site.release_run(self.client, self.prefix, self.started_redis)
        if self.stopped_redis and self.embedded is not None:
            with contextlib.suppress(Exception):
                self.embedded.shutdown()
