"""``scrapy-dist demo``: a distributed crawl of a generated local website, with a worker killed half way.

What :class:`Demo` does, in order:

1. serves a generated site (:mod:`scrapy_dist.site`: a link graph with a few slow, flaky and missing pages)
   on 127.0.0.1, in a thread of this process, which records every answer it gives;
2. starts the workers: real ``scrapy crawl demo`` processes of ``example_project`` (its ``demo`` spider is a
   :class:`~scrapy_dist.spiders.RedisSpider`), each with its log file;
3. pushes the seed with ``LPUSH <prefix>demo:start_urls <url>``, exactly what ``redis-cli lpush`` does;
4. shows a live view (pages/s, the frontier's queued / in flight / delayed, one row per worker, a progress
   bar to the site's size); with chaos on, SIGKILLs the busiest worker once half the site is crawled and
   starts a fresh one;
5. once every worker has closed (they close together once the crawl has been idle a few seconds), prints
   the summary -- pages crawled, **lost** (pages that exist but were never answered 200: must be 0),
   duplicate fetches, retries, dead letters, elapsed -- and returns exit status 1 if anything was lost, a
   worker failed or the time ran out.

The truth comes from the site, not from the crawler: a page counts as crawled only if the site answered
it 200. Every run is a fresh crawl under its own key prefix (``demo-<time>-<random>:``), whose keys are
deleted at the end; an embedded Redis the demo had to start is stopped again.

Which project the workers run: ``example_project/`` next to the package (a source checkout installed with
``pip install -e .``), or the copy of it that the wheel carries as ``scrapy_dist/_example_project`` (hatch
``force-include`` in pyproject.toml), so there is one example project, never a second copy in code.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from scrapy_dist.connection import mask_url
from scrapy_dist.embedded import DEFAULT_DIRNAME, EmbeddedRedis
from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.keys import CrawlKeys
from scrapy_dist.site import SiteGraph, SiteServer

__all__ = [
    "Demo",
    "DemoOptions",
    "SiteTally",
    "Summary",
    "demo_graph",
    "locate_project",
    "summarize",
]

#: The spider every worker runs.
SPIDER = "demo"
#: ``example_project/`` of a source checkout: the repository root is the package's parent directory.
EXAMPLE_PROJECT = Path(__file__).resolve().parents[1] / "example_project"
#: Seconds between two refreshes of the live view (4 per second) ...
REFRESH = 0.25
#: ... and between two plain progress lines when the output is not a terminal (CI, a pipe).
PLAIN_EVERY = 2.0
#: Width of everything printed when the output is not a terminal, whatever ``COLUMNS`` says.
PLAIN_WIDTH = 100
#: SCHEDULER_LEASE_SECONDS of example_project's demo spider: how long a killed worker's leases outlive it.
DEMO_LEASE_SECONDS = 10.0

#: Seconds a stopped worker gets to close cleanly (give its leases back) before it is killed.
STOP_GRACE = 10.0
#: Seconds to wait for a Redis that is loading its data file.
LOADING_TIMEOUT = 60.0
#: Lost pages named (and explained) below the summary.
LOST_SHOWN = 10
#: Window of the crawl-wide pages/s figure (seconds).
RATE_WINDOW = 2.0

_PAGE = re.compile(r"/page/(\d+)$")


class Interrupted(Exception):  # noqa: N818 - a signal, not an error
    """The demo got SIGINT (Ctrl-C) or SIGTERM; ``status`` is the exit status to end with."""

    def __init__(self, signum: int, elapsed: float = 0.0) -> None:
        super().__init__(signal.Signals(signum).name)
        self.status = 128 + signum
        self.elapsed = elapsed


# -- the site ----------------------------------------------------------------------------------------
def demo_graph(pages: int, links: int = 10) -> SiteGraph:
    """The demo's site: ``pages`` pages, ``links`` links each, with 5 slow, 10 flaky (503 twice, then 200)
    and 10 missing (404) pages -- fewer on sites too small for that many (under 250 pages)."""
    return SiteGraph(
        pages,
        links=links,
        slow=min(5, pages // 50),
        flaky=min(10, pages // 25),
        missing=min(10, pages // 25),
    )


class SiteTally:
    """What the site has answered so far, read incrementally from :attr:`SiteServer.log` (append-only).

    Only ``/page/<i>`` answers count (not ``/robots.txt`` and the like).
    """

    def __init__(self, server: SiteServer, window: float = RATE_WINDOW) -> None:
        self.server = server
        self.window = window
        self.ok: set[int] = set()  #: pages answered 200 at least once
        self.duplicates = 0  #: 200 answers beyond the first for a page
        self.retried = 0  #: 503 answers (each one is retried)
        self.not_found = 0  #: 404 answers
        self.last_new: float | None = None  #: monotonic time of the latest page answered 200 the first time
        self._read = 0
        self._recent: deque[float] = deque()

    def update(self) -> None:
        """Take in the answers logged since the last call."""
        log = self.server.log
        new = log[self._read :]  # the handler threads only append; a slice is taken atomically
        self._read += len(new)
        for at, path, status in new:
            m = _PAGE.match(path)
            if m is None:
                continue
            self._recent.append(at)
            if status == 200:
                page = int(m.group(1))
                if page in self.ok:
                    self.duplicates += 1
                else:
                    self.ok.add(page)
                    self.last_new = at
            elif status == 503:
                self.retried += 1
            elif status == 404:
                self.not_found += 1

    @property
    def crawled(self) -> int:
        return len(self.ok)

    def pages_per_second(self, now: float) -> float:
        """Pages answered (any status) per second over the last ``window`` seconds."""
        while self._recent and self._recent[0] < now - self.window:
            self._recent.popleft()
        return len(self._recent) / self.window


def _quiet(server: SiteServer) -> None:
    """Keep the site from printing a traceback for every connection a killed worker leaves reset.

    socketserver prints one per failed request (``handle_error``); a SIGKILLed worker resets all its
    connections at once, which would scroll the live view away. (A workaround here: ``SiteServer`` has
    no option for it.)
    """
    httpd = getattr(server, "_httpd", None)
    if httpd is None:
        return
    default = httpd.handle_error

    def handle_error(request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            default(request, client_address)

    httpd.handle_error = handle_error


# -- the summary --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Summary:
    """The demo's verdict. ``lost`` must be 0."""

    site_pages: int
    ok_pages: int  #: pages that exist (answer 200 in the end)
    missing: int  #: pages that answer 404
    crawled: int  #: existing pages the site answered 200 at least once
    lost: int  #: existing pages never answered 200
    duplicates: int  #: 200 answers beyond the first per page (at-least-once delivery)
    retried: int  #: 503 answers (flaky pages), each retried through the frontier
    dead_letters: int  #: records in the crawl's dead-letter list
    dead_reasons: dict[str, int]  #: dead letters per reason
    elapsed: float  #: seconds from the seed push until every worker had closed
    crawl_seconds: float | None  #: seconds from the seed push until the last new page was answered
    workers_started: int
    workers_killed: int
    workers_failed: list[str]  #: "worker 2 (pid 123): exit status 1"
    timed_out: bool
    lost_pages: list[int] = field(default_factory=list)  #: the first :data:`LOST_SHOWN` lost pages

    @property
    def ok(self) -> bool:
        return self.lost == 0 and not self.workers_failed and not self.timed_out


