"""The checker of a faulted crawl: what the site served, what items Redis holds, what the workers said.

:func:`check` turns the site's access log (every request it answered), the items' URLs, the workers' logs
and exit statuses into a :class:`Verdict`: pages never fetched, items lost, duplicate items, duplicate
fetches against the bound the fault allows (what the faulted workers could hold: prefetch + in flight),
whether every surviving worker closed by itself, and the WARNING, ERROR and traceback lines of the logs.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlparse

_LEVEL = re.compile(r"\[([\w.]+)\] (WARNING|ERROR|CRITICAL): (.*)")
_BACK = re.compile(r"Redis is reachable again after ([\d.]+)s")


@dataclass
class LogSummary:
    """What one worker's log said."""

    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    tracebacks: int = 0
    finished: bool = False
    outages_s: list[float] = field(default_factory=list)  # "reachable again after N s" lines


@dataclass
class Verdict:
    """The figures of one faulted crawl (see the module docstring)."""

    pages: int
    pages_never_fetched: int
    items: int
    items_lost: int
    duplicate_items: int
    duplicate_fetches: int
    duplicate_fetch_bound: int
    closed_by_itself: bool
    warnings: int
    errors: int
    tracebacks: int
    logs: dict[str, LogSummary] = field(default_factory=dict)

    @property
    def within_bound(self) -> bool:
        return self.duplicate_fetches <= self.duplicate_fetch_bound

    def problems(self, duplicate_items_allowed: bool) -> list[str]:
        """What breaks the promise: pages or items lost, duplicates past the bound, a crawl that did not
        close, tracebacks; duplicate items too unless ``duplicate_items_allowed``."""
        out = []
        if self.pages_never_fetched:
            out.append(f"{self.pages_never_fetched} pages never fetched")
        if self.items_lost:
            out.append(f"{self.items_lost} items lost")
        if self.duplicate_items and not duplicate_items_allowed:
            out.append(f"{self.duplicate_items} duplicate items")
        if not self.within_bound:
            out.append(f"{self.duplicate_fetches} duplicate fetches > bound {self.duplicate_fetch_bound}")
        if not self.closed_by_itself:
            out.append("the crawl did not close by itself")
        if self.tracebacks:
            out.append(f"{self.tracebacks} tracebacks in the logs")
        return out

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "within_bound": self.within_bound}


def summarize_log(text: str) -> LogSummary:
    """The WARNING / ERROR lines (message only, cut to 200 characters), tracebacks and clean finish."""
    out = LogSummary()
    for line in text.splitlines():
        match = _LEVEL.search(line)
        if match:
            message = f"[{match.group(1)}] {match.group(3)[:200]}"
            (out.warnings if match.group(2) == "WARNING" else out.errors).append(message)
        elif line.startswith("Traceback"):
            out.tracebacks += 1
        back = _BACK.search(line)
        if back:
            out.outages_s.append(float(back.group(1)))
    out.finished = "Spider closed (finished)" in text
    return out


def check(
    pages: int,
    access: Iterable[tuple[float, int, str]],
    item_urls: Iterable[str],
    logs: Mapping[str, str],
    exit_codes: Mapping[str, int | None],
    faulted: Iterable[str],
    duplicate_fetch_bound: int,
) -> Verdict:
    """The :class:`Verdict` of a crawl of a site of ``pages`` pages (``/page/0`` .. ``/page/<pages-1>``).

    ``exit_codes``: each worker's exit status (None: did not exit in time); ``faulted``: the workers the
    harness killed, whose status does not count for closing by itself.
    """
    fetches = Counter(path for _, _, path in access)
    served = {path for _, status, path in access if status == 200}
    expected = {f"/page/{i}" for i in range(pages)}
    items = Counter(urlparse(url).path for url in item_urls)
    summaries = {name: summarize_log(text) for name, text in logs.items()}
    killed = set(faulted)
    closed = all(code == 0 for name, code in exit_codes.items() if name not in killed)
    return Verdict(
        pages=pages,
        pages_never_fetched=len(expected - served),
        items=sum(items.values()),
        items_lost=len(expected - set(items)),
        duplicate_items=sum(n - 1 for n in items.values()),
        duplicate_fetches=sum(n - 1 for n in fetches.values()),
        duplicate_fetch_bound=duplicate_fetch_bound,
        closed_by_itself=closed,
        warnings=sum(len(s.warnings) for s in summaries.values()),
        errors=sum(len(s.errors) for s in summaries.values()),
        tracebacks=sum(s.tracebacks for s in summaries.values()),
        logs=summaries,
    )
