"""Prometheus metrics of running crawls (docs/monitoring.md lists them): :class:`CrawlCollector` reads each
crawl's :func:`~scrapy_dist.monitor.read_status` and newest dead letters, cached so several scrapers cost one
read, with bounded label sets (workers, ``top_domains``, reasons); :func:`serve` serves it."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from scrapy_dist.monitor import REASON_LIMIT, finite, read_status, top_counts
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.redis.outage import READ_ERRORS, ToolOutage
from scrapy_dist.utils import RateLimitedLog

__all__ = ["DEAD_LETTER_SAMPLE", "REASON_LIMIT", "CrawlCollector", "serve"]

DEAD_LETTER_SAMPLE = 500  #: Dead letters read per scrape (the newest) to count them by reason.
#: Crawl-wide Scrapy stats exported as counters: stat name -> metric name.
STAT_COUNTERS = {
    "response_received_count": "scrapy_dist_pages_total", "item_scraped_count": "scrapy_dist_items_total",
    "item_dropped_count": "scrapy_dist_items_dropped_total",
    "scheduler/enqueued": "scrapy_dist_requests_enqueued_total",
    "downloader/response_bytes": "scrapy_dist_downloaded_bytes_total",
    "log_count/ERROR": "scrapy_dist_log_errors_total"}
#: Prefixes of the Scrapy stats counted as errors, and the reason label they give.
ERROR_STATS = {"downloader/exception_type_count/": "download:", "spider_exceptions/": "spider:",
               "downloader/response_status_count/": "http:"}
logger = logging.getLogger(__name__)


class CrawlCollector(Collector):
    """Metrics of the crawls of ``spiders`` (``keys_of(spider)`` gives a crawl's keys) in one Redis."""

    def __init__(self, client: Any, spiders: Iterable[str], keys_of: Callable[[str], CrawlKeys] = CrawlKeys,
                 *, cache_seconds: float = 5.0, top_domains: int = 10,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client, self.spiders, self.keys_of = client, list(spiders), keys_of
        self.cache_seconds, self.top_domains, self.clock = cache_seconds, top_domains, clock
        self.reads = 0  #: Redis reads done (one per crawl and cache period)
        self._cache: tuple[float, list[tuple[str, dict[str, Any] | None]]] | None = None
        self._lock = threading.Lock()  # the HTTP server scrapes from several threads
        #: one WARNING when Redis goes away, one INFO when it is back (scrapy_dist_up says it meanwhile)
        self.outage = ToolOutage("metrics exporter")
        #: an unforeseen error building a crawl's metrics: logged once per crawl, then only counted
        self.errors = RateLimitedLog.once(logger)

    def snapshots(self) -> list[tuple[str, dict[str, Any] | None]]:
        """``(spider, status or None if Redis failed)`` per crawl, cached."""
        with self._lock:
            now = self.clock()
            if self._cache is None or now - self._cache[0] >= self.cache_seconds:
                self._cache = (now, [self._read(spider) for spider in self.spiders])
            return self._cache[1]

    def _read(self, spider: str) -> tuple[str, dict[str, Any] | None]:
        self.reads += 1
        try:
            status = read_status(self.client, self.keys_of(spider), lease_scan_limit=0,
                                 domain_limit=self.top_domains, dead_sample=DEAD_LETTER_SAMPLE)
        except READ_ERRORS as exc:
            self.outage.failed(exc, self.clock())
            return spider, None
        except Exception:  # garbage no parser foresaw: this crawl reads as down, the others are served
            self.errors.log(logging.ERROR, "Could not read %r's state", spider, key=spider, exc_info=True)
            return spider, None
        self.outage.succeeded(self.clock())
        return spider, status

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Any] = {}
        for spider, s in self.snapshots():
            g = _Families(spider)
            try:
                if s is not None:
                    self._crawl(g, s)
            except Exception:  # a value no check foresaw: this crawl's figures are lost, not the others'
                self.errors.log(logging.ERROR, "Metrics of %r could not be built", spider, key=spider,
                                exc_info=True)
                g, s = _Families(spider), None
            g.gauge("scrapy_dist_up", "1 if the crawl's state could be read from Redis", float(s is not None))
            if s is not None:
                g.gauge("scrapy_dist_skipped_values", "Values read from Redis and left out: numbers not"
                        " finite or out of range, overlong stats names, stats beyond the limit",
                        float(g.skipped + s["garbage"].get("stats", 0)))
            for name, family in g.families.items():
                if families.setdefault(name, family) is not family:
                    families[name].samples.extend(family.samples)
        yield from families.values()

    def _crawl(self, g: _Families, s: dict[str, Any]) -> None:
        for state in ("queued", "inflight", "delayed"):
            g.gauge("scrapy_dist_frontier_requests", "Requests in the shared frontier, by state",
                    s["frontier"][state], state=state)
        for state in ("waiting", "processing"):
            g.gauge("scrapy_dist_seeds", "Seeds in the seeds key (waiting) or taken by a worker and not"
                    " yet in the frontier (processing)", s["seeds"][state], state=state)
        for what, n in s["rejected"].items():
            g.gauge("scrapy_dist_rejected_entries", "Seeds and queue entries parked as rejected (lists capped"
                    " by their MAXLEN settings)", n, kind=what)
        g.gauge("scrapy_dist_dead_letters", "Requests in the dead-letter list", s["deadletter"])
        for reason, n in s["dead_reasons"].items():
            g.gauge("scrapy_dist_dead_letters_by_reason", f"Dead letters by reason, among the newest"
                    f" {DEAD_LETTER_SAMPLE}", n, reason=reason)
        filt = s["filter"] or {}
        g.gauge("scrapy_dist_filter_items", "Fingerprints in the dupefilter", filt.get("items"))
        g.gauge("scrapy_dist_filter_fill_ratio", "Bloom filter items / capacity", filt.get("fill"))
        g.gauge("scrapy_dist_filter_false_positive_ratio", "Estimated false-positive rate of the dupefilter"
                " at its current fill", filt.get("fpr_estimate"))
        g.gauge("scrapy_dist_filter_memory_bytes", "Bloom filter size", filt.get("memory_bytes"))
        g.gauge("scrapy_dist_paused", "1 while the crawl is paused", 1.0 if s["control"]["paused"] else 0.0)
        for state, n in s["workers_summary"].items():
            if state != "total":
                g.gauge("scrapy_dist_workers", "Workers by state (running, lost, closed)", n, state=state)
        self._stats(g, s["stats"])
        g.gauge("scrapy_dist_error_ratio", "Errors / attempts over the error monitor's window",
                s["errors"].get("error_rate"))
        for w in s["workers"]:
            self._worker(g, w)
        for d in s["domains"][: self.top_domains]:
            g.gauge("scrapy_dist_domain_backlog_requests", f"Queued requests of the {self.top_domains}"
                    " busiest domains (crawl-wide politeness)", d["backlog"], domain=d["domain"])

    @staticmethod
    def _stats(g: _Families, stats: dict[str, Any]) -> None:
        for stat, name in STAT_COUNTERS.items():
            g.counter(name, f"Scrapy stat {stat}, summed over every worker", stats.get(stat))
        reasons: Counter[str] = Counter()
        for stat, value in stats.items():
            for prefix, label in ERROR_STATS.items():
                code = stat.removeprefix(prefix)
                counted = label != "http:" or code.startswith(("4", "5"))
                if code != stat and counted and finite(value) is not None:
                    reasons[label + code.rsplit(".", 1)[-1][:60]] += int(value)
        for reason, n in top_counts(reasons, REASON_LIMIT, 70):
            g.counter("scrapy_dist_errors_total", "Download exceptions, spider exceptions and HTTP 4xx/5xx"
                      " responses, by reason", n, reason=reason)

    @staticmethod
    def _worker(g: _Families, w: dict[str, Any]) -> None:
        wid = w["id"]
        g.counter("scrapy_dist_worker_pages_total", "Pages this worker crawled", w.get("pages"), worker=wid)
        g.counter("scrapy_dist_worker_items_total", "Items this worker scraped", w.get("items"), worker=wid)
        g.gauge("scrapy_dist_worker_leases", "Requests this worker holds (per its heartbeat)",
                w.get("leases"), worker=wid)
        g.gauge("scrapy_dist_worker_last_seen_timestamp_seconds", "Unix time of the worker's last heartbeat",
                w["last_seen"], worker=wid)
        g.gauge("scrapy_dist_worker_up", "1 while the worker is running (not lost or closed)",
                1.0 if w["state"] == "running" else 0.0, worker=wid)


class _Families:
    """One crawl's metric families, one sample at a time (labels: ``spider`` then the rest); ``None`` gives no
    sample, any other value that is no finite number within range is left out and counted in ``skipped``."""

    def __init__(self, spider: str) -> None:
        self.spider, self.skipped = spider, 0
        self.families: dict[str, Any] = {}

    def _add(self, cls: type, name: str, doc: str, raw: Any, labels: dict[str, str]) -> None:
        if raw is None:
            return
        if (value := finite(raw)) is None:
            self.skipped += 1
            return
        if (family := self.families.get(name)) is None:
            family = self.families[name] = cls(name, doc, labels=["spider", *labels])
        family.add_metric([self.spider, *labels.values()], value)

    def gauge(self, name: str, doc: str, value: Any, **labels: str) -> None:
        self._add(GaugeMetricFamily, name, doc, value, labels)

    def counter(self, name: str, doc: str, value: Any, **labels: str) -> None:
        # CounterMetricFamily takes the name without ``_total`` and adds it to the sample
        self._add(CounterMetricFamily, name.removesuffix("_total"), doc, value, labels)


def serve(collector: CrawlCollector, host: str, port: int) -> Any:
    """Serve ``/metrics`` for ``collector`` on ``host:port`` in a background thread; returns the server."""
    from prometheus_client import CollectorRegistry, start_http_server
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return start_http_server(port, addr=host, registry=registry)[0]
