"""``scrapy-dist demo``: a generated local site, an embedded Redis and several workers, one killed, with a
report of what was crawled and lost (``demo.site`` is also the site the tests and benchmarks crawl).

This module holds what the demo shows (the live view and the summary with its verdict; no I/O) and what it
does in its Redis besides the crawl: wait for a loading server, look into the bloom filter to explain a lost
page, clean up after the run. May import anything below ``cli``.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Group
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from scrapy_dist.redis.embedded import DEFAULT_DIRNAME, EmbeddedRedis
from scrapy_dist.redis.keys import CrawlKeys

if TYPE_CHECKING:
    from scrapy_dist.demo.site import SiteGraph

#: The path of a page of the site; other paths (``/robots.txt``) do not count.
PAGE_PATH = re.compile(r"/page/(\d+)$")
#: Lost pages named (and explained) below the summary.
LOST_SHOWN = 10


# -- the summary --------------------------------------------------------------------------------------
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
    dead_letters: int  #: records in the crawl's dead-letter list
    dead_reasons: dict[str, int]  #: dead letters per reason
    elapsed: float  #: seconds from the seed push until every worker had closed
    crawl_seconds: float | None  #: seconds from the seed push until the last new page was answered
    workers_started: int
    workers_killed: int
    workers_failed: list[str]  #: "worker 2 (pid 123): exit status 1"
    timed_out: bool
    lost_pages: list[int] = field(default_factory=list)  #: the first :data:`LOST_SHOWN` lost pages

    @property
    def ok(self) -> bool:
        return self.lost == 0 and not self.workers_failed and not self.timed_out


def summarize(
    graph: SiteGraph,
    answers_200: Mapping[str, int],
    answers_503: Mapping[str, int],
    dead_reasons: Mapping[str, int],
    *,
    elapsed: float,
    crawl_seconds: float | None = None,
    workers_started: int = 0,
    workers_killed: int = 0,
    workers_failed: list[str] | None = None,
    timed_out: bool = False,
) -> Summary:
    """The summary from what the site answered (path -> count, e.g. ``SiteServer.fetch_counts(200)``) and
    the dead-letter reasons. Pure: no I/O."""
    ok_counts: Counter[int] = Counter()
    for path, n in answers_200.items():
        m = PAGE_PATH.match(path)
        if m is not None and n > 0:
            ok_counts[int(m.group(1))] += n
    existing = [i for i in ok_counts if 0 <= i < graph.pages and i not in graph.missing]
    crawled = len(existing)
    lost_pages: list[int] = []
    if crawled < graph.ok_pages:
        lost_pages = [i for i in range(graph.pages) if i not in graph.missing and i not in ok_counts]
    retried = sum(n for path, n in answers_503.items() if PAGE_PATH.match(path))
    return Summary(
        site_pages=graph.pages,
        ok_pages=graph.ok_pages,
        missing=len(graph.missing),
        crawled=crawled,
        lost=graph.ok_pages - crawled,
        duplicates=sum(n - 1 for n in ok_counts.values()),
        retried=retried,
        dead_letters=sum(dead_reasons.values()),
        dead_reasons=dict(dead_reasons),
        elapsed=elapsed,
        crawl_seconds=crawl_seconds,
        workers_started=workers_started,
        workers_killed=workers_killed,
        workers_failed=list(workers_failed or []),
        timed_out=timed_out,
        lost_pages=lost_pages[:LOST_SHOWN],
    )


def dead_letter_reasons(records: list[Any]) -> Counter[str]:
    """Count dead-letter records (JSON, as read from the list) per ``reason``; unreadable ones count as
    ``unreadable``."""
    out: Counter[str] = Counter()
    for raw in records:
        try:
            reason = json.loads(raw)["reason"]
        except (ValueError, TypeError, KeyError):
            reason = "unreadable"
        out[str(reason)] += 1
    return out


def verdict(s: Summary) -> tuple[str, str]:
    """The last line of the summary and its style: OK, or what failed."""
    if s.ok:
        return "OK: nothing lost.", "bold green"
    failed = (
        (f"{s.lost:,} pages lost", s.lost),
        (f"{len(s.workers_failed)} workers failed", s.workers_failed),
        ("timed out", s.timed_out),
    )
    return "FAILED: " + "; ".join(reason for reason, bad in failed if bad) + ".", "bold red"


def lost_lines(urls: list[str], claimed: list[bool] | None, total: int) -> list[str]:
    """One line per lost page: did the crawl's bloom filter take it for a page already seen (``claimed``,
    ``None`` if that could not be read), and how many more were lost than are named."""
    lines = []
    for i, url in enumerate(urls):
        if claimed is not None and claimed[i]:
            why = ("the crawl's bloom filter took it for a page already seen (a false positive:"
                   " it was never queued; see BLOOMFILTER_ERROR_RATE)")
        else:
            why = "never answered 200 and not in the bloom filter: see the worker logs"
        lines.append(f"lost: {url} -- {why}")
    if total > len(urls):
        lines.append(f"... and {total - len(urls):,} more lost pages")
    return lines


def render_summary(s: Summary) -> Table:
    """The summary as a two-column table (plus notes) that reads the same on any terminal width."""
    table = Table(title="Summary", title_justify="left", show_header=False, box=box.SIMPLE, padding=(0, 1))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(justify="right", no_wrap=True)
    table.add_column(style="dim")
    table.add_row(
        "pages crawled", f"{s.crawled:,} of {s.ok_pages:,}",
        f"site: {s.site_pages:,} pages, {s.missing} missing (404)",
    )
    table.add_row(
        Text("lost (must be 0)", style="bold"),
        Text(f"{s.lost:,}", style="bold green" if s.lost == 0 else "bold red"),
        "existing pages never answered 200",
    )
    table.add_row(
        "duplicate fetches", f"{s.duplicates:,}",
        "done by a killed worker, not acknowledged",
    )
    table.add_row(
        "retried", f"{s.retried:,}", "flaky pages' 503s, retried via the frontier"
    )
    reasons = ", ".join(f"{r}: {n}" for r, n in sorted(s.dead_reasons.items()))
    if reasons and s.missing:
        reasons += " (each missing page at least once)"
    table.add_row("dead letters", f"{s.dead_letters:,}", reasons)
    note = ""
    if s.crawl_seconds:
        note = f"last new page at {s.crawl_seconds:.1f} s ({s.crawled / s.crawl_seconds:,.0f} pages/s)"
    table.add_row("elapsed", f"{s.elapsed:.1f} s", note)
    table.add_row(
        "workers", f"{s.workers_started}",
        f"{s.workers_killed} killed by chaos, {len(s.workers_failed)} failed",
    )
    return table


# -- the live view ------------------------------------------------------------------------------------
@dataclass
class WorkerRow:
    """One row of the live view's workers table."""

    number: int
    pid: int
    state: str
    pages: int | None
    rate: float | None
    leases: int | None


