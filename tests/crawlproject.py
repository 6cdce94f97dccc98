"""Write a small Scrapy project into a directory and run real ``scrapy crawl`` processes of it.

Used by the end-to-end tests: ``make_project(tmp_path, settings={...})`` returns a :class:`Project` whose
``crawl()`` starts ``scrapy crawl <spider>`` as a process of its own with the given settings (``-s``) and
returns its ``Popen`` (or the same face of a worker forked from a pre-imported interpreter: tests/zygote.py);
its stdout/stderr go to a log file per process, kept for assertions.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import psutil
from helpers import wait_for_pages
from zygote import Zygote

from scrapy_dist.frontier.shard import SEQ_BYTES, lease_parts
from scrapy_dist.wire.codec import load_payload

SPIDERS = '''
import json
import scrapy


class LinkSpider(scrapy.Spider):
    """Follows every link from the seed page(s); one item per page."""

    name = "links"

    def __init__(self, seed=None, seeds=None, **kw):
        super().__init__(**kw)
        self.seeds = [seed] if seed else (seeds.split(",") if seeds else [])

    async def start(self):
        for url in self.seeds:
            yield scrapy.Request(url)

    def parse(self, response):
        yield {"url": response.url}
        for href in response.css("a::attr(href)").getall():
            yield response.follow(href)


class NoFollowSpider(scrapy.Spider):
    """Crawls only what is in the frontier (requests put there by a test)."""

    name = "nofollow"

    async def start(self):
        return
        yield

    def parse(self, response):
        yield {"url": response.url, "via": "parse"}

    def parse_other(self, response):
        yield {"url": response.url, "via": "parse_other"}
'''


#: The generated project's sitecustomize.py (imported by every worker at start-up: the project's root is on
#: its PYTHONPATH): on SIGUSR1 a worker writes where it is -- every thread's stack, and the stack of every
#: asyncio task (a hang at close is a task awaiting something, invisible in the threads' stacks).
HANG_DUMP = '''
import asyncio
import faulthandler
import signal
import sys


def _dump(signum, frame):
    print("=== SIGUSR1: threads ===", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(all_threads=True)
    loop = asyncio._get_running_loop()
    print("=== asyncio tasks ===", file=sys.stderr)
    for task in asyncio.all_tasks(loop) if loop is not None else ():
        task.print_stack(limit=12, file=sys.stderr)
    sys.stderr.flush()


signal.signal(signal.SIGUSR1, _dump)
'''


class Project:
    def __init__(self, root: Path, settings: dict[str, Any]) -> None:
        self.root = root
        self.settings = settings
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def crawl(
        self,
        spider: str = "links",
        args: dict[str, str] | None = None,
        settings: dict[str, Any] | None = None,
    ) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "scrapy", "crawl", spider]
        for k, v in {**self.settings, **(settings or {})}.items():
            cmd += ["-s", f"{k}={json.dumps(v) if isinstance(v, (dict, list)) else v}"]
        for k, v in (args or {}).items():
            cmd += ["-a", f"{k}={v}"]
        log = self.root / f"worker-{len(self.procs)}.log"
        env = {**os.environ, "PYTHONPATH": str(self.root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        env.pop("REDIS_URL", None)
        env.pop("SCRAPY_SETTINGS_MODULE", None)  # a test that read other project settings may have set it
        with open(log, "wb") as fh:
            if Zygote.enabled():
                proc: Any = Zygote.start(cmd[3:], self.root, env, fh.fileno())
            else:
                proc = subprocess.Popen(cmd, cwd=self.root, stdout=fh, stderr=subprocess.STDOUT, env=env)
        self.procs.append((proc, log))
        return proc

    def wait_all(self, timeout: float = 120) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for proc, log in self.procs:
            try:
                codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.dump_stacks(proc)
                raise AssertionError(
                    f"worker did not finish in time; log:\n{self.log_text(log)[-8000:]}"
                ) from None
        return codes

    @staticmethod
    def dump_stacks(proc: subprocess.Popen[bytes]) -> None:
        """End a worker that hangs so that its log says where: SIGUSR1 makes it write its threads' stacks
        and its asyncio tasks' stacks to its log (see ``HANG_DUMP``), then it is killed."""
        proc.send_signal(signal.SIGUSR1)
        try:
            proc.wait(2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def wait_until_open(self, timeout: float = 60) -> None:
        """Until every started worker has opened the scrapy-dist frontier (so it is crawling, past the
        start-up check that exits when Redis is unreachable)."""
        deadline = time.monotonic() + timeout
        for proc, log in self.procs:
            while "open as worker" not in self.log_text(log):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"worker did not open; log:\n{self.log_text(log)[-3000:]}")
                time.sleep(0.05)

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def stop_all(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    @staticmethod
    def log_text(log: Path) -> str:
        return log.read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"--- {log.name}\n{self.log_text(log)}" for _, log in self.procs)

    def stats(self, index: int) -> dict[str, Any]:
        path = self.root / f"stats-{self.procs[index][0].pid}.json"
        return json.loads(path.read_text()) if path.exists() else {}