def summarize(
    graph: SiteGraph,
    answers_200: Mapping[str, int],
    answers_503: Mapping[str, int],
    dead_reasons: Mapping[str, int],
    *,
    elapsed: float,
    crawl_seconds: float | None = None,
    workers_started: int = 0,
    workers_killed: int = 0,
    workers_failed: list[str] | None = None,
    timed_out: bool = False,
) -> Summary:
    """The summary from what the site answered (path -> count, e.g. ``SiteServer.fetch_counts(200)``) and
    the dead-letter reasons. Pure: no I/O."""
    ok_counts: Counter[int] = Counter()
    for path, n in answers_200.items():
        m = _PAGE.match(path)
        if m is not None and n > 0:
            ok_counts[int(m.group(1))] += n
    existing = [i for i in ok_counts if 0 <= i < graph.pages and i not in graph.missing]
    crawled = len(existing)
    lost_pages: list[int] = []
    if crawled < graph.ok_pages:
        lost_pages = [i for i in range(graph.pages) if i not in graph.missing and i not in ok_counts]
    retried = sum(n for path, n in answers_503.items() if _PAGE.match(path))
    return Summary(
        site_pages=graph.pages,
        ok_pages=graph.ok_pages,
        missing=len(graph.missing),
        crawled=crawled,
        lost=graph.ok_pages - crawled,
        duplicates=sum(n - 1 for n in ok_counts.values()),
        retried=retried,
        dead_letters=sum(dead_reasons.values()),
        dead_reasons=dict(dead_reasons),
        elapsed=elapsed,
        crawl_seconds=crawl_seconds,
        workers_started=workers_started,
        workers_killed=workers_killed,
        workers_failed=list(workers_failed or []),
        timed_out=timed_out,
        lost_pages=lost_pages[:LOST_SHOWN],
    )


