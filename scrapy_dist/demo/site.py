"""What the demo runs: a generated website on 127.0.0.1 (also crawled by the tests and benchmarks), the
:class:`Summary` of what it answered, the ``scrapy crawl demo`` workers and the demo's side of its Redis."""

from __future__ import annotations

import configparser
import contextlib
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from redis.exceptions import BusyLoadingError, RedisError

from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.redis.connection import check_reachable, get_redis
from scrapy_dist.redis.embedded import DEFAULT_DIRNAME, EmbeddedRedis

PAGE_PATH = re.compile(r"/page/(\d+)$")  #: a page of the site (``/robots.txt`` does not count)
LOST_SHOWN = 10  #: Lost pages named (and explained) below the summary.
RATE_WINDOW = 2.0  #: Window of the crawl-wide pages/s figure (seconds).
SPIDER = "demo"  #: The spider every worker runs.
STOP_GRACE = 10.0  #: seconds a stopped worker gets to close cleanly before it is killed
#: ``example_project/`` of a source checkout: the repository root is the package's parent directory.
EXAMPLE_PROJECT = Path(__file__).resolve().parents[2] / "example_project"
#: where a wheel carries example_project (pyproject.toml: tool.hatch.build.targets.wheel.force-include)
PACKAGED_PROJECT = Path(__file__).resolve().parents[1] / "_example_project"
_WORKER_SETTINGS_MODULE = "scrapy_dist_demo_worker_settings"
_WORKER_URL_VARIABLE = "SCRAPY_DIST_DEMO_REDIS_URL"


class SiteGraph:
    """The link graph: page ``i`` links to ``i+1`` and to ``links - 1`` pages a seeded RNG picks; some pages
    are ``slow``, ``flaky`` (503 at first) or ``missing`` (404)."""

    def __init__(self, pages: int, links: int = 10, seed: int = 1, *, slow: int = 0, flaky: int = 0,
                 missing: int = 0) -> None:
        self.pages, self.links, self._seed = pages, links, seed
        rng = random.Random(seed)
        special = rng.sample(range(1, pages), min(pages - 1, slow + flaky + missing)) if pages > 1 else []
        self.slow = set(special[:slow])
        self.flaky = set(special[slow : slow + flaky])
        self.missing = set(special[slow + flaky :])

    def links_of(self, i: int) -> list[int]:
        rng = random.Random(self._seed * 1_000_003 + i)
        out = [i + 1] if i + 1 < self.pages else []
        out += [rng.randrange(self.pages) for _ in range(max(0, self.links - len(out)))]
        return out

    @property
    def ok_pages(self) -> int:  # pages that answer 200 in the end
        return self.pages - len(self.missing)

    def html(self, i: int) -> bytes:
        items = "".join(f'<li><a href="/page/{j}">page {j}</a></li>' for j in self.links_of(i))
        return (f"<!doctype html><html><head><title>page {i}</title></head><body>"
                f'<h1 id="title">page {i}</h1><ul>{items}</ul></body></html>').encode()