STATS_EXT = '''
import json, os
from scrapy import signals


class DumpStats:
    """Writes the final stats of the process to stats-<pid>.json (for assertions)."""

    def __init__(self, crawler):
        self.crawler = crawler
        crawler.signals.connect(self.closed, signal=signals.spider_closed)

    @classmethod
    def from_crawler(cls, crawler):
        return cls(crawler)

    def closed(self, spider, reason):
        stats = {k: (v if isinstance(v, (int, float, str)) else str(v))
                 for k, v in self.crawler.stats.get_stats().items()}
        stats["finish_reason"] = reason
        with open(f"stats-{os.getpid()}.json", "w") as fh:
            json.dump(stats, fh)
'''


def make_project(root: Path, settings: dict[str, Any] | None = None, spiders: str = SPIDERS) -> Project:
    """A Scrapy project in ``root`` whose settings are Scrapy's plus ``settings`` (given with -s)."""
    pkg = root / "proj"
    (pkg / "spiders").mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "spiders" / "__init__.py").write_text("")
    (pkg / "spiders" / "test_spiders.py").write_text(textwrap.dedent(spiders))
    (pkg / "stats_ext.py").write_text(STATS_EXT)
    (pkg / "settings.py").write_text(
        textwrap.dedent(
            """
            BOT_NAME = "proj"
            SPIDER_MODULES = ["proj.spiders"]
            ROBOTSTXT_OBEY = False
            LOG_LEVEL = "INFO"
            TELNETCONSOLE_ENABLED = False
            EXTENSIONS = {"proj.stats_ext.DumpStats": 0}
            REQUEST_FINGERPRINTER_IMPLEMENTATION = "2.7"
            # Scrapy starts CONCURRENT_ITEMS tasks for every response's output, whatever its size: the
            # default 100 is most of a test page's CPU, and a test page yields a dozen items and requests
            CONCURRENT_ITEMS = 16
            # the tests crawl sites on 127.0.0.1, which the default SCHEDULER_DENY_NETWORKS refuses
            SCHEDULER_DENY_NETWORKS = []
            """
        )
    )
    (root / "sitecustomize.py").write_text(HANG_DUMP)
    (root / "scrapy.cfg").write_text("[settings]\ndefault = proj.settings\n")
    base = {
        "SCHEDULER": "scrapy_dist.scheduler.Scheduler",
        "DUPEFILTER_CLASS": "scrapy_dist.dupefilter.BloomDupeFilter",
        "BLOOMFILTER_CAPACITY": 100000,
        "CONCURRENT_REQUESTS": 16,
        "SCHEDULER_IDLE_BEFORE_CLOSE": 1,
    }
    return Project(root, {**base, **(settings or {})})


def log_problems(log: str) -> list[str]:
    """Lines of a crawl's logs that show something went wrong: errors, tracebacks, cross-slot calls."""
    return [line for line in log.splitlines() if re.search(r"ERROR|CRITICAL|Traceback|CROSSSLOT", line)]


def lost_and_dupes(site: Any) -> tuple[int, int]:
    """(pages never fetched, extra fetches) of a crawled :class:`scrapy_dist.demo.site.SiteServer`."""
    counts = site.fetch_counts(status=None)
    return site.graph.pages - len(counts), sum(c - 1 for c in counts.values())


def links_back(graph: Any, page: int = 0) -> int:
    """1 if a page that answers links to ``page``, else 0: how many more times a seed's page is fetched
    (a seed neither consults nor records the dupefilter, so the link's request is new)."""
    return int(any(page in graph.links_of(i) for i in range(graph.pages) if i not in graph.missing))


