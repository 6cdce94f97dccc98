"""One crawl on namespaced hosts (:mod:`benchmarks.netns`) that a fault can be injected into.

:class:`FaultCrawl` builds the hosts -- ``redis`` (with AOF if asked), optionally ``replica`` and
``sentinels`` (three Sentinels), ``site`` (:mod:`benchmarks.faultsite`) and ``w1``..``wN`` -- writes a small
Scrapy project whose spider follows every link and yields one item per page through ``RedisPipeline``
(with the scrapy-dist add-on, so workers send heartbeats ``scrapy-dist status`` shows), and runs each
worker as a real ``scrapy crawl`` in its own namespace with its own hostname (worker ids begin with it).
Optionally a latency proxy (:mod:`benchmarks.proxy`) sits in the Redis host in front of Redis.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.faultsite import read_access_log
from benchmarks.netns import Network
from benchmarks.processes import link_spider

REPO = Path(__file__).resolve().parent.parent
SPIDER = "links"
REDIS_PORT = 6379
PROXY_PORT = 6380
SITE_PORT = 8000
SENTINEL_PORTS = (26379, 26380, 26381)
MASTER_NAME = "faults"

SPIDER_CODE = link_spider('LinkSpider', 'links', 1)

SETTINGS_CODE = '''
BOT_NAME = "faultbot"
SPIDER_MODULES = ["faultbot.spiders"]
ROBOTSTXT_OBEY = False
LOG_LEVEL = "INFO"
TELNETCONSOLE_ENABLED = False
ADDONS = {"scrapy_dist.Addon": 0}
ITEM_PIPELINES = {"scrapy_dist.pipelines.RedisPipeline": 300}
# the site lives on a private address, which the default SCHEDULER_DENY_NETWORKS refuses
SCHEDULER_DENY_NETWORKS = ["169.254.0.0/16"]
'''


@dataclass
class CrawlConfig:
    """Sizes and timings of one crawl; fault timings are derived from ``lease``."""

    pages: int = 2000
    workers: int = 4
    concurrency: int = 4
    page_delay: float = 0.5
    lease: float = 40.0
    idle_close: float = 3.0
    socket_timeout: float = 3.0
    sentinel: bool = False
    aof: bool = False
    rtt_ms: float = 0.0
    jitter_ms: float = 0.0
    timeout: float = 600.0

    @property
    def prefetch(self) -> int:
        """Requests a worker leases ahead of demand (SCHEDULER_PREFETCH 0: 2 x CONCURRENT_REQUESTS, >= 16)."""
        return max(16, 2 * self.concurrency)

    @property
    def held_bound(self) -> int:
        """What one worker can hold: its prefetch plus its requests in flight."""
        return self.prefetch + self.concurrency


class FaultCrawl:
    """The hosts, servers and workers of one crawl in ``root`` (logs, access log, project)."""

    def __init__(self, net: Network, cfg: CrawlConfig, root: Path) -> None:
        self.net = net
        self.cfg = cfg
        self.root = root
        self.access_log = root / "access.log"
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.servers: dict[str, subprocess.Popen[bytes]] = {}
        self.master = "redis"
        #: the crawl's SCHEDULER_ENTRY_SECRET, new for every run
        self.secret = secrets.token_hex(16)

    # -- hosts and servers ---------------------------------------------------------------------
    def build(self) -> None:
        """Make every host, start Redis (+ replica and Sentinels), the proxy and the site."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._write_project()
        net = self.net
        net.add_host("redis", ("data",))
        if self.cfg.sentinel:
            net.add_host("replica", ("data",))
            net.add_host("sentinels", ("data",))
        net.add_host("site", ("web",))
        for i in range(1, self.cfg.workers + 1):
            net.add_host(f"w{i}")
        self.start_redis("redis")
        if self.cfg.sentinel:
            self.start_redis("replica", replica_of=net.hosts["redis"].data_addr)
            for port in SENTINEL_PORTS:
                self._start_sentinel(port)
        if self.cfg.rtt_ms:
            self.servers["proxy"] = net.spawn("redis", [
                sys.executable, "-m", "benchmarks.proxy", "--target", f"127.0.0.1:{REDIS_PORT}",
                "--listen", f"{net.hosts['redis'].data_addr}:{PROXY_PORT}", "--rtt-ms", str(self.cfg.rtt_ms),
                "--jitter-ms", str(self.cfg.jitter_ms),
            ], self.root / "proxy.log", cwd=REPO)
        self.servers["site"] = net.spawn("site", [
            sys.executable, "-m", "benchmarks.faultsite", "--host", net.hosts["site"].web_addr or "",
            "--port", str(SITE_PORT), "--pages", str(self.cfg.pages), "--delay", str(self.cfg.page_delay),
            "--access-log", str(self.access_log),
        ], self.root / "site.log", cwd=REPO)
        self._wait_log(self.root / "site.log", "ready")
        self.wait_redis(self.master)
        if self.cfg.sentinel:
            self._wait_until(lambda: self.sentinel_master() is not None, 30, "the Sentinels' master")

    def start_redis(self, host: str, replica_of: str | None = None) -> None:
        """(Re)start the Redis of ``host``, keeping its data directory (AOF) across restarts."""
        data = self.root / f"{host}-data"
        data.mkdir(exist_ok=True)
        argv = ["redis-server", "--port", str(REDIS_PORT), "--bind", self.net.hosts[host].data_addr or "",
                "127.0.0.1", "--protected-mode", "no", "--save", "", "--dir", str(data),
                "--appendonly", "yes" if self.cfg.aof else "no"]
        if replica_of:
            argv += ["--replicaof", replica_of, str(REDIS_PORT)]
        self.servers[host] = self.net.spawn(host, argv, self.root / f"{host}.log")

    def _start_sentinel(self, port: int) -> None:
        conf = self.root / f"sentinel-{port}.conf"
        master = self.net.hosts["redis"].data_addr
        conf.write_text(textwrap.dedent(f"""\
            port {port}
            bind {self.net.hosts["sentinels"].data_addr} 127.0.0.1
            protected-mode no
            dir {self.root}
            sentinel monitor {MASTER_NAME} {master} {REDIS_PORT} 2
            sentinel down-after-milliseconds {MASTER_NAME} 2000
            sentinel failover-timeout {MASTER_NAME} 10000
            sentinel parallel-syncs {MASTER_NAME} 1
            """))
        self.servers[f"sentinel-{port}"] = self.net.spawn(
            "sentinels", ["redis-server", str(conf), "--sentinel"], self.root / f"sentinel-{port}.log"
        )

    def redis(self, host: str | None = None, fn: Any = None, timeout: float = 30) -> Any:
        """``fn(client)`` with a client of ``host``'s Redis (the current master by default), in its host."""
        import redis

        def call() -> Any:
            client = redis.Redis(host="127.0.0.1", port=REDIS_PORT, socket_timeout=10)
            try:
                return fn(client)
            finally:
                client.close()

        return self.net.call(host or self.master, call, timeout=timeout)

    def wait_redis(self, host: str, timeout: float = 30) -> None:
        def ready() -> bool:
            try:
                return bool(self.redis(host, lambda c: c.ping()))
            except Exception:
                return False

        self._wait_until(ready, timeout, f"Redis of {host}")

    def sentinel_master(self) -> str | None:
        """The host the Sentinels name as master now (asked of the first Sentinel), or None."""
        import redis

        def ask() -> Any:
            client = redis.Redis(host="127.0.0.1", port=SENTINEL_PORTS[0], socket_timeout=5)
            try:
                return client.execute_command("SENTINEL", "get-master-addr-by-name", MASTER_NAME)
            finally:
                client.close()

        try:
            reply = self.net.call("sentinels", ask)
        except Exception:
            return None
        if not reply:
            return None
        addr = reply[0].decode() if isinstance(reply[0], bytes) else reply[0]
        return next((h.name for h in self.net.hosts.values() if h.data_addr == addr), None)

    # -- workers ---------------------------------------------------------------------------------
    def worker_settings(self) -> dict[str, Any]:
        cfg = self.cfg
        settings: dict[str, Any] = {
            "CONCURRENT_REQUESTS": cfg.concurrency,
            "SCHEDULER_LEASE_SECONDS": cfg.lease,
            "SCHEDULER_IDLE_BEFORE_CLOSE": cfg.idle_close,
            "BLOOMFILTER_CAPACITY": max(10_000, cfg.pages * 4),
            # as a deployment on a shared Redis sets one: queue entries are signed and bound to the crawl
            "SCHEDULER_ENTRY_SECRET": self.secret,
            "REDIS_PARAMS": {
                "socket_timeout": cfg.socket_timeout, "socket_connect_timeout": cfg.socket_timeout,
            },
        }
        redis_host = self.net.hosts["redis"].data_addr
        if cfg.sentinel:
            addr = self.net.hosts["sentinels"].data_addr
            settings["REDIS_SENTINELS"] = ",".join(f"{addr}:{p}" for p in SENTINEL_PORTS)
            settings["REDIS_SENTINEL_MASTER"] = MASTER_NAME
        elif cfg.rtt_ms:
            settings["REDIS_URL"] = f"redis://{redis_host}:{PROXY_PORT}/0"
        else:
            settings["REDIS_URL"] = f"redis://{redis_host}:{REDIS_PORT}/0"
        return settings

    def start_worker(self, name: str, seed: bool = False) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "scrapy", "crawl", SPIDER]
        for k, v in self.worker_settings().items():
            cmd += ["-s", f"{k}={json.dumps(v) if isinstance(v, dict) else v}"]
        if seed:
            site = self.net.hosts["site"].web_addr
            cmd += ["-a", f"seed=http://{site}:{SITE_PORT}/page/0"]
        env = {**os.environ, "PYTHONPATH": _pythonpath(self.root, REPO)}
        for var in ("REDIS_URL", "SCRAPY_SETTINGS_MODULE"):
            env.pop(var, None)
        proc = self.net.spawn(
            name, cmd, self.worker_log(name), hostname=f"fault-{name}", env=env, cwd=self.root
        )
        self.workers[name] = proc
        return proc

    def worker_log(self, name: str) -> Path:
        return self.root / f"{name}.log"

    def start_workers(self) -> None:
        """The first worker with the seed; the others once the site answered its first page."""
        self.start_worker("w1", seed=True)
        self._wait_until(lambda: self.fetched() >= 1, 60, "the first page")
        for i in range(2, self.cfg.workers + 1):
            self.start_worker(f"w{i}")
        for name, proc in self.workers.items():
            log = self.worker_log(name)

            def opened(proc: subprocess.Popen[bytes] = proc, log: Path = log) -> bool:
                return proc.poll() is not None or "open as worker" in log.read_text(errors="replace")

            self._wait_until(opened, 60, f"worker {name} to open")
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"worker {name} exited at start: {tail}")

    def wait_workers(self, timeout: float) -> dict[str, int | None]:
        """Each worker's exit status; None for one still running after ``timeout`` (then killed)."""
        deadline = time.monotonic() + timeout
        codes: dict[str, int | None] = {}
        for name, proc in self.workers.items():
            try:
                codes[name] = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = None
                proc.kill()
                proc.wait()
        return codes

    # -- what happened ----------------------------------------------------------------------------
    def access(self) -> list[tuple[float, int, str]]:
        return read_access_log(self.access_log)

    def fetched(self) -> int:
        """Distinct pages answered 200 so far."""
        return len({path for _, status, path in self.access() if status == 200})

    def wait_pages(self, n: int, timeout: float = 120) -> None:
        self._wait_until(lambda: self.fetched() >= n, timeout, f"{n} pages")

    def held_by(self, name: str) -> int:
        """Leases the worker on host ``name`` holds now (its worker id begins with its hostname)."""
        from scrapy_dist.frontier.shard import lease_parts
        from scrapy_dist.redis.keys import CrawlKeys

        tag = f"fault-{name}:".encode()

        def count(client: Any) -> int:
            n = 0
            for lease in client.zrange(CrawlKeys(SPIDER).leases, 0, -1):
                _, _, worker = lease_parts(lease)
                n += bool(worker and worker.startswith(tag))
            return n

        return int(self.redis(fn=count))

    def items(self) -> list[str]:
        """The URL of every item in the items list of the current master."""
        from scrapy_dist.redis.keys import CrawlKeys

        raw = self.redis(fn=lambda c: c.lrange(CrawlKeys(SPIDER).items, 0, -1))
        return [json.loads(r).get("url", "") for r in raw]

    def status(self) -> dict[str, Any]:
        """``scrapy-dist status --json`` run in the current master's host (or its error, as a dict)."""
        cmd = ["ip", "netns", "exec", self.net.hosts[self.master].namespace, sys.executable, "-c",
               "from scrapy_dist.cli import main; main()", "--redis-url", f"redis://127.0.0.1:{REDIS_PORT}/0",
               "status", SPIDER, "--json"]
        env = {**os.environ, "PYTHONPATH": _pythonpath(REPO)}
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env, cwd=self.root)
            return json.loads(done.stdout)
        except (subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}

    # -- helpers ----------------------------------------------------------------------------------
    def _write_project(self) -> None:
        pkg = self.root / "faultbot"
        (pkg / "spiders").mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "spiders" / "__init__.py").write_text(SPIDER_CODE)
        (pkg / "settings.py").write_text(SETTINGS_CODE)
        (self.root / "scrapy.cfg").write_text("[settings]\ndefault = faultbot.settings\n")

    def _wait_log(self, log: Path, text: str, timeout: float = 30) -> None:
        self._wait_until(lambda: log.exists() and text in log.read_text(errors="replace"), timeout, text)

    @staticmethod
    def _wait_until(cond: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout:g} s for {what}")
            time.sleep(0.1)


def _pythonpath(*first: Path) -> str:
    """``first`` ahead of the inherited PYTHONPATH (the worktree under test stays importable)."""
    return os.pathsep.join(p for p in (*map(str, first), os.environ.get("PYTHONPATH")) if p)
