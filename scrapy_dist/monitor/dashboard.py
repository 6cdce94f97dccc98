"""``scrapy-dist dashboard SPIDER``: a live web page of one crawl (aiohttp, Chart.js; docs/monitoring.md).
``GET /api/status`` and ``GET /api/history`` are cached, so any number of open pages cost one read. The POSTs
need the token in an ``X-Dashboard-Token`` header (no CSRF without a CORS preflight, which is never answered)
and the dashboard's own ``Origin``; listening beyond loopback needs a token (:func:`check_binding`)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from html import escape
from importlib import resources
from typing import Any

from aiohttp import web

from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.frontier.layout import pause_crawl, resume_crawl
from scrapy_dist.monitor import bounded_id, read_status, server_time
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.redis.outage import READ_ERRORS, ToolOutage, describe

__all__ = ["BUCKET_SECONDS", "Dashboard", "DashboardThread", "check_binding", "history_series"]

STATIC = resources.files("scrapy_dist.monitor").joinpath("dashboard_static")  #: the page and its scripts
BUCKET_SECONDS = 10  #: Width of one point of the history charts (seconds); an hour is 360 points.
MIN_POINTS = 6  #: Points a history chart shows at least (a minute at the start of a crawl).
HISTORY_READ = 20_000  #: history entries read per refresh at most (about an hour)
DEAD_SAMPLE = 200  #: Dead letters read per refresh to count their reasons.
WORKER_SERIES = 20  #: workers charted one by one (the busiest); the rest as ``other``
TOKEN_HEADER = "X-Dashboard-Token"
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})  #: host names always answered to


def check_binding(host: str, token: str | None) -> None:
    """Refuse (one line) to listen beyond loopback without a token."""
    with contextlib.suppress(ValueError):
        if token or host == "localhost" or ipaddress.ip_address(host).is_loopback:
            return
    raise ScrapyDistError(f"the dashboard listens on {host} only with a token: add --token"
                          " (or $SCRAPY_DIST_DASHBOARD_TOKEN), or keep the default --host 127.0.0.1")


def _field(fields: dict[bytes, bytes], name: bytes) -> float | None:
    raw = fields.get(name, b"")
    return float(raw) if 0 < len(raw) <= 20 and raw.isdigit() else None


def history_series(entries: list[tuple[bytes, dict[bytes, bytes]]], now: float,
                   span: float = 3600.0, bucket: float = BUCKET_SECONDS) -> dict[str, Any]:
    """Chart series from history stream entries (``XRANGE`` replies), per bucket from the first sample to
    ``now``: pages/min crawl-wide and per worker, errors/min, the frontier as last reported."""
    start, n, per_min = now - span, int(span // bucket), 60.0 / bucket
    times = [start + (i + 1) * bucket for i in range(n)]
    last: dict[str, tuple[float, float, float]] = {}  # worker -> (time, pages, errors) of its last sample
    pages, errors = [0.0] * n, [0.0] * n
    per_worker: dict[str, list[float]] = defaultdict(lambda: [0.0] * n)
    frontier = {k: [None] * n for k in ("queued", "inflight", "delayed")}
    for entry_id, fields in entries:
        try:
            t = int(entry_id.split(b"-", 1)[0]) / 1000.0
            worker = bounded_id(fields[b"w"])
        except (ValueError, KeyError, AttributeError, IndexError):
            continue
        p, e = _field(fields, b"p"), _field(fields, b"e")
        if p is None:
            continue
        i = int((t - start) // bucket)
        prev = last.get(worker)
        last[worker] = (t, p, e or 0.0)
        for name, key in (("queued", b"q"), ("inflight", b"f"), ("delayed", b"d")):
            if (value := _field(fields, key)) is not None and 0 <= i < n:
                frontier[name][i] = value  # type: ignore[call-overload]
        if prev is None or not 0 <= i < n or t <= prev[0]:
            continue
        dp, de = max(0.0, p - prev[1]), max(0.0, (e or 0.0) - prev[2])
        pages[i] += dp * per_min
        errors[i] += de * per_min
        per_worker[worker][i] += dp * per_min
    # the charts start at the first sample (a crawl younger than the hour does not sit in a corner)
    first = next((i for i in range(n) if pages[i] or errors[i] or frontier["queued"][i] is not None), n - 1)
    cut = max(0, min(first - 1, n - MIN_POINTS))
    return {"times": times[cut:], "pages_per_min": pages[cut:], "errors_per_min": errors[cut:],
            "workers": {w: v[cut:] for w, v in _top_series(per_worker, n).items()},
            **{k: v[cut:] for k, v in frontier.items()}}


def _top_series(per_worker: dict[str, list[float]], n: int, limit: int = WORKER_SERIES) -> dict[str, Any]:
    """The ``limit`` series of the most pages, the others summed point by point as ``other``."""
    if len(per_worker) <= limit:
        return per_worker
    ranked = sorted(per_worker, key=lambda w: sum(per_worker[w]), reverse=True)
    out = {w: per_worker[w] for w in ranked[:limit]}
    rest = [out.get("other", [0.0] * n)] + [per_worker[w] for w in ranked[limit:]]
    out["other"] = [sum(point) for point in zip(*rest, strict=True)]
    return out


def host_name(header: str) -> str:
    """The name of a ``Host`` header: no port, no IPv6 brackets, lower case, no trailing dot."""
    if (name := header.strip().lower()).startswith("["):
        name = name[1:].partition("]")[0]
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    return name.rstrip(".")


def allowed_host(name: str, bound: str, extra: frozenset[str]) -> bool:
    """Whether the dashboard bound to ``bound`` answers a request whose ``Host`` names ``name``: loopback
    names, the bound address, ``extra``; bound to every interface, also any IP address and this machine's
    names -- never someone else's DNS name (a page of theirs rebinding it here must not read this)."""
    if not name:
        return False
    if name in LOOPBACK_NAMES or name == host_name(bound) or name in extra:
        return True
    if host_name(bound) not in ("0.0.0.0", "::", ""):
        return False
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return name in {socket.gethostname().lower(), socket.getfqdn().lower().rstrip(".")}