def dead_letter_reasons(records: list[Any]) -> Counter[str]:
    """Count dead-letter records (JSON, as read from the list) per ``reason``; unreadable ones count as
    ``unreadable``."""
    out: Counter[str] = Counter()
    for raw in records:
        try:
            reason = json.loads(raw)["reason"]
        except (ValueError, TypeError, KeyError):
            reason = "unreadable"
        out[str(reason)] += 1
    return out


def render_summary(s: Summary) -> Table:
    """The summary as a two-column table (plus notes) that reads the same on any terminal width."""
    table = Table(title="Summary", title_justify="left", show_header=False, box=box.SIMPLE, padding=(0, 1))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(justify="right", no_wrap=True)
    table.add_column(style="dim")
    table.add_row(
        "pages crawled", f"{s.crawled:,} of {s.ok_pages:,}",
        f"site: {s.site_pages:,} pages, {s.missing} missing (404)",
    )
    table.add_row(
        Text("lost (must be 0)", style="bold"),
        Text(f"{s.lost:,}", style="bold green" if s.lost == 0 else "bold red"),
        "existing pages never answered 200",
    )
    table.add_row(
        "duplicate fetches", f"{s.duplicates:,}",
        "done by a killed worker, not acknowledged",
    )
    table.add_row(
        "retried", f"{s.retried:,}", "flaky pages' 503s, retried via the frontier"
    )
    reasons = ", ".join(f"{r}: {n}" for r, n in sorted(s.dead_reasons.items()))
    if reasons and s.missing:
        reasons += " (each missing page at least once)"
    table.add_row("dead letters", f"{s.dead_letters:,}", reasons)
    note = ""
    if s.crawl_seconds:
        note = f"last new page at {s.crawl_seconds:.1f} s ({s.crawled / s.crawl_seconds:,.0f} pages/s)"
    table.add_row("elapsed", f"{s.elapsed:.1f} s", note)
    table.add_row(
        "workers", f"{s.workers_started}",
        f"{s.workers_killed} killed by chaos, {len(s.workers_failed)} failed",
    )
    return table


# -- the project the workers run ----------------------------------------------------------------------
#: where a wheel carries example_project (pyproject.toml: tool.hatch.build.targets.wheel.force-include)
PACKAGED_PROJECT = Path(__file__).resolve().parent / "_example_project"


def _is_project(path: Path) -> bool:
    return (path / "scrapy.cfg").is_file() and (path / "example_project" / "spiders" / "demo.py").is_file()


_WORKER_SETTINGS_MODULE = "scrapy_dist_demo_worker_settings"
_WORKER_URL_VARIABLE = "SCRAPY_DIST_DEMO_REDIS_URL"


