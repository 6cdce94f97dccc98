"""``scrapy-dist demo``: a distributed crawl of a generated local website, with a worker killed half way
(what it shows and what its summary means: docs/quickstart.md, "Watch the demo").

:class:`Demo` serves the site (:mod:`~scrapy_dist.demo.site`, in a thread that records every answer),
starts the workers (:mod:`~scrapy_dist.demo.site`: real ``scrapy crawl demo`` processes of
``example_project``, from the checkout or the wheel's ``scrapy_dist/_example_project`` copy), pushes the
seed, shows the live view and summary (:mod:`scrapy_dist.demo`), and judges the run by the site's
record (:mod:`~scrapy_dist.demo.site`), not the crawler's. Each run has its own key prefix, deleted at
the end.
"""

from __future__ import annotations

import contextlib
import secrets
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.text import Text

from scrapy_dist.demo import (
    Snapshot,
    Summary,
    WorkerRow,
    bloom_claims,
    combined_rate,
    dead_letter_reasons,
    lost_lines,
    open_redis,
    progress_line,
    release_run,
    render_live,
    render_summary,
    summarize,
    verdict,
)
from scrapy_dist.demo.site import (
    EXAMPLE_PROJECT,
    SPIDER,
    SiteServer,
    SiteTally,
    Worker,
    WorkerFleet,
    demo_graph,
    fleet_rows,
    locate_project,
    quiet,
    worker_env,
    worker_settings,
)
from scrapy_dist.redis.connection import mask_url
from scrapy_dist.redis.embedded import EmbeddedRedis
from scrapy_dist.redis.keys import CrawlKeys

__all__ = [
    "EXAMPLE_PROJECT",
    "Demo",
    "DemoOptions",
    "SiteTally",
    "Summary",
    "demo_graph",
    "locate_project",
    "summarize",
    # from scrapy_dist.demo, imported from here by the tests
    "Snapshot",
    "WorkerRow",
    "combined_rate",
    "progress_line",
    "render_live",
    "render_summary",
]
#: Seconds between two refreshes of the live view (4 per second) ...
REFRESH = 0.25
#: ... and between two plain progress lines when the output is not a terminal (CI, a pipe).
PLAIN_EVERY = 2.0
#: Width of everything printed when the output is not a terminal, whatever ``COLUMNS`` says.
PLAIN_WIDTH = 100
#: SCHEDULER_LEASE_SECONDS of example_project's demo spider: how long a killed worker's leases outlive it.
DEMO_LEASE_SECONDS = 10.0
#: Seconds to wait for a Redis that is loading its data file.
LOADING_TIMEOUT = 60.0


class Interrupted(Exception):  # noqa: N818 - a signal, not an error
    """The demo got SIGINT (Ctrl-C) or SIGTERM; ``status`` is the exit status to end with."""

    def __init__(self, signum: int, elapsed: float = 0.0) -> None:
        super().__init__(signal.Signals(signum).name)
        self.status = 128 + signum
        self.elapsed = elapsed


# -- the demo ------------------------------------------------------------------------------------------
@dataclass
class DemoOptions:
    """What ``scrapy-dist demo`` was asked to do."""

    workers: int = 3
    pages: int = 5000
    chaos: bool = True
    timeout: float = 170.0
    #: the Redis to use (``--redis-url`` / ``$REDIS_URL``); ``None``: the project's embedded Redis
    redis_url: str | None = None
    #: where ``redis_url`` came from, for the header (``--redis-url``, ...)
    redis_source: str = ""
    #: where the worker logs (and, if needed, the project copy) go; ``None``: a new temporary directory
    run_dir: Path | None = None