def demo_graph(pages: int) -> SiteGraph:
    """The demo's site: 5 slow, 10 flaky (503 twice, then 200) and 10 missing pages (fewer under 250)."""
    return SiteGraph(pages, slow=min(5, pages // 50), flaky=min(10, pages // 25),
                     missing=min(10, pages // 25))


class SiteServer(ThreadingHTTPServer):
    """Serves a :class:`SiteGraph` over HTTP in a background thread, logging every answer in :attr:`log`."""

    request_queue_size = 128  # the default (5) drops bursts of connections from concurrent crawlers
    daemon_threads = True

    def __init__(self, graph: SiteGraph, host: str = "127.0.0.1", port: int = 0, slow_delay: float = 1.0,
                 flaky_failures: int = 2, delay: float = 0.0, quiet: bool = False) -> None:
        self.graph, self.delay = graph, delay
        self.slow_delay, self.flaky_failures = slow_delay, flaky_failures
        self.quiet = quiet  #: no traceback for a reset connection (a killed worker resets all of its at once)
        self.log: list[tuple[float, str, int]] = []
        self.lock = threading.Lock()
        self._flaky_seen: Counter[int] = Counter()
        super().__init__((host, port), _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not (self.quiet and isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError))):
            super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def page_url(self, i: int) -> str:
        return f"{self.url}/page/{i}"

    def start(self) -> SiteServer:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def __enter__(self) -> SiteServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def fetch_counts(self, status: int | None = 200) -> Counter[str]:
        """How many times each path was answered (with ``status``, or any status if None)."""
        with self.lock:
            return Counter(p for _, p, s in self.log if status is None or s == status)

    def respond(self, path: str) -> tuple[int, bytes, float]:
        """(status, body, delay) for ``path``."""
        g, m = self.graph, PAGE_PATH.match(path)
        i = int(m.group(1)) if m else -1
        if not 0 <= i < g.pages or i in g.missing:
            return 404, b"not found", 0.0
        delay = self.slow_delay if i in g.slow else self.delay
        if i in g.flaky:
            with self.lock:
                self._flaky_seen[i] += 1
                if self._flaky_seen[i] <= self.flaky_failures:
                    return 503, b"try again", delay
        return 200, g.html(i), delay


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: SiteServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        status, body, delay = self.server.respond(self.path)
        time.sleep(delay)
        with self.server.lock:
            self.server.log.append((time.monotonic(), self.path, status))
        self.send_response(status)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


class SiteTally:
    """What the site has answered so far (``/page/<i>`` only), read incrementally from its log."""

    def __init__(self, server: SiteServer, window: float = RATE_WINDOW) -> None:
        self.server, self.window = server, window
        self.ok: set[int] = set()  #: pages answered 200 at least once
        self.duplicates = self.retried = self.not_found = 0  #: 200s beyond a page's first; 503s; 404s
        self.last_new: float | None = None  #: monotonic time of the latest page answered 200 the first time
        self._read = 0
        self._recent: deque[float] = deque()

    def update(self) -> None:
        """Take in the answers logged since the last call."""
        new = self.server.log[self._read :]  # the handler threads only append; a slice is taken atomically
        self._read += len(new)
        for at, path, status in new:
            if (m := PAGE_PATH.match(path)) is None:
                continue
            self._recent.append(at)
            if status == 200:
                if (page := int(m.group(1))) in self.ok:
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
    dead_letters: int
    dead_reasons: dict[str, int]
    lost_pages: list[int]  #: the first :data:`LOST_SHOWN` lost pages
    elapsed: float  #: seconds from the seed push until every worker had closed
    crawl_seconds: float | None = None  #: seconds from the seed push until the last new page was answered
    workers_started: int = 0
    workers_killed: int = 0
    workers_failed: list[str] = field(default_factory=list)  #: "worker 2 (pid 123): exit status 1"
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.lost == 0 and not self.workers_failed and not self.timed_out


def summarize(graph: SiteGraph, answers_200: Mapping[str, int], answers_503: Mapping[str, int],
              dead_reasons: Mapping[str, int], **run: Any) -> Summary:
    """The summary of the site's answers (``SiteServer.fetch_counts``), dead letters and ``run``'s fields."""
    ok_counts: Counter[int] = Counter()
    for path, n in answers_200.items():
        if (m := PAGE_PATH.match(path)) and n > 0:
            ok_counts[int(m.group(1))] += n
    crawled = len([i for i in ok_counts if 0 <= i < graph.pages and i not in graph.missing])
    lost_pages = [i for i in range(graph.pages) if i not in graph.missing and i not in ok_counts]
    return Summary(
        site_pages=graph.pages, ok_pages=graph.ok_pages, missing=len(graph.missing), crawled=crawled,
        lost=graph.ok_pages - crawled, duplicates=sum(n - 1 for n in ok_counts.values()),
        retried=sum(n for path, n in answers_503.items() if PAGE_PATH.match(path)),
        dead_letters=sum(dead_reasons.values()), dead_reasons=dict(dead_reasons),
        lost_pages=lost_pages[:LOST_SHOWN], **run)


def locate_project(run_dir: Path, example: Path | None = None) -> tuple[Path, bool]:
    """The workers' project (``example_project/`` of a checkout, else the wheel's copy); whether a copy."""
    example = EXAMPLE_PROJECT if example is None else example
    for path, packaged in ((example, False), (PACKAGED_PROJECT, True)):
        if (path / "scrapy.cfg").is_file() and (path / "example_project" / "spiders" / "demo.py").is_file():
            return path, packaged
    raise ScrapyDistError(f"example_project not found (looked in {example} and {PACKAGED_PROJECT})")


class Worker(subprocess.Popen[bytes]):
    """One ``scrapy crawl demo`` process started by the demo (its exit status: ``returncode``)."""

    def __init__(self, number: int, log: Path, cmd: list[str], **popen: Any) -> None:
        super().__init__(cmd, **popen)
        self.number, self.log = number, log
        self.state = "running"  #: running, killed, exited, failed, stopped
        self.killed_at: float | None = None  #: monotonic time of the chaos SIGKILL

    def describe_failure(self, lines: int = 8) -> str:
        """Which worker failed and how, with the end of its log."""
        tail: list[str] = []
        with contextlib.suppress(OSError):
            tail = self.log.read_text(errors="replace").strip().splitlines()[-lines:]
        head = f"worker {self.number} (pid {self.pid}): exit status {self.returncode}; log {self.log}"
        return "\n".join([head, *(f"    {line}" for line in tail)])


@dataclass
class WorkerFleet:
    """The workers of one demo run, started alike in ``project``, logging to ``run_dir/worker-<n>.log``."""

    project: Path
    run_dir: Path
    settings: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    workers: list[Worker] = field(default_factory=list)

    def configure(self, prefix: str, embedded: EmbeddedRedis | None, redis_url: str) -> None:
        """Every worker's ``-s`` settings and environment. No password on a command line, which ``ps`` shows:
        another Redis than the embedded one is named by a settings module written into ``run_dir``."""
        # the demo site is on 127.0.0.1, which the default SCHEDULER_DENY_NETWORKS refuses
        self.settings = {"REDIS_KEY_PREFIX": prefix, "SCHEDULER_DENY_NETWORKS": "", "REDIS_SENTINELS": ""}
        project_vars = ("SCRAPY_SETTINGS_MODULE", "SCRAPY_PROJECT")
        self.env = {k: v for k, v in os.environ.items() if k not in project_vars}
        if embedded is not None:  # and no REDIS_URL of the project's settings.py sends them elsewhere
            self.settings.update(REDIS_URL="", REDIS_HOST="", REDIS_PORT="",
                                 REDIS_EMBEDDED_DIR=str(embedded.directory))
            return
        module_dir = self.run_dir / "worker-settings"
        module_dir.mkdir(mode=0o700, exist_ok=True)
        cfg = configparser.ConfigParser()
        cfg.read(self.project / "scrapy.cfg")
        base = cfg.get("settings", "default", fallback="example_project.settings")
        (module_dir / f"{_WORKER_SETTINGS_MODULE}.py").write_text(
            f"import os\n\nfrom {base} import *  # noqa: F403\n\n"
            f'REDIS_URL = os.environ["{_WORKER_URL_VARIABLE}"]\nREDIS_HOST = REDIS_PORT = None\n')
        path = (str(module_dir), str(self.project), os.environ.get("PYTHONPATH", ""))
        self.env.update({_WORKER_URL_VARIABLE: redis_url, "SCRAPY_SETTINGS_MODULE": _WORKER_SETTINGS_MODULE,
                         "PYTHONPATH": os.pathsep.join(p for p in path if p)})

    def start(self) -> Worker:
        number = len(self.workers) + 1
        cmd = [sys.executable, "-m", "scrapy", "crawl", SPIDER,
               *(arg for name, value in self.settings.items() for arg in ("-s", f"{name}={value}"))]
        log = self.run_dir / f"worker-{number}.log"
        with open(log, "wb") as fh:
            # its own process group: Ctrl-C in the terminal reaches the demo only, which stops the workers
            worker = Worker(number, log, cmd, cwd=self.project, env=self.env, stdout=fh,
                            stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        self.workers.append(worker)
        return worker

    def reap(self) -> None:
        for w in self.workers:
            if w.state == "running" and w.poll() is not None:
                w.state = "exited" if w.returncode == 0 else "failed"

    def running(self) -> list[Worker]:
        return [w for w in self.workers if w.state == "running"]

    def stop(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM the running workers (they close cleanly, giving leases back), SIGKILL after ``grace``."""
        alive = self.running()
        for w in alive:
            with contextlib.suppress(ProcessLookupError):
                w.terminate()
        deadline = time.monotonic() + grace
        for w in alive:
            try:
                w.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
            w.state = "stopped"

    def kill(self, worker: Worker) -> None:
        """SIGKILL one worker (chaos): its leased requests go back to the queue once their leases run out."""
        worker.kill()
        worker.wait()
        worker.state, worker.killed_at = "killed", time.monotonic()


def open_redis(redis_url: str | None, project: Path, loading_timeout: float
               ) -> tuple[Any, str, EmbeddedRedis | None, bool]:
    """A client of ``redis_url``, else of the project's embedded Redis (started if needed), the URL, the
    embedded server (or ``None``) and whether this call started it; ``RedisUnavailable`` if none answers."""
    embedded, started = None, False
    if not redis_url:
        # the directory every `scrapy crawl` in the project would use (REDIS_EMBEDDED_DIR unset)
        embedded = EmbeddedRedis(project / ".scrapy" / DEFAULT_DIRNAME)
        redis_url, started = embedded.ensure_running()
    settings = {"REDIS_URL": redis_url}
    client = get_redis(settings)
    deadline = time.monotonic() + loading_timeout
    while time.monotonic() <= deadline:  # a server just started may still be loading: PING answers LOADING
        try:
            client.ping()
            break
        except BusyLoadingError:
            time.sleep(0.1)
        except (RedisError, OSError):  # reported by the check below
            break
    try:
        check_reachable(client, settings)
    except Exception:
        client.close()
        if started and embedded is not None:
            embedded.shutdown()
        raise
    return client, redis_url, embedded, started


def release_run(client: Any, prefix: str, started_redis: bool) -> bool:
    """After a run: delete its keys (those holding its ``prefix``) and close ``client``; if the demo started
    the server and nobody else uses it, compact its append-only file and say to stop it. Never raises."""
    with contextlib.suppress(Exception):
        keys = list(client.scan_iter(match=f"*{prefix}*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i : i + 500])
    if stop := started_redis:
        with contextlib.suppress(Exception):
            me = client.client_id()
            stop = not any(int(c.get("id", me)) != me for c in client.client_list())
    if stop:
        with contextlib.suppress(Exception):
            client.bgrewriteaof()
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline:
                info = client.info("persistence")
                if not info.get("aof_rewrite_in_progress") and not info.get("aof_rewrite_scheduled"):
                    break
                time.sleep(0.05)
    with contextlib.suppress(Exception):
        client.close()
    return stop
