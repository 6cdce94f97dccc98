"""Serve a :class:`scrapy_dist.demo.site.SiteGraph` fast enough that the crawler, not the server, is measured.

nginx serves the pages as static files (written to a temporary directory, ``/page/<i>`` -> ``page/<i>``),
started as a non-daemon child with its own config, pid, logs and temp paths. Without nginx a pre-forked
Python server (one process per core, ``SO_REUSEPORT``) takes its place; it is slower, and the benchmark
output says which server was used.
"""

from __future__ import annotations

import http.client
import multiprocessing
import os
import shutil
import socket
import subprocess
import tempfile
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from benchmarks.redis_server import free_port
from scrapy_dist.demo.site import SiteGraph

NGINX_CONF = """\
worker_processes {workers};
daemon off;
master_process on;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    types {{ }}
    default_type text/html;
    sendfile on;
    tcp_nodelay on;
    keepalive_timeout 120s;
    keepalive_requests 1000000;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    server {{
        listen 127.0.0.1:{port};
        root {root};
        location / {{ try_files $uri =404; }}
    }}
}}
"""


class StaticSite:
    """The generated site on ``http://127.0.0.1:<port>``: nginx if installed, else pre-forked Python."""

    def __init__(self, graph: SiteGraph, prefer: str = "nginx") -> None:
        self.graph = graph
        self.prefer = prefer
        self.port = 0
        self.server = ""  # "nginx 1.22.1" or "python (pre-forked, N processes)"
        self.tmp = ""
        self._proc: subprocess.Popen[bytes] | None = None
        self._children: list[Any] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> StaticSite:
        self.tmp = tempfile.mkdtemp(prefix="scrapy-dist-bench-site-")
        # nginx workers may run as "nobody": the tree must be world-readable.
        os.chmod(self.tmp, 0o755)
        nginx = shutil.which("nginx") or next(
            (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.path.exists(p)), None
        )
        if nginx and self.prefer == "nginx":
            self._start_nginx(nginx)
        else:
            self._start_python("chosen" if nginx else "nginx not found")
        self._wait_ready()
        return self

    def _write_pages(self) -> Path:
        root = Path(self.tmp) / "root"
        (root / "page").mkdir(parents=True)
        for i in range(self.graph.pages):
            if i not in self.graph.missing:
                (root / "page" / str(i)).write_bytes(self.graph.html(i))
        for d in (root, root / "page"):
            os.chmod(d, 0o755)
        return root

    def _start_nginx(self, nginx: str) -> None:
        root = self._write_pages()
        self.port = free_port()
        conf = Path(self.tmp) / "nginx.conf"
        conf.write_text(NGINX_CONF.format(workers=1, tmp=self.tmp, port=self.port, root=root))
        version = subprocess.run([nginx, "-v"], capture_output=True, text=True).stderr.strip()
        self.server = version.replace("nginx version: ", "").replace("/", " ")
        self._proc = subprocess.Popen(
            [nginx, "-c", str(conf), "-p", self.tmp, "-e", f"{self.tmp}/error.log"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def _start_python(self, why: str) -> None:
        self.port = free_port()
        n = max(1, os.cpu_count() or 1)
        self.server = f"python (pre-forked, {n} processes; {why})"
        ctx = multiprocessing.get_context("fork")
        for _ in range(n):
            child = ctx.Process(target=_serve_python, args=(self.graph, self.port), daemon=True)
            child.start()
            self._children.append(child)

    def _wait_ready(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/page/0")
                if conn.getresponse().status == 200:
                    conn.close()
                    return
            except OSError:
                pass
            if time.monotonic() > deadline or (self._proc is not None and self._proc.poll() is not None):
                log = Path(self.tmp, "error.log")
                detail = log.read_text()[-2000:] if log.exists() else ""
                self.stop()
                raise RuntimeError(f"{self.server} did not serve the site on port {self.port}\n{detail}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()  # nginx: SIGTERM = fast shutdown
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for child in self._children:
            child.terminate()
            child.join(5)
        self._children = []
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> StaticSite:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _ReusePortServer(ThreadingHTTPServer):
    daemon_threads = True

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()


def _serve_python(graph: SiteGraph, port: int) -> None:
    cache: dict[str, bytes] = {}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            body = cache.get(self.path)
            status = 200
            if body is None:
                try:
                    i = int(self.path.removeprefix("/page/"))
                    ok = self.path.startswith("/page/") and 0 <= i < graph.pages and i not in graph.missing
                except ValueError:
                    ok = False
                status, body = (200, graph.html(i)) if ok else (404, b"not found")
                if ok:
                    cache[self.path] = body
            self.send_response(status)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    _ReusePortServer(("127.0.0.1", port), Handler).serve_forever()
