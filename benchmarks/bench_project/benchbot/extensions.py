"""Writes the crawl's Scrapy stats plus precise timings to ``BENCH_STATS_FILE`` when the spider closes."""

from __future__ import annotations

import datetime
import json
import os
import resource
import time
from typing import TYPE_CHECKING, Any

from scrapy import signals
from scrapy.exceptions import NotConfigured

if TYPE_CHECKING:
    from scrapy.crawler import Crawler
    from scrapy.http import Request, Response


class BenchStats:
    """Records first/last response times (``time.perf_counter``), the distinct URLs answered 200, and on
    ``spider_closed`` dumps them with every Scrapy stat and the process's CPU time as JSON."""

    def __init__(self, path: str, crawler: Crawler) -> None:
        self.path = path
        self.crawler = crawler
        self.started = time.perf_counter()
        self.engine_started: float | None = None
        self.first_response: float | None = None
        self.last_response: float | None = None
        self.ok_urls: set[str] = set()
        self.urls: set[str] = set()
        self.latencies: list[float] = []

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> BenchStats:
        path = crawler.settings.get("BENCH_STATS_FILE")
        if not path:
            raise NotConfigured("BENCH_STATS_FILE not set")
        ext = cls(path, crawler)
        crawler.signals.connect(ext.engine_started_, signal=signals.engine_started)
        crawler.signals.connect(ext.response_received, signal=signals.response_received)
        crawler.signals.connect(ext.spider_closed, signal=signals.spider_closed)
        return ext

    def engine_started_(self) -> None:
        self.engine_started = time.perf_counter()

    def response_received(self, response: Response, request: Request) -> None:
        now = time.perf_counter()
        if self.first_response is None:
            self.first_response = now
        self.last_response = now
        self.urls.add(response.url)
        if response.status == 200:
            self.ok_urls.add(response.url)
        latency = request.meta.get("download_latency")
        if latency is not None:
            self.latencies.append(latency)

    def spider_closed(self, reason: str) -> None:
        closed = time.perf_counter()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        out = {
            "reason": reason,
            "stats": {k: _jsonable(v) for k, v in self.crawler.stats.get_stats().items()},
            "ok_unique_pages": len(self.ok_urls),
            "unique_urls": len(self.urls),
            # seconds since this extension was built (process start + imports are before that)
            "t_engine_started": _rel(self.engine_started, self.started),
            "t_first_response": _rel(self.first_response, self.started),
            "t_last_response": _rel(self.last_response, self.started),
            "t_closed": closed - self.started,
            "cpu_seconds": usage.ru_utime + usage.ru_stime,
            "max_rss_mib": usage.ru_maxrss / 1024,
            "download_latency_ms": _percentiles(self.latencies),
        }
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)


def _percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    v = sorted(values)
    return {f"p{q}": 1000 * v[min(len(v) - 1, len(v) * q // 100)] for q in (50, 90, 99)} | {
        "max": 1000 * v[-1]
    }


def _rel(t: float | None, start: float) -> float | None:
    return None if t is None else t - start


def _jsonable(v: Any) -> Any:
    if isinstance(v, (datetime.datetime, datetime.date)):
        return v.isoformat()
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    return str(v)


class RecordScriptCalls:
    """Appends every Lua script call the crawl makes through ``redis.asyncio`` (scrapy-dist's sync rounds)
    to ``BENCH_SCRIPT_CALLS_FILE`` as JSON lines -- script SHA1, KEYS, ARGV (bytes as latin-1) -- and
    each script's source once to ``<file>.scripts.json``, so that ``benchmarks/replay.py`` can run the
    very same calls again, back to back, on a fresh server (what they cost a master that is never idle).
    Benchmark instrumentation only: it wraps redis-py's ``AsyncScript.__call__`` in this process."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sources: dict[str, str] = {}
        self.out = open(path, "w")  # noqa: SIM115 - open for the crawl's whole life

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> RecordScriptCalls:
        path = crawler.settings.get("BENCH_SCRIPT_CALLS_FILE")
        if not path:
            raise NotConfigured  # no message: not recording is the usual case, not worth a warning
        from redis.commands.core import AsyncScript

        ext = cls(path)
        original = AsyncScript.__call__

        async def call(script: Any, keys: Any = None, args: Any = None, client: Any = None) -> Any:
            ext.record(script, keys or [], args or [])
            return await original(script, keys=keys, args=args, client=client)

        AsyncScript.__call__ = call  # type: ignore[method-assign]
        ext.hook_library()
        crawler.signals.connect(ext.engine_stopped, signal=signals.engine_stopped)  # after every last flush
        return ext

    def hook_library(self) -> None:
        """Record the sync library's FCALLs too (Redis >= 7), as ``fcall:<function>`` with the library's
        code as its source (``benchmarks/replay.py`` loads and calls it by that name)."""
        from scrapy_dist.redis.scripts import Library

        original = Library.__call__
        ext = self

        async def call(lib: Any, keys: Any, args: Any) -> Any:
            result = await original(lib, keys, args)
            if lib.functions and not ext.out.closed:
                key = "fcall:" + lib.function
                ext.sources.setdefault(key, lib.code)
                text = [_latin1(v) for v in keys], [_latin1(v) for v in args]
                ext.out.write(json.dumps({"sha": key, "keys": text[0], "args": text[1]}) + "\n")
            return result

        Library.__call__ = call  # type: ignore[method-assign,assignment]

    def record(self, script: Any, keys: list[Any], args: list[Any]) -> None:
        if self.out.closed:
            return
        sha = script.sha
        if sha not in self.sources:
            self.sources[sha] = script.script if isinstance(script.script, str) else script.script.decode()
        text = [_latin1(v) for v in keys], [_latin1(v) for v in args]
        self.out.write(json.dumps({"sha": sha, "keys": text[0], "args": text[1]}) + "\n")

    def engine_stopped(self) -> None:
        self.out.close()
        with open(f"{self.path}.scripts.json", "w") as f:
            json.dump(self.sources, f)


def _latin1(v: Any) -> str:
    if isinstance(v, bytes):
        return v.decode("latin-1")
    return v if isinstance(v, str) else repr(v) if isinstance(v, float) else str(v)