@dataclass
class Snapshot:
    """Everything the live view shows at one moment."""

    elapsed: float
    crawled: int
    total: int
    rate: float
    queued: int | None
    inflight: int | None
    delayed: int | None
    dead_letters: int | None
    retried: int
    duplicates: int
    workers: list[WorkerRow] = field(default_factory=list)
    redis_error: str = ""
    #: leases the killed worker still holds in Redis, and seconds until they have surely run out
    orphaned: int = 0
    orphaned_expire_in: float = 0.0


def _num(value: int | float | None, fmt: str = ",") -> str:
    return "-" if value is None else format(value, fmt)


def combined_rate(workers: list[WorkerRow], fallback: float) -> float:
    """The crawl-wide pages/s: the sum of the per-worker rates shown (one source, so the two always
    agree); ``fallback`` (the site's count) before any worker has a rate."""
    rates = [w.rate for w in workers if w.rate is not None]
    return sum(rates) if rates else fallback


def orphan_note(s: Snapshot) -> str:
    """Why the crawl seems to stand still after the chaos kill: it waits for the killed worker's leases
    to run out (then any worker's next sync puts them back in the queue). ``""`` when nothing waits."""
    if not s.orphaned:
        return ""
    when = f"in {s.orphaned_expire_in:.0f} s" if s.orphaned_expire_in >= 0.5 else "now"
    return f"waiting for the killed worker's {s.orphaned:,} leases to expire: back in the queue {when}"


def render_live(s: Snapshot) -> Group:
    """The live view: progress bar, crawl-wide figures, one row per worker (about 75 columns wide)."""
    head = Table.grid(padding=(0, 1))
    head.add_row(
        ProgressBar(total=max(1, s.total), completed=s.crawled, width=36),
        Text(f"{s.crawled:,} / {s.total:,} pages", style="bold"),
        f"{s.crawled / max(1, s.total):4.0%}",
        Text(f"{s.elapsed:5.1f} s", style="dim"),
    )
    figures = Text.assemble(
        (f"{s.rate:,.0f}", "bold"), " pages/s   queued ", (_num(s.queued), "bold"),
        "   in flight ", (_num(s.inflight), "bold"), "   delayed ", (_num(s.delayed), "bold"),
        "\nretried ", (f"{s.retried:,}", "bold"), "   duplicate fetches ", (f"{s.duplicates:,}", "bold"),
        "   dead letters ", (_num(s.dead_letters), "bold"),
    )
    if s.orphaned:
        figures.append("\n" + orphan_note(s), style="yellow")
    if s.redis_error:
        figures.append(f"\nRedis: {s.redis_error}", style="red")
    workers = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    workers.add_column("worker", justify="right")
    workers.add_column("pid", justify="right")
    workers.add_column("state", no_wrap=True)
    workers.add_column("pages", justify="right")
    workers.add_column("pages/s", justify="right")
    workers.add_column("leases", justify="right")
    styles = {"running": "green", "killed": "bold red", "failed": "bold red", "starting": "yellow"}
    for w in s.workers:
        workers.add_row(
            str(w.number), str(w.pid), Text(w.state, style=styles.get(w.state.split()[0], "dim")),
            _num(w.pages), _num(w.rate, ",.0f"), _num(w.leases),
        )
    return Group(head, figures, workers)


