"""Crawl-wide error monitoring (docs/monitoring.md, "Error monitor"): each worker counts attempts and errors
from Scrapy's signals; every ``CLUSTERSTATS_INTERVAL`` one ``errors.lua`` call adds them to per-bucket
counters and answers the window's totals. Past a threshold, exactly one worker takes ``ERRORMONITOR_ACTION``
(``log``, ``pause`` or ``close``), at most once per window."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from scrapy_dist.exceptions import ReleasedAtClose, ScrapyDistError
from scrapy_dist.extensions.clusterstats import PeriodicExtension, worker_id
from scrapy_dist.frontier.engine import engine_of
from scrapy_dist.frontier.layout import ControlState
from scrapy_dist.frontier.scheduler import get_scheduler
from scrapy_dist.redis.scripts import text
from scrapy_dist.settings import defaults
from scrapy_dist.utils import RateLimitedLog

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.crawler import Crawler
    from scrapy.http import Response
    from twisted.python.failure import Failure

logger = logging.getLogger(__name__)

#: The close reason of every worker when the action is ``close`` (set by ``errors.lua``).
CLOSE_REASON = "error_threshold"
EXAMPLES_PER_REASON = 3  #: Examples of each reason sent per flush ...
EXAMPLES_KEPT = 50  #: ... and kept crawl-wide for alerts.
BUCKETS = 30  #: Buckets per window: the window slides in steps of window / BUCKETS (at least one second).


def http_error_matcher(spec: list[Any]) -> Any:
    """A predicate on status codes from ``ERRORMONITOR_HTTP_ERRORS`` items: numbers or classes (``5xx``)."""
    codes, classes = set[int](), set[int]()
    for item in spec:
        text = str(item).strip().lower()
        if len(text) == 3 and text.endswith("xx") and text[0].isascii() and text[0].isdigit():
            classes.add(int(text[0]))
        elif text.isascii() and text.isdigit():
            codes.add(int(text))
        elif text:
            raise ScrapyDistError(f"ERRORMONITOR_HTTP_ERRORS: {item!r} is not a status code or like '5xx'")
    return lambda status: status in codes or status // 100 in classes


class ErrorCounts:
    """One worker's error events since its last flush (pure: no I/O, time is a parameter)."""

    def __init__(self, is_http_error: Any, worker: str = "") -> None:
        self.is_http_error, self.worker = is_http_error, worker
        self.counts: Counter[str] = Counter()
        self.examples: list[str] = []
        self._examples_per_reason: Counter[str] = Counter()

    def _error(self, kind: str, reason: str, url: str, now: float) -> None:
        self.counts.update(("errors", kind, f"r:{reason}"))
        if self._examples_per_reason[reason] < EXAMPLES_PER_REASON:
            self._examples_per_reason[reason] += 1
            self.examples.append(json.dumps({"at": round(now, 3), "kind": kind, "reason": reason,
                                             "url": url[:1000], "worker": self.worker}))

    def response(self, status: int, url: str, now: float) -> None:
        self.counts["attempts"] += 1
        if self.is_http_error(status):
            self._error("http", f"http/{status}", url, now)

    def download_error(self, exc_name: str, url: str, now: float) -> None:
        self.counts["attempts"] += 1
        self._error("download", f"download/{exc_name}", url, now)

    def spider_error(self, exc_name: str, url: str, now: float) -> None:
        self._error("spider", f"spider/{exc_name}", url, now)

    def take(self) -> tuple[dict[str, int], list[str]]:
        """The counts and examples so far, and start afresh."""
        counts, examples = dict(self.counts), self.examples
        self.counts, self.examples = Counter(), []
        self._examples_per_reason.clear()
        return counts, examples

    def give_back(self, counts: dict[str, int], examples: list[str]) -> None:
        """Put back what a failed flush took, so it goes with the next one."""
        self.counts.update(counts)
        self.examples = (examples + self.examples)[-EXAMPLES_KEPT:]


def format_alert(spider: str, totals: dict[str, int], examples: list[str], window: float, action: str,
                 top: int = 5) -> str:
    """The alert text: totals, the top reasons and an example URL for each."""
    errors, attempts = totals.get("errors", 0), totals.get("attempts", 0)
    rate = f" ({errors / attempts:.0%} of {attempts} attempts)" if attempts else ""
    reasons = sorted(((n, k[2:]) for k, n in totals.items() if k.startswith("r:")), reverse=True)[:top]
    by_reason: dict[str, str] = {}
    for raw in reversed(examples):
        try:
            rec = json.loads(raw)
        except ValueError:
            continue
        by_reason.setdefault(rec.get("reason", ""), rec.get("url", ""))
    lines = [f"Error threshold passed for {spider!r}: {errors} errors crawl-wide in the last"
             f" {window:.0f}s{rate}.", "Top reasons:"]
    for n, reason in reasons:
        example = by_reason.get(reason)
        lines.append(f"  {reason}: {n}" + (f" (e.g. {example})" if example else ""))
    if action == "pause":
        lines.append(f"The crawl is paused: every worker stops taking new requests until `scrapy-dist resume"
                     f" {spider}`.")
    elif action == "close":
        lines.append("Every worker is closing (reason error_threshold).")
    return "\n".join(lines)


