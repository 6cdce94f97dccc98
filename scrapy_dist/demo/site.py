"""A generated website served on 127.0.0.1, for the demo, the tests and the benchmarks.

Page ``i`` of ``/page/0 .. /page/<pages-1>`` links to ``i+1`` (so every page is reachable from ``/page/0``)
and to ``links - 1`` pages chosen by a seeded RNG (the same graph on every run). Optional ``slow``,
``flaky`` (503 the first ``flaky_failures`` times) and ``missing`` (404) pages; every answer is recorded
in :attr:`SiteServer.log` as ``(monotonic time, path, status)``.
"""

from __future__ import annotations

import random
import re
import sys
import threading
import time
from collections import Counter, deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class SiteGraph:
    """The link graph: which pages exist and where each links to."""

    def __init__(
        self, pages: int, links: int = 10, seed: int = 1, *, slow: int = 0, flaky: int = 0, missing: int = 0
    ) -> None:
        self.pages = pages
        self.links = links
        rng = random.Random(seed)
        special = rng.sample(range(1, pages), min(pages - 1, slow + flaky + missing)) if pages > 1 else []
        self.slow = set(special[:slow])
        self.flaky = set(special[slow : slow + flaky])
        self.missing = set(special[slow + flaky :])
        self._seed = seed

    def links_of(self, i: int) -> list[int]:
        """The page numbers page ``i`` links to (deterministic)."""
        rng = random.Random(self._seed * 1_000_003 + i)
        out = [i + 1] if i + 1 < self.pages else []
        out += [rng.randrange(self.pages) for _ in range(max(0, self.links - len(out)))]
        return out

    @property
    def ok_pages(self) -> int:
        """Pages that answer 200 in the end (all but the missing ones)."""
        return self.pages - len(self.missing)

    def html(self, i: int) -> bytes:
        items = "".join(f'<li><a href="/page/{j}">page {j}</a></li>' for j in self.links_of(i))
        return (
            f"<!doctype html><html><head><title>page {i}</title></head><body>"
            f'<h1 id="title">page {i}</h1><ul>{items}</ul></body></html>'
        ).encode()


class _Server(ThreadingHTTPServer):
    request_queue_size = 128  # the default (5) drops bursts of connections from concurrent crawlers
    daemon_threads = True


class SiteServer:
    """Serves a :class:`SiteGraph` over HTTP on 127.0.0.1 in a background thread."""

    def __init__(
        self,
        graph: SiteGraph,
        host: str = "127.0.0.1",
        port: int = 0,
        slow_delay: float = 1.0,
        flaky_failures: int = 2,
        delay: float = 0.0,
    ) -> None:
        self.graph = graph
        self.delay = delay  # every page answers after at least this many seconds
        self.slow_delay = slow_delay
        self.flaky_failures = flaky_failures
        self.log: list[tuple[float, str, int]] = []
        self._lock = threading.Lock()
        self._flaky_seen: Counter[int] = Counter()
        self._httpd = _Server((host, port), self._handler())
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def page_url(self, i: int) -> str:
        return f"{self.url}/page/{i}"

    def start(self) -> SiteServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> SiteServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what was fetched -----------------------------------------------------------------------
    def fetch_counts(self, status: int | None = 200) -> Counter[str]:
        """How many times each path was answered (with ``status``, or any status if None)."""
        with self._lock:
            return Counter(p for _, p, s in self.log if status is None or s == status)

    def respond(self, path: str) -> tuple[int, bytes, float]:
        """(status, body, delay) for ``path``; also used by the demo's own server."""
        g = self.graph
        if not path.startswith("/page/"):
            return 404, b"not found", 0.0
        try:
            i = int(path[len("/page/") :])
        except ValueError:
            return 404, b"not found", 0.0
        if not 0 <= i < g.pages or i in g.missing:
            return 404, b"not found", 0.0
        delay = self.slow_delay if i in g.slow else self.delay
        if i in g.flaky:
            with self._lock:
                self._flaky_seen[i] += 1
                if self._flaky_seen[i] <= self.flaky_failures:
                    return 503, b"try again", delay
        return 200, g.html(i), delay

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                status, body, delay = server.respond(self.path)
                if delay:
                    time.sleep(delay)
                with server._lock:
                    server.log.append((time.monotonic(), self.path, status))
                self.send_response(status)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass

        return Handler


#: Window of the crawl-wide pages/s figure (seconds).
RATE_WINDOW = 2.0
#: The path of a page of the site; other paths (``/robots.txt``) do not count.
PAGE_PATH = re.compile(r"/page/(\d+)$")


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
            m = PAGE_PATH.match(path)
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


def quiet(server: SiteServer) -> None:
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