def progress_line(s: Snapshot) -> str:
    """The live view as one plain line, for output that is not a terminal."""
    running = sum(1 for w in s.workers if w.state in ("running", "starting"))
    return (
        f"[{s.elapsed:6.1f}s] {s.crawled:,}/{s.total:,} pages ({s.crawled / max(1, s.total):.0%})"
        f"  {s.rate:,.0f} pages/s  queued {_num(s.queued)}  in flight {_num(s.inflight)}"
        f"  delayed {_num(s.delayed)}  retried {s.retried:,}  workers running {running}"
        + (f"  ({orphan_note(s)})" if s.orphaned else "")
    )


def open_redis(
    redis_url: str | None, project: Path, loading_timeout: float
) -> tuple[Any, str, EmbeddedRedis | None, bool]:
    """A client of ``redis_url``, or of the project's embedded Redis (started if needed): returns the
    client, the URL, the embedded server (or ``None``) and whether this call started it.

    Raises :class:`~scrapy_dist.exceptions.RedisUnavailable` (one line naming the URL) if it does not
    answer; a server started here is stopped again then."""
    from scrapy_dist.redis.connection import check_reachable, get_redis

    embedded, started = None, False
    if not redis_url:
        # The directory every `scrapy crawl` in the project would use (REDIS_EMBEDDED_DIR unset).
        embedded = EmbeddedRedis(project / ".scrapy" / DEFAULT_DIRNAME)
        redis_url, started = embedded.ensure_running()
    settings = {"REDIS_URL": redis_url}
    client = get_redis(settings)
    wait_loaded(client, loading_timeout)
    try:
        check_reachable(client, settings)
    except Exception:
        client.close()
        if started and embedded is not None:
            embedded.shutdown()
        raise
    return client, redis_url, embedded, started


def wait_loaded(client: Any, timeout: float) -> None:
    """Wait up to ``timeout`` seconds while the server is loading its data file.

    A server that just started may still be loading: PING answers LOADING until it is done
    (EmbeddedRedis.ensure_running() returns as soon as it answers at all). Any other error ends the wait;
    the caller's reachability check reports it.
    """
    from redis.exceptions import BusyLoadingError, RedisError

    deadline = time.monotonic() + timeout
    while True:
        try:
            client.ping()
            return
        except BusyLoadingError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)
        except (RedisError, OSError):
            return


def bloom_claims(client: Any, keys: CrawlKeys, urls: list[str]) -> list[bool] | None:
    """Whether the crawl's bloom filter holds each URL (no writes), or ``None`` if the crawl has no
    bloom filter. Fingerprints as the workers make them (Scrapy's default fingerprinter)."""
    from scrapy import Request
    from scrapy.utils.request import RequestFingerprinter

    from scrapy_dist.dupefilter import BloomDupeFilter

    capacity, error_rate, block_bits, n = client.hmget(
        keys.bloom, ["capacity", "error_rate", "block_bits", "n"]
    )
    if capacity is None:
        return None
    df = BloomDupeFilter(
        client, keys, RequestFingerprinter(),
        capacity=int(capacity), error_rate=float(error_rate), block_bits=int(block_bits),
    )
    df.observe(int(n or 0))
    return df.seen_tokens([df.tokens(Request(u)) for u in urls], add=False)


def others_connected(client: Any) -> bool:
    """Whether clients other than this process's are connected to the Redis (two round trips)."""
    me = client.client_id()
    return any(int(c.get("id", me)) != me for c in client.client_list())


def compact(client: Any, timeout: float = 10.0) -> None:
    """Rewrite the embedded server's append-only file before stopping it: every run writes (and then
    deletes) tens of thousands of entries, which the file would otherwise keep -- and replay at every
    start -- until it reaches Redis's 64 MB rewrite threshold."""
    client.bgrewriteaof()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = client.info("persistence")
        if not info.get("aof_rewrite_in_progress") and not info.get("aof_rewrite_scheduled"):
            return
        time.sleep(0.05)


def delete_keys(client: Any, prefix: str) -> int:
    """Delete a run's keys (every key holding its unique ``prefix``). Returns how many."""
    batch: list[Any] = []
    deleted = 0
    for key in client.scan_iter(match=f"*{prefix}*", count=1000):
        batch.append(key)
        if len(batch) >= 500:
            deleted += client.delete(*batch)
            batch = []
    if batch:
        deleted += client.delete(*batch)
    return deleted


def release_run(client: Any, prefix: str, started_redis: bool) -> bool:
    """After a run: delete its keys and close ``client``; if the demo started the server
    (``started_redis``) and nobody else uses it now, compact its data file first. Returns whether the
    server should be stopped. Never raises: the clean-up must finish whatever state Redis is in."""
    stop = started_redis
    with contextlib.suppress(Exception):
        delete_keys(client, prefix)
    if stop:
        # Another demo (or crawl) of the project may have joined the server meanwhile: keep it up.
        with contextlib.suppress(Exception):
            stop = not others_connected(client)
    if stop:
        with contextlib.suppress(Exception):
            compact(client)
    with contextlib.suppress(Exception):
        client.close()
    return stop