class Demo:
    """Runs one demo (see the module docstring) over the state every step shares (site, workers, client,
    keys, console). ``run()`` returns the exit status."""

    def __init__(self, options: DemoOptions, console: Console | None = None) -> None:
        self.options = options
        if console is None:
            console = Console()
            if not console.is_terminal:
                console = Console(width=PLAIN_WIDTH)
        self.console = console
        self.run_dir = options.run_dir or Path(tempfile.mkdtemp(prefix="scrapy-dist-demo-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.project, self.project_copied = locate_project(self.run_dir)
        self.graph = demo_graph(options.pages)
        self.site = SiteServer(self.graph, slow_delay=1.0, flaky_failures=2)
        quiet(self.site)
        self.tally = SiteTally(self.site)
        self.prefix = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}:"
        self.keys = CrawlKeys(SPIDER, prefix=self.prefix)
        self.fleet: WorkerFleet | None = None
        self.embedded: EmbeddedRedis | None = None
        self.started_redis = False
        self.stopped_redis = False
        self.redis_url = ""
        self.client: Any = None
        self._seeded_at: float | None = None
        self._chaos_done = False
        self._rates: dict[int, Any] = {}
        self._live: Live | None = None
        self.lost_explained: list[str] = []
        self._site_started = False

    # -- Redis ---------------------------------------------------------------------------------------
    def connect(self) -> None:
        """Reach the given Redis, or join (start if needed) the project's embedded one.

        Raises :class:`~scrapy_dist.exceptions.RedisUnavailable` (one line) if that fails.
        """
        self.client, self.redis_url, self.embedded, self.started_redis = open_redis(
            self.options.redis_url, self.project, LOADING_TIMEOUT)

    @property
    def workers(self) -> list[Worker]:
        return [] if self.fleet is None else self.fleet.workers

    def running(self) -> list[Worker]:
        return [] if self.fleet is None else self.fleet.running()

    def start_worker(self) -> Worker:
        """Start one more worker (the first call fixes every worker's settings and environment)."""
        if self.fleet is None:
            embedded_dir = None if self.embedded is None else self.embedded.directory
            self.fleet = WorkerFleet(
                self.project, self.run_dir, worker_settings(self.prefix, embedded_dir),
                worker_env(self.project, self.run_dir, None if self.embedded is not None else self.redis_url),
            )
        return self.fleet.start()

    def reap(self) -> None:
        if self.fleet is not None:
            self.fleet.reap()

    def _stop_workers(self) -> None:
        if self.fleet is not None:
            self.fleet.stop()

    # -- chaos ---------------------------------------------------------------------------------------
    def chaos(self, leases: Mapping[int, int]) -> None:
        """SIGKILL the running worker holding the most leases and start a fresh one."""
        candidates = self.running()
        if not candidates:
            return
        victim = max(candidates, key=lambda w: leases.get(w.pid, 0))
        assert self.fleet is not None  # there are running workers
        self.fleet.kill(victim)
        held = leases.get(victim.pid)
        self.event(
            f"chaos: SIGKILL worker {victim.number} (pid {victim.pid})"
            + (f", holding {held} leased requests" if held else "")
            + ": they go back to the queue once their leases run out"
        )
        fresh = self.start_worker()
        self.event(f"started worker {fresh.number} (pid {fresh.pid}) in its place")

    # -- output --------------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return 0.0 if self._seeded_at is None else time.monotonic() - self._seeded_at

    def event(self, message: str) -> None:
        """Print a line above the live view (or between the progress lines)."""
        self.say(Text(f"[{self.elapsed():6.1f}s] {message}", style="bold"))

    def snapshot(self) -> Snapshot:
        """Read the site's tally and the crawl's state in Redis (a few pipelined round trips)."""
        from redis.exceptions import RedisError

        from scrapy_dist.monitor import read_status

        now = time.monotonic()
        self.tally.update()
        snap = Snapshot(
            elapsed=self.elapsed(), crawled=self.tally.crawled, total=self.graph.ok_pages,
            rate=self.tally.pages_per_second(now), queued=None, inflight=None, delayed=None,
            dead_letters=None, retried=self.tally.retried, duplicates=self.tally.duplicates,
        )
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
        fleet_rows(snap, self.workers, rows, self._rates, now, DEMO_LEASE_SECONDS)
        snap.rate = combined_rate(snap.workers, snap.rate)
        return snap

    def header(self) -> list[tuple[str, str]]:
        """What the demo runs, as (label, text) lines."""
        o, g = self.options, self.graph
        where = mask_url(self.redis_url)
        if o.redis_source:
            where += f" ({o.redis_source})"
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

    def say(self, text: str | Text) -> None:
        """Print one line as it is: the terminal wraps it, not rich (so no width is assumed)."""
        console = self._live.console if self._live is not None else self.console
        console.print(text, soft_wrap=True, highlight=False)

    # -- the run -------------------------------------------------------------------------------------
    def run(self) -> int:
        """Run the demo to its summary; the exit status (0 ok, 1 something lost / failed / timed out,
        128 + signal number when interrupted)."""
        if self.client is None:
            self.connect()
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

        def interrupt(signum: int, _frame: Any) -> None:
            raise Interrupted(signum, self.elapsed())

        for s in previous:
            signal.signal(s, interrupt)
        summary: Summary | None = None
        try:
            try:
                self.site.start()
                self._site_started = True
                self.say(Text.assemble(("scrapy-dist demo", "bold"), ": a distributed crawl, live"))
                for label, text in self.header():
                    self.say(Text.assemble((f"  {label:<8} ", "bold"), text))
                for _ in range(self.options.workers):
                    w = self.start_worker()
                    self.event(f"started worker {w.number} (pid {w.pid})")
                self.client.lpush(self.keys.start_urls, self.site.page_url(0))
                self._seeded_at = time.monotonic()
                timed_out = self.watch()
                self.reap()
                if timed_out:
                    self.event(f"timed out after {self.options.timeout:.0f} s: stopping the workers")
                    self._stop_workers()
                summary = self.summary(timed_out)
            finally:
                # no second Ctrl-C half way through the clean-up: it is bounded (STOP_GRACE)
                for s in previous:
                    signal.signal(s, signal.SIG_IGN)
                self.shutdown()
        except Interrupted as exc:
            self.say(
                f"Interrupted ({exc}) after {exc.elapsed:.1f} s with {self.tally.crawled:,} of "
                f"{self.graph.ok_pages:,} pages crawled: stopped the workers, the site"
                + (" and the embedded Redis." if self.stopped_redis else ".")
            )
            return exc.status
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        self.console.print(render_summary(summary))
        for line in self.lost_explained:
            self.say(Text(line, style="red"))
        for failure in summary.workers_failed:
            self.say(Text(f"failed: {failure}", style="red"))
        text, style = verdict(summary)
        self.say(Text.assemble((text, style), f" Worker logs: {self.run_dir}"))
        return 0 if summary.ok else 1

    def watch(self) -> bool:
        """Show progress until every worker has exited; True if the timeout came first."""
        deadline = time.monotonic() + self.options.timeout
        live_mode = self.console.is_terminal
        next_line = 0.0
        last_figures = ""
        context: contextlib.AbstractContextManager[Any]
        if live_mode:
            self._live = Live(console=self.console, auto_refresh=False, transient=False)
            context = self._live
        else:
            context = contextlib.nullcontext()
        try:
            with context:
                while True:
                    self.reap()
                    snap = self.snapshot()
                    if (
                        self.options.chaos and not self._chaos_done
                        and snap.crawled * 2 >= self.graph.ok_pages and self.running()
                    ):
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
                        if now >= next_line or (not self.running() and figures != last_figures):
                            self.say(line)
                            next_line, last_figures = now + PLAIN_EVERY, figures
                    if not self.running():
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
            reasons = dead_letter_reasons(self.client.lrange(self.keys.deadletter, 0, -1))
        except Exception as exc:  # the summary must come out even if Redis went away
            self.say(Text(f"Could not read the dead letters: {exc}", style="red"))
            reasons = Counter()
        crawl_seconds = None
        if self.tally.last_new is not None and self._seeded_at is not None:
            crawl_seconds = max(0.0, self.tally.last_new - self._seeded_at)
        failed = [w.describe_failure() for w in self.workers if w.state == "failed"]
        summary = summarize(
            self.graph, self.site.fetch_counts(200), self.site.fetch_counts(503), reasons,
            elapsed=self.elapsed(), crawl_seconds=crawl_seconds, workers_started=len(self.workers),
            workers_killed=sum(1 for w in self.workers if w.state == "killed"), workers_failed=failed,
            timed_out=timed_out,
        )
        if summary.lost_pages:
            self.lost_explained = self.explain_lost(summary.lost_pages, summary.lost)
        return summary

    def explain_lost(self, pages: list[int], total: int) -> list[str]:
        """One line per lost page: did the crawl's bloom filter take it for a page already seen (a false
        positive, so it was never queued)? Must run before the run's keys are deleted."""
        urls = [self.site.page_url(i) for i in pages]
        try:
            claimed = bloom_claims(self.client, self.keys, urls)
        except Exception as exc:  # an explanation, not the verdict: never fail the summary over it
            claimed = None
            self.say(Text(f"Could not check the bloom filter: {exc}", style="red"))
        return lost_lines(urls, claimed, total)

    def shutdown(self) -> None:
        """Stop everything the demo started: workers, site, this run's keys, an embedded Redis it started."""
        self.reap()
        self._stop_workers()
        if self._site_started:  # SiteServer.stop() waits for a serving loop that never started otherwise
            with contextlib.suppress(Exception):
                self.site.stop()
        stop_redis = self.started_redis
        if self.client is not None:
            stop_redis = release_run(self.client, self.prefix, self.started_redis)
        if stop_redis and self.embedded is not None:
            with contextlib.suppress(Exception):
                self.embedded.shutdown()
        self.stopped_redis = stop_redis
