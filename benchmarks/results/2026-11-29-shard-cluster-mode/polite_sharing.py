"""CPU of two capacity points' recorded window calls (sharded and sharded-polite, recorded by ``record.py``),
replayed by ``cluster_cost.py``'s ``cpu_run`` in configurations A, B and C, the configurations and the two
points alternating.

Run from the repository's root::

    python benchmarks/results/2026-11-29-shard-cluster-mode/polite_sharing.py PLAIN_PREFIX POLITE_PREFIX \\
        --out polite-sharing.json --repeats 5 --order BCA

Each round runs every configuration of ``--order`` for both points; the order of the points and of the
configurations is reversed every other round. The JSON is updated after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cluster_cost  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plain", help="the sharded point's record prefix")
    parser.add_argument("polite", help="the sharded-polite point's record prefix")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--order", default="BCA")
    a = parser.parse_args()
    os.sched_setaffinity(0, {1})
    points = {}
    for mode, prefix in (("sharded", a.plain), ("sharded-polite", a.polite)):
        sources, calls, (w0, _), pages, bench = cluster_cost.load_point(prefix)
        window = [c for c in calls if c[0] >= w0]
        points[mode] = (sources, calls, w0, pages, {
            "prefix": prefix, "pages": pages, "instructions_per_page": bench, "calls": len(calls),
            "window_calls": len(window),
            "window_calls_by_shard": [sum(cluster_cost.shard_of(c[2]) == i for c in window)
                                      for i in range(cluster_cost.MASTERS)]})
    results: dict[str, Any] = json.loads(a.out.read_text()) if a.out.exists() else {}
    results["points"] = {m: p[4] for m, p in points.items()}
    runs = results.setdefault("runs", [])
    first = max((r["round"] for r in runs), default=-1) + 1
    for rnd in range(first, first + a.repeats):
        modes = list(points) if rnd % 2 == 0 else list(points)[::-1]
        order = a.order if rnd % 2 == 0 else a.order[::-1]
        for mode in modes:
            sources, calls, w0, pages, _ = points[mode]
            for how in order:
                r = cluster_cost.cpu_run(sources, calls, w0, how)
                r.update(mode=mode, round=rnd, us_per_page=1e6 * r["cpu_s"] / pages)
                runs.append(r)
                print(f"round {rnd} {mode} {how}: {r['us_per_page']:.1f} us/page in {r['seconds']:.2f} s",
                      flush=True)
                a.out.write_text(json.dumps(results, indent=1))
    for mode in points:
        for how in a.order:
            got = [r["us_per_page"] for r in runs if r["mode"] == mode and r["how"] == how]
            if got:
                print(f"{mode} {how}: median {statistics.median(got):.1f} ({min(got):.1f}-{max(got):.1f})")


if __name__ == "__main__":
    main()
