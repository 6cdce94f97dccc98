"""The capacity benchmark's plain and sharded points, keeping each point's recorded calls and its window.

Run from the repository's root with the benchmark's own options, e.g. ``REDIS_SERVER=/usr/bin/redis-server
BENCH_CALLGRIND_KEEP=/tmp/keep.out python benchmarks/results/2026-11-29-shard-cluster-mode/record.py
--capacity-modes plain,sharded --capacity-workers 16 --capacity-seconds 6 --capacity-instructions
--capacity-window-instructions --capacity-rate 400 --out /tmp/run``. Besides the benchmark's output it
writes ``<record prefix>-window.json`` next to each point's call files: the measured window (monotonic, as
the calls' timestamps), its pages and the instructions per page the benchmark counted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT)]

from benchmarks import __main__ as bench_main  # noqa: E402
from benchmarks import capacity  # noqa: E402

original = capacity._instructions


def _instructions(record: str, pages: int, window: tuple[float, float] | None = None,
                  cluster: bool = False) -> float:
    per_page = original(record, pages, window, cluster)
    with open(f"{record}-window.json", "w") as f:
        json.dump({"window": window, "pages": pages, "instructions_per_page": per_page}, f)
    print(f"  kept {record}.*.json (window {window}, {pages} pages, {per_page:,.0f} instructions/page)")
    return per_page


capacity._instructions = _instructions  # type: ignore[assignment]

if __name__ == "__main__":
    sys.argv[1:1] = ["capacity"]
    bench_main.main()
