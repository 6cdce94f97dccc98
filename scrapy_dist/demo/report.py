"""What the demo shows: the live view while it runs and the summary (the verdict) at the end; no I/O."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.console import Group
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from scrapy_dist.demo.site import PAGE_PATH, SiteGraph

__all__ = [
    "LOST_SHOWN",
    "Snapshot",
    "Summary",
    "WorkerRow",
    "combined_rate",
    "dead_letter_reasons",
    "lost_lines",
    "orphan_note",
    "progress_line",
    "render_live",
    "render_summary",
    "summarize",
    "verdict",
]

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