def _project_settings_module(project: Path) -> str:
    """The settings module named by the project's ``scrapy.cfg``."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(project / "scrapy.cfg")
    return cfg.get("settings", "default", fallback="example_project.settings")


def locate_project(run_dir: Path, example: Path | None = None) -> tuple[Path, bool]:
    """The project directory the workers run in, and whether it is the wheel's packaged copy.

    ``example_project/`` of the source checkout when it is there, else the copy inside the package.
    """
    example = EXAMPLE_PROJECT if example is None else example
    if _is_project(example):
        return example, False
    if _is_project(PACKAGED_PROJECT):
        return PACKAGED_PROJECT, True
    raise ScrapyDistError(f"example_project not found (looked in {example} and {PACKAGED_PROJECT})")


# -- workers -------------------------------------------------------------------------------------------
@dataclass
class Worker:
    """One ``scrapy crawl demo`` process started by the demo."""

    number: int
    proc: subprocess.Popen[bytes]
    log: Path
    state: str = "running"  #: running, killed, exited, failed, stopped
    exit_status: int | None = None
    killed_at: float | None = None  #: monotonic time of the chaos SIGKILL

    @property
    def pid(self) -> int:
        return self.proc.pid

    def describe_failure(self, lines: int = 8) -> str:
        """Which worker failed and how, with the end of its log."""
        try:
            tail = self.log.read_text(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            tail = []
        head = f"worker {self.number} (pid {self.pid}): exit status {self.exit_status}; log {self.log}"
        return "\n".join([head, *(f"    {line}" for line in tail)])


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
    queued: int | None
    inflight: int | None
    delayed: int | None
    dead_letters: int | None
    retried: int
    duplicates: int
    workers: list[WorkerRow] = field(default_factory=list)
    redis_error: str = ""
    #: leases the killed worker still holds in Redis, and seconds until they have surely run out
    orphaned: int = 0
    orphaned_expire_in: float = 0.0


def _num(value: int | float | None, fmt: str = ",") -> str:
    return "-" if value is None else format(value, fmt)


def combined_rate(workers: list[WorkerRow], fallback: float) -> float:
    """The crawl-wide pages/s: the sum of the per-worker rates shown (one source, so the two always
    agree); ``fallback`` (the site's count) before any worker has a rate."""
    rates = [w.rate for w in workers if w.rate is not None]
    return sum(rates) if rates else fallback


def orphan_note(s: Snapshot) -> str:
    """Why the crawl seems to stand still after the chaos kill: it waits for the killed worker's leases
    to run out (then any worker's next sync puts them back in the queue). ``""`` when nothing waits."""
    if not s.orphaned:
        return ""
    when = f"in {s.orphaned_expire_in:.0f} s" if s.orphaned_expire_in >= 0.5 else "now"
    return f"waiting for the killed worker's {s.orphaned:,} leases to expire: back in the queue {when}"


def render_live(s: Snapshot) -> Group:
    """The live view: progress bar, crawl-wide figures, one row per worker (about 75 columns wide)."""
    head = Table.grid(padding=(0, 1))
    head.add_row(
        ProgressBar(total=max(1, s.total), completed=s.crawled, width=36),
        Text(f"{s.crawled:,} / {s.total:,} pages", style="bold"),
        f"{s.crawled / max(1, s.total):4.0%}",
        Text(f"{s.elapsed:5.1f} s", style="dim"),
    )
    figures = Text.assemble(
        (f"{s.rate:,.0f}", "bold"), " pages/s   queued ", (_num(s.queued), "bold"),
        "   in flight ", (_num(s.inflight), "bold"), "   delayed ", (_num(s.delayed), "bold"),
        "\nretried ", (f"{s.retried:,}", "bold"), "   duplicate fetches ", (f"{s.duplicates:,}", "bold"),
        "   dead letters ", (_num(s.dead_letters), "bold"),
    )
    if s.orphaned:
        figures.append("\n" + orphan_note(s), style="yellow")
    if s.redis_error:
        figures.append(f"\nRedis: {s.redis_error}", style="red")
    workers = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    workers.add_column("worker", justify="right")
    workers.add_column("pid", justify="right")
    workers.add_column("state", no_wrap=True)
    workers.add_column("pages", justify="right")
    workers.add_column("pages/s", justify="right")
    workers.add_column("leases", justify="right")
    styles = {"running": "green", "killed": "bold red", "failed": "bold red", "starting": "yellow"}
    for w in s.workers:
        workers.add_row(
            str(w.number), str(w.pid), Text(w.state, style=styles.get(w.state.split()[0], "dim")),
            _num(w.pages), _num(w.rate, ",.0f"), _num(w.leases),
        )
    return Group(head, figures, workers)


def progress_line(s: Snapshot) -> str:
    """The live view as one plain line, for output that is not a terminal."""
    running = sum(1 for w in s.workers if w.state in ("running", "starting"))
    return (
        f"[{s.elapsed:6.1f}s] {s.crawled:,}/{s.total:,} pages ({s.crawled / max(1, s.total):.0%})"
        f"  {s.rate:,.0f} pages/s  queued {_num(s.queued)}  in flight {_num(s.inflight)}"
        f"  delayed {_num(s.delayed)}  retried {s.retried:,}  workers running {running}"
        + (f"  ({orphan_note(s)})" if s.orphaned else "")
    )


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
    """Runs one demo (see the module docstring). ``run()`` returns the exit status."""

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
        _quiet(self.site)
        self.tally = SiteTally(self.site)
        self.prefix = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}:"
        self.keys = CrawlKeys(SPIDER, prefix=self.prefix)
        self.workers: list[Worker] = []
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
        from redis.exceptions import BusyLoadingError, RedisError

        from scrapy_dist.connection import check_reachable, get_redis

        if self.options.redis_url:
            self.redis_url = self.options.redis_url
        else:
            # The directory every `scrapy crawl` in the project would use (REDIS_EMBEDDED_DIR unset).
            self.embedded = EmbeddedRedis(self.project / ".scrapy" / DEFAULT_DIRNAME)
            self.redis_url, self.started_redis = self.embedded.ensure_running()
        settings = {"REDIS_URL": self.redis_url}
        self.client = get_redis(settings)
        # A server that just started may still be loading its data file: PING answers LOADING until it is
        # done (EmbeddedRedis.ensure_running() returns as soon as it answers at all).
        deadline = time.monotonic() + LOADING_TIMEOUT
        while True:
            try:
                self.client.ping()
                break
            except BusyLoadingError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            except (RedisError, OSError):
                break
        try:
            check_reachable(self.client, settings)  # one line naming the URL if it does not answer
        except Exception:
            self.client.close()
            if self.started_redis and self.embedded is not None:
                self.embedded.shutdown()
            raise

    def worker_settings(self) -> dict[str, str]:
        """``-s`` settings of every worker: this run's key prefix and the demo's Redis."""
        # the demo site is on 127.0.0.1, which the default SCHEDULER_DENY_NETWORKS refuses
        out = {"REDIS_KEY_PREFIX": self.prefix, "SCHEDULER_DENY_NETWORKS": ""}
        if self.embedded is not None:
            # Point the workers at the embedded server by its directory rather than its URL, so its
            # password stays out of the process list; blank the other Redis settings so that a REDIS_URL
            # added to the project's settings.py cannot send the workers elsewhere.
            out.update({
                "REDIS_URL": "", "REDIS_HOST": "", "REDIS_PORT": "", "REDIS_SENTINELS": "",
                "REDIS_EMBEDDED_DIR": str(self.embedded.directory),
            })
        else:
            # The URL (and its password) reaches the workers by environment, never on the command line
            # (which every local user can read with `ps`): see worker_env().
            out.update({"REDIS_SENTINELS": ""})
        return out

    def worker_env(self) -> dict[str, str]:
        """Environment of every worker. With ``--redis-url`` the URL goes in ``SCRAPY_DIST_DEMO_REDIS_URL``
        (a process's environment is readable only by its user) and ``SCRAPY_SETTINGS_MODULE`` names a small
        settings module, written once into the run directory, that loads the project's settings and takes
        ``REDIS_URL`` from that variable."""
        env = {k: v for k, v in os.environ.items() if k not in ("SCRAPY_SETTINGS_MODULE", "SCRAPY_PROJECT")}
        if self.embedded is not None:
            return env
        module_dir = self.run_dir / "worker-settings"
        module_dir.mkdir(mode=0o700, exist_ok=True)
        base = _project_settings_module(self.project)
        (module_dir / f"{_WORKER_SETTINGS_MODULE}.py").write_text(
            f"import os\n\nfrom {base} import *  # noqa: F403\n\n"
            f'REDIS_URL = os.environ["{_WORKER_URL_VARIABLE}"]\nREDIS_HOST = REDIS_PORT = None\n'
        )
        env[_WORKER_URL_VARIABLE] = self.redis_url
        env["SCRAPY_SETTINGS_MODULE"] = _WORKER_SETTINGS_MODULE
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(module_dir), str(self.project), os.environ.get("PYTHONPATH", "")) if p
        )
        return env

    # -- processes -----------------------------------------------------------------------------------
    def start_worker(self) -> Worker:
        """Start one ``scrapy crawl demo`` in the project, its output going to ``worker-<n>.log``."""
        number = len(self.workers) + 1
        cmd = [sys.executable, "-m", "scrapy", "crawl", SPIDER]
        for name, value in self.worker_settings().items():
            cmd += ["-s", f"{name}={value}"]
        env = self.worker_env()
        log = self.run_dir / f"worker-{number}.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                cmd, cwd=self.project, env=env, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                # Own process group: Ctrl-C in the terminal reaches the demo only, which then stops the
                # workers itself (gracefully, then for good).
                start_new_session=True,
            )
        worker = Worker(number, proc, log)
        self.workers.append(worker)
        return worker

    def reap(self) -> None:
        """Note the workers that exited."""
        for w in self.workers:
            if w.state == "running" and w.proc.poll() is not None:
                w.exit_status = w.proc.returncode
                w.state = "exited" if w.exit_status == 0 else "failed"

    def running(self) -> list[Worker]:
        return [w for w in self.workers if w.state == "running"]

    def stop_workers(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM the running workers (Scrapy closes cleanly and gives its leases back), SIGKILL them
        after ``grace`` seconds."""
        alive = self.running()
        for w in alive:
            with contextlib.suppress(ProcessLookupError):
                w.proc.terminate()
        deadline = time.monotonic() + grace
        for w in alive:
            try:
                w.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            w.exit_status = w.proc.returncode
            w.state = "stopped"

    # -- chaos ---------------------------------------------------------------------------------------
    def chaos(self, leases: Mapping[int, int]) -> None:
        """SIGKILL the running worker holding the most leases and start a fresh one."""
        candidates = self.running()
        if not candidates:
            return
        victim = max(candidates, key=lambda w: leases.get(w.pid, 0))
        victim.proc.kill()
        victim.proc.wait()
        victim.state = "killed"
        victim.killed_at = time.monotonic()
        victim.exit_status = victim.proc.returncode
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

        from scrapy_dist.extensions.workers import RateMeter
        from scrapy_dist.status import read_status

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
        for w in self.workers:
            row = rows.get(w.pid)
            state = w.state
            pages = leases = None
            rate = None
            if row is not None:
                pages, leases = row["pages"], row["leases"]
                meter = self._rates.setdefault(w.pid, RateMeter(span=RATE_WINDOW))  # as the site tally
                meter.add(float(pages), now)
                rate = meter.per_minute() / 60.0
                if state == "running" and row["state"] == "closed":
                    state = "closing"
            elif state == "running":
                state = "starting"
            if w.state == "killed":
                # its leases stay listed until they expire: the crawl waits for them (see orphan_note)
                state, rate = "killed (chaos)", None
                if leases and w.killed_at is not None:
                    snap.orphaned += leases
                    snap.orphaned_expire_in = max(
                        snap.orphaned_expire_in, w.killed_at + DEMO_LEASE_SECONDS - now)
            elif w.state in ("exited", "failed", "stopped"):
                state, rate, leases = f"{w.state} ({w.exit_status})", None, None
            snap.workers.append(WorkerRow(w.number, w.pid, state, pages, rate, leases))
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
                    self.stop_workers()
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
        verdict = "OK: nothing lost." if summary.ok else "FAILED: " + "; ".join(
            reason for reason, bad in (
                (f"{summary.lost:,} pages lost", summary.lost),
                (f"{len(summary.workers_failed)} workers failed", summary.workers_failed),
                ("timed out", summary.timed_out),
            ) if bad
        ) + "."
        style = "bold green" if summary.ok else "bold red"
        self.say(Text.assemble((verdict, style), f" Worker logs: {self.run_dir}"))
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
            claimed = self.bloom_claims(urls)
        except Exception as exc:  # an explanation, not the verdict: never fail the summary over it
            claimed = None
            self.say(Text(f"Could not check the bloom filter: {exc}", style="red"))
        lines = []
        for i, url in enumerate(urls):
            if claimed is not None and claimed[i]:
                why = ("the crawl's bloom filter took it for a page already seen (a false positive:"
                       " it was never queued; see BLOOMFILTER_ERROR_RATE)")
            else:
                why = "never answered 200 and not in the bloom filter: see the worker logs"
            lines.append(f"lost: {url} -- {why}")
        if total > len(urls):
            lines.append(f"... and {total - len(urls):,} more lost pages")
        return lines

    def bloom_claims(self, urls: list[str]) -> list[bool] | None:
        """Whether the crawl's bloom filter holds each URL (no writes), or ``None`` if the crawl has no
        bloom filter. Fingerprints as the workers make them (Scrapy's default fingerprinter)."""
        from scrapy import Request
        from scrapy.utils.request import RequestFingerprinter

        from scrapy_dist.dupefilter import BloomDupeFilter

        capacity, error_rate, block_bits, n = self.client.hmget(
            self.keys.bloom, ["capacity", "error_rate", "block_bits", "n"]
        )
        if capacity is None:
            return None
        df = BloomDupeFilter(
            self.client, self.keys, RequestFingerprinter(),
            capacity=int(capacity), error_rate=float(error_rate), block_bits=int(block_bits),
        )
        df.observe(int(n or 0))
        return df.seen_tokens([df.tokens(Request(u)) for u in urls], add=False)

    def shutdown(self) -> None:
        """Stop everything the demo started: workers, site, this run's keys, an embedded Redis it started."""
        self.reap()
        self.stop_workers()
        if self._site_started:  # SiteServer.stop() waits for a serving loop that never started otherwise
            with contextlib.suppress(Exception):
                self.site.stop()
        stop_redis = self.started_redis
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.delete_keys()
            if stop_redis:
                # Another demo (or crawl) of the project may have joined the server meanwhile: keep it up.
                with contextlib.suppress(Exception):
                    stop_redis = not self.others_connected()
            if stop_redis:
                with contextlib.suppress(Exception):
                    self.compact()
            with contextlib.suppress(Exception):
                self.client.close()
        if stop_redis and self.embedded is not None:
            with contextlib.suppress(Exception):
                self.embedded.shutdown()
        self.stopped_redis = stop_redis

    def others_connected(self) -> bool:
        """Whether clients other than this process's are connected to the Redis (two round trips)."""
        me = self.client.client_id()
        return any(int(c.get("id", me)) != me for c in self.client.client_list())

    def compact(self, timeout: float = 10.0) -> None:
        """Rewrite the embedded server's append-only file before stopping it: every run writes (and then
        deletes) tens of thousands of entries, which the file would otherwise keep -- and replay at every
        start -- until it reaches Redis's 64 MB rewrite threshold."""
        self.client.bgrewriteaof()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.client.info("persistence")
            if not info.get("aof_rewrite_in_progress") and not info.get("aof_rewrite_scheduled"):
                return
            time.sleep(0.05)

    def delete_keys(self) -> int:
        """Delete this run's keys (every key holding its unique prefix). Returns how many."""
        batch: list[Any] = []
        deleted = 0
        for key in self.client.scan_iter(match=f"*{self.prefix}*", count=1000):
            batch.append(key)
            if len(batch) >= 500:
                deleted += self.client.delete(*batch)
                batch = []
        if batch:
            deleted += self.client.delete(*batch)
        return deleted


def run_demo(options: DemoOptions, console: Console | None = None) -> int:
    """Run ``scrapy-dist demo`` with ``options``; returns the exit status."""
    return Demo(options, console).run()

