"""Rounds of 4 throttled synthetic workers counted by what made each due, with their leases' results.

Run from the repository's root: ``python benchmarks/results/2026-11-29-capacity-window/rounds_by_trigger.py
process`` (or ``cluster``: crawl-wide politeness). See rounds-by-trigger.md next to it.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from redis_servers import RedisProcess  # noqa: E402

from benchmarks import capacity  # noqa: E402
from scrapy_dist.frontier import syncloop  # noqa: E402

WORKERS, RATE, RUN_S, WINDOW = 4, 100.0, 20.0, (14.0, 20.0)
triggers: collections.Counter[str] = collections.Counter()
leases: list[tuple[int, int, Any]] = []
window = [0.0, 0.0]
original_due, original_turn = syncloop.SyncLoop.due, syncloop.SyncLoop._turn


def due(self: Any, now: float) -> tuple[bool, int]:
    """The loop's own decision, and which of its conditions held (the same tests as ``SyncLoop.due``)."""
    answer = original_due(self, now)
    if answer[0] and window[0] <= now <= window[1]:
        ledger, cfg = self.ledger, self.config
        fetch = len(ledger.ready) < max(1, self.prefetch // 2) and now >= self.next_fetch
        flush = (ledger.first_pending is not None and now - ledger.first_pending >= cfg.flush_interval
                 or len(ledger.out) >= cfg.flush_batch or ledger.outranked() > 0 or ledger.left_behind > 0)
        parts = [("fetch", fetch), ("flush", flush), ("stale", now - self.last_sync >= self.poll_interval),
                 ("renew", now >= self.next_renew)]
        triggers["+".join(name for name, held in parts if held)] += 1
        self.counted = True
    return answer


async def turn(self: Any) -> None:
    self.counted = False
    await original_turn(self)
    if self.counted:
        leases.append(self.lease_result)


async def main(politeness: str) -> None:
    syncloop.SyncLoop.due, syncloop.SyncLoop._turn = due, turn  # type: ignore[method-assign]
    server = RedisProcess().start()
    try:
        start = time.monotonic()
        window[:] = [start + WINDOW[0], start + WINDOW[1]]
        counts: dict[str, Any] = {"pages": 0, "fetches": [], "found": {}}
        await asyncio.gather(*(capacity._worker(server.url, 1, politeness, i, start + RUN_S, counts, RATE)
                               for i in range(WORKERS)))
        pages = sum(1 for fetch in counts["fetches"] if window[0] <= fetch[2] <= window[1])
        rounds = sum(triggers.values())
        asking = [lease for lease in leases if lease[1]]
        per_page = round(rounds / pages, 3)
        print(politeness, "pages", pages, "rounds", rounds, "per page", per_page, dict(triggers))
        print("  leases asking", len(asking), "short", sum(1 for got, asked, _ in asking if got < asked))
    finally:
        server.stop()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "process"))
