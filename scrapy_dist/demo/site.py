"""A generated website served on 127.0.0.1, for the demo, the tests and the benchmarks.

Page ``i`` of ``/page/0 .. /page/<pages-1>`` links to ``i+1`` (so every page is reachable from ``/page/0``)
and to ``links - 1`` pages chosen by a seeded RNG (the same graph on every run). Optional ``slow``,
``flaky`` (503 the first ``flaky_failures`` times) and ``missing`` (404) pages; every answer is recorded
in :attr:`SiteServer.log` as ``(monotonic time, path, status)``.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


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