@dataclass(eq=False)
class Dashboard:
    """The aiohttp application of one crawl's dashboard (``client``: a sync Redis client read in a thread)."""

    client: Any
    keys: CrawlKeys
    token: str | None = None
    host: str = "127.0.0.1"  #: the address it listens on; other names it is reached by: ``allowed_hosts``
    allowed_hosts: tuple[str, ...] = ()
    cache_seconds: float = 2.0
    requeue: Callable[[], Any] | None = None
    clock: Callable[[], float] = time.monotonic
    reads: int = field(default=0, init=False)  #: Redis reads done (what the cache saves is visible)
    _cache: dict[str, tuple[float, Any]] = field(default_factory=dict, init=False, repr=False)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False, repr=False)
    #: one WARNING when Redis goes away, one INFO when it is back; the page says it meanwhile (503)
    outage: ToolOutage = field(default_factory=lambda: ToolOutage("dashboard"), init=False, repr=False)

    def app(self) -> web.Application:
        extra = frozenset(host_name(h) for h in self.allowed_hosts)
        @web.middleware
        async def check_host(request: web.Request, handler: Any) -> web.StreamResponse:
            if not allowed_host(host_name(request.headers.get("Host", "")), self.host, extra):
                return web.Response(status=421, text="This dashboard does not answer to that host name;"
                                    " add it with --allow-host NAME if it is yours.\n")
            return await handler(request)  # type: ignore[no-any-return]
        app = web.Application(client_max_size=1024, middlewares=[check_host])
        app.add_routes([web.get("/", self.page), web.get("/static/{name}", self.static),
                        web.get("/api/status", self.status), web.get("/api/history", self.history),
                        web.post("/api/{action:pause|resume|requeue}", self.act)])
        return app

    async def _reply(self, name: str, read: Callable[[], Any], seconds: float) -> web.Response:
        """The JSON of ``read()`` cached for ``seconds``, or 503 with the reason while Redis is away."""
        async with self._lock:
            if (hit := self._cache.get(name)) is None or self.clock() - hit[0] >= seconds:
                self.reads += 1
                try:
                    value = await asyncio.to_thread(read)
                except READ_ERRORS as exc:
                    return self._unavailable(exc)
                hit = self._cache[name] = (self.clock(), value)
        self.outage.succeeded(self.clock())
        return web.json_response(hit[1])

    def _unavailable(self, exc: BaseException) -> web.Response:
        self.outage.failed(exc, self.clock())
        return web.json_response({"error": f"Redis unavailable ({describe(exc)[:200]})"}, status=503)

    def _read_status(self) -> dict[str, Any]:
        status = read_status(self.client, self.keys, lease_scan_limit=0, dead_sample=DEAD_SAMPLE)
        status.pop("stats", None)  # hundreds of fields the page does not show
        return status

    def _read_history(self) -> dict[str, Any]:
        now = server_time(self.client)
        entries = self.client.xrange(self.keys.history, min=f"{int((now - 3600) * 1000)}", count=HISTORY_READ)
        return history_series(entries or [], now)

    async def status(self, request: web.Request) -> web.Response:
        return await self._reply("status", self._read_status, self.cache_seconds)

    async def history(self, request: web.Request) -> web.Response:
        # the history changes by one point per bucket: read it at most once a bucket
        return await self._reply("history", self._read_history, max(self.cache_seconds, BUCKET_SECONDS / 2))

    async def page(self, request: web.Request) -> web.Response:
        html = STATIC.joinpath("index.html").read_text().replace("{{SPIDER}}", escape(self.keys.spider))
        csp = "default-src 'self'; style-src 'self' 'unsafe-inline'"
        return web.Response(text=html, content_type="text/html",
                            headers={"Content-Security-Policy": csp, "X-Frame-Options": "DENY"})

    async def static(self, request: web.Request) -> web.Response:
        if (name := request.match_info["name"]) not in ("chart.umd.min.js", "dashboard.js"):
            raise web.HTTPNotFound()
        return web.Response(body=STATIC.joinpath(name).read_bytes(), content_type="application/javascript")

    async def act(self, request: web.Request) -> web.Response:
        token, origin = request.headers.get(TOKEN_HEADER, "").encode(), request.headers.get("Origin")
        if (not self.token or not hmac.compare_digest(token, self.token.encode())
                or origin not in (None, f"{request.scheme}://{request.host}")):
            raise web.HTTPForbidden(text="a valid X-Dashboard-Token header from this page is needed")
        try:
            done = await self._act(request.match_info["action"])
        except READ_ERRORS as exc:
            return self._unavailable(exc)
        self._cache.clear()
        return web.json_response({"done": done})

    async def _act(self, action: str) -> Any:
        if action == "pause":
            await asyncio.to_thread(pause_crawl, self.client, self.keys.control, by="dashboard")
            return "paused"
        if action == "resume":
            await asyncio.to_thread(resume_crawl, self.client, self.keys.control, self.keys.errors)
            return "resumed"
        if self.requeue is None:
            raise web.HTTPNotImplemented(text="requeueing is not available here")
        return await self.requeue()


class DashboardThread:
    """``dashboard`` served on its host, ``port`` (0: a free port), from a thread with its own event loop: for
    ``scrapy-dist demo --dashboard`` and the tests. ``url`` is set once it listens; :meth:`close` stops it."""

    def __init__(self, dashboard: Dashboard, port: int = 0) -> None:
        self.loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(dashboard.app(), access_log=None)
        self._thread = threading.Thread(target=self.loop.run_forever, name="scrapy-dist dashboard",
                                        daemon=True)
        self._thread.start()
        async def start() -> str:
            await self._runner.setup()
            await web.TCPSite(self._runner, dashboard.host, port).start()
            return f"http://{dashboard.host}:{self._runner.addresses[0][1]}/"
        try:
            self.url = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.loop.is_running():
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