class ErrorMonitor(PeriodicExtension):
    """Scrapy extension: crawl-wide error window, alert, pause or close (see the module docstring); without
    a threshold it still counts (for ``scrapy-dist status``). Stats: ``errormonitor/tripped``."""

    script, what = "errors", "error monitor"
    handlers = ("response_downloaded", "request_left_downloader", "spider_error", "spider_opened",
                "spider_closed")

    def __init__(self, crawler: Crawler) -> None:
        super().__init__(crawler)
        self.config = c = self.settings.monitoring
        self.interval = c.interval or defaults.CLUSTERSTATS_INTERVAL
        self.bucket = max(1.0, c.window / BUCKETS)
        self.events = ErrorCounts(http_error_matcher(list(c.http_errors)))
        self.totals: dict[str, int] = {}
        self._answered: set[int] = set()
        self._local_pause = False
        self._garbage_log = RateLimitedLog.once(logger)

    def response_downloaded(self, response: Response, request: Request) -> None:
        self._answered.add(id(request))
        self.events.response(response.status, response.url, time.time())

    def request_left_downloader(self, request: Request) -> None:
        if id(request) in self._answered:
            self._answered.discard(id(request))
            return
        # sent from the downloader's `finally`: the download's exception, if any, is still in flight
        exc = sys.exc_info()[1]
        if isinstance(exc, ReleasedAtClose):  # not an error: given back to the queue as the worker closes
            return
        name = type(exc).__name__ if exc is not None else "error"
        self.events.download_error(name, request.url, time.time())

    def spider_error(self, failure: Failure, response: Response | Failure) -> None:
        url = getattr(response, "url", "") or getattr(getattr(failure, "request", None), "url", "")
        self.events.spider_error(type(failure.value).__name__, url, time.time())

    async def opened(self) -> None:
        self.events.worker = worker_id(self.crawler)
        await super().opened()

    async def closed(self, reason: str) -> None:
        try:
            # a finished crawl that does not persist has its keys removed: write none back
            if self.settings.scheduler.persist or reason != "finished":
                await self.flush()
        except Exception as exc:
            logger.warning("Could not send the last error counts to %s: %s", self.keys.errors, exc)

    async def flush(self, now: float | None = None) -> bool:
        """Send the new counts, get the window's totals, act on them (one script call); True if it tripped."""
        counts, examples = self.events.take()
        c = self.config
        args: list[Any] = ["" if now is None else repr(now), repr(self.bucket), repr(c.window),
                           "" if c.max_errors is None else c.max_errors,
                           "" if c.max_error_rate is None else repr(c.max_error_rate), c.min_attempts,
                           c.action, EXAMPLES_KEPT, len(counts), *(x for kv in counts.items() for x in kv),
                           *examples]
        keys = [self.keys.errors, self.keys.error_examples, self.keys.control]
        try:
            tripped, server_now, flat, control, kept, garbage = await self._script(keys=keys, args=args)
        except BaseException:
            self.events.give_back(counts, examples)
            raise
        self.totals = {text(flat[i]): int(float(flat[i + 1])) for i in range(0, len(flat), 2)}
        if garbage:
            self._garbage_log.log(logging.WARNING, "Deleted %d fields of %s no worker writes (written by"
                                  " someone else?): buckets ahead of now, counts that are not whole numbers,"
                                  " other names", garbage, self.keys.errors)
        if tripped:
            self.crawler.stats.inc_value("errormonitor/tripped")
            kept_text = [text(x) for x in kept]
            logger.error(format_alert(self.keys.spider, self.totals, kept_text, c.window, c.action))
        close, close_at, paused = (text(x) for x in control)
        if self.closing:
            return bool(tripped)
        self._follow_pause(paused == "1")
        # the error monitor acts on its own decision; IdleMonitor relays every kind of close decision
        decision = ControlState.from_hash({"close": close, "close_at": close_at})
        closes = decision.close == CLOSE_REASON and decision.close_reason(self.started_at, float(server_now))
        if closes and self.close_spider(close):
            logger.warning("Closing: the error monitor closed the crawl crawl-wide (%s)", close)
        return bool(tripped)

    tick = flush

    def _follow_pause(self, paused: bool) -> None:
        """Without the scrapy-dist scheduler (which pauses itself), pause this worker's engine."""
        if (get_scheduler(self.crawler) is not None or paused == self._local_pause
                or (engine := engine_of(self.crawler)) is None):
            return
        self._local_pause = paused
        if paused:
            engine.pause()
            logger.warning("The crawl is paused crawl-wide; `scrapy-dist resume %s` resumes it",
                           self.keys.spider)
        else:
            engine.unpause()
            logger.info("The crawl was resumed")

