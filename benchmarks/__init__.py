"""scrapy-dist's benchmark harness: ``python -m benchmarks`` (see docs/benchmarks.md).

Each benchmark is a module of this package with

* ``run(args: argparse.Namespace) -> dict`` -- does the measuring, returns a result (shape below);
* optionally ``add_arguments(parser)`` -- adds its own command-line options (prefix them with its name);
* optionally ``TITLE`` -- a one-line description for ``--list``.

To add one, write ``benchmarks/<name>.py`` and add a line to :data:`BENCHMARKS`. A listed module that does
not exist yet is reported as skipped, so a line may be added before its module lands.

A result is a JSON-able dict; the report writer renders these keys and stores everything::

    {
      "title": "Crawl throughput",                       # section heading
      "summary": "one paragraph",                        # optional
      "tables": [{"title": ..., "columns": [...], "rows": [[...], ...], "notes": [...]}],
      "charts": [{"title": ..., "ylabel": ..., "categories": [...], "series": {"name": [v or None, ...]}}],
      "notes": ["..."],                                  # caveats, skipped parts, compatibility problems
      "data": {...},                                     # every raw number, for later analysis
      "failed": false,                                   # true: rendered, but `python -m benchmarks` exits 1
    }
"""

from __future__ import annotations

#: (name, module) in run order. ``--only NAME`` selects by name.
BENCHMARKS: list[tuple[str, str]] = [
    ("crawl", "benchmarks.crawl"),
    ("dupefilter", "benchmarks.dupefilter"),
    ("seeds", "benchmarks.seeds"),
    ("politeness", "benchmarks.politeness"),
    ("shards", "benchmarks.shards"),
    ("continuous", "benchmarks.continuous"),
    ("capacity", "benchmarks.capacity"),
    ("items", "benchmarks.items"),
    ("chaos", "benchmarks.chaos"),
    ("faults", "benchmarks.faults"),
]