def kill_holding_leases(
    project: Project, victim: subprocess.Popen[bytes], site: Any, client: Any, lease_sets: list[str],
    min_pages: int, timeout: float = 60,
) -> set[str]:
    """SIGKILL ``victim`` once ``site`` has answered ``min_pages`` pages and the victim holds leases;
    returns the paths of the requests it held then (read from the ``lease_sets`` ZSETs, whose lease keys'
    tags name the worker: ``host:pid:random``, see ``lease_parts``, once a call it sent before dying has
    landed on the server). Frozen after the kill until the leases run out."""
    pid = f":{victim.pid}:".encode()
    deadline = time.monotonic() + timeout

    def held() -> set[str]:
        out = set()
        for key in lease_sets:
            for lease in client.zrange(key, 0, -1):
                member, _, worker = lease_parts(lease)
                if worker is not None and pid in worker:
                    out.add(urlparse(load_payload(member[SEQ_BYTES:])["u"]).path)
        return out

    while len(site.fetch_counts()) < min_pages or not held():
        assert victim.poll() is None and time.monotonic() < deadline, "the victim never held a lease"
        time.sleep(0.02)
    ports = {c.laddr.port for c in psutil.Process(victim.pid).net_connections(kind="tcp") if c.raddr}
    seen = held()
    project.kill(victim)
    # A sync call the victim sent before it died still runs on the server, which drops a dead client's
    # connection only once it has read (and run) what it sent: its leases are read until then.
    deadline = time.monotonic() + 20
    while ports & _client_ports(client) and time.monotonic() < deadline:
        seen |= held()
        time.sleep(0.05)
    return seen | held()


def _client_ports(client: Any) -> set[int]:
    """The local ports of the clients connected to the server(s) of ``client`` (every node of a cluster)."""
    nodes = client.get_nodes() if hasattr(client, "get_nodes") else [None]
    ports = set()
    for node in nodes:
        rows = client.client_list() if node is None else client.client_list(target_nodes=node)
        ports.update(int(row["addr"].rsplit(":", 1)[1]) for row in rows)
    return ports


def kill_one_of_three(
    root: Path, redis_url: str, site: Any, client: Any, lease_sets: list[str], min_pages: int,
    settings: dict[str, Any] | None = None,
) -> Project:
    """The SIGKILL scenario the kill tests share: three workers of 8 concurrent requests and 3 s leases
    crawl ``site`` from its page 0; the second is killed holding leases once ``min_pages`` pages are in,
    and the other two must finish with nothing lost (:func:`assert_survived_kill`)."""
    project = make_project(root, {
        "REDIS_URL": redis_url, "CONCURRENT_REQUESTS": 8, "SCHEDULER_LEASE_SECONDS": 3,
        "SCHEDULER_IDLE_BEFORE_CLOSE": 2, **(settings or {}),
    })
    project.crawl(args={"seed": site.page_url(0)})
    wait_for_pages(site, 1)
    victim = project.crawl()
    project.crawl()
    project.wait_until_open()
    held = kill_holding_leases(project, victim, site, client, lease_sets, min_pages)
    assert_survived_kill(project, site, held, timeout=150)
    return project


def assert_survived_kill(project: Project, site: Any, victim_held: set[str], timeout: float = 120) -> None:
    """After workers 0 and 2 outlived the SIGKILLed worker 1: both finished cleanly, no page was lost,
    the only pages fetched twice are among those the victim held leases on when it died (downloaded
    but not yet acknowledged) or on a survivor's own expired leases (each refused ack counted), and the
    victim's leases came back through expiry."""
    codes = project.wait_all(timeout)
    assert codes[0] == 0 and codes[2] == 0, project.logs()[-4000:]
    lost, _ = lost_and_dupes(site)
    assert lost == 0
    twice = {path for path, n in site.fetch_counts(status=None).items() if n > 1}
    # A survivor starved of CPU past its own lease (an overloaded machine) is taken for dead too: its pages
    # may be fetched again, and the script refuses its late ack of each (scheduler/acks_refused). Every
    # other page fetched twice must be one the victim held.
    extra = twice - victim_held
    refused = sum(project.stats(i).get("scheduler/acks_refused", 0) for i in (0, 2))
    assert len(extra) <= refused, (sorted(extra)[:10], len(extra), len(victim_held), refused)
    requeued = sum(project.stats(i).get("scheduler/requeued/lease_expired", 0) for i in (0, 2))
    assert requeued > 0


def two_workers_on_a_seed(
    root: Path, settings: dict[str, Any], spiders: str, client: Any, site: Any, pages: int
) -> Project:
    """Push ``site``'s first page to ``links:start_urls`` through ``client`` (closed after), start two
    ``scrapy crawl`` workers of ``spiders`` and return once ``pages`` pages are fetched."""
    project = make_project(root, settings, spiders=spiders)
    try:
        client.rpush("links:start_urls", site.page_url(0))
    finally:
        client.close()
    project.crawl()
    project.crawl()
    project.wait_until_open()
    wait_for_pages(site, pages)
    return project
