"""The demo's site: the generated link graph it serves and the tally of what it answered, the demo's
truth (a page counts as crawled only if the site answered it 200).
"""

from __future__ import annotations

import re
import sys
from collections import deque
from typing import Any

from scrapy_dist.demo.site import SiteGraph, SiteServer

__all__ = ["PAGE_PATH", "RATE_WINDOW", "SiteTally", "demo_graph", "quiet"]

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
