"""Writes a run's results as ``latest.json``, ``latest.md`` (Markdown tables) and ``latest.png`` (charts)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

MACHINE_FIELDS = [
    ("CPU", "cpu"),
    ("Cores", "cores"),
    ("Memory (GiB)", "memory_gib"),
    ("OS", "os"),
    ("Python", "python"),
    ("Scrapy", "scrapy"),
    ("Twisted", "twisted"),
    ("Redis server", "redis_server"),
    ("redis-py / hiredis", None),
    ("scrapy-redis", "scrapy_redis"),
    ("scrapy-dist", "scrapy_dist"),
]


def fmt(value: Any) -> str:
    """A table cell: floats with sensible precision, None as an em dash."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "—"
        a = abs(value)
        if a >= 1000:
            return f"{value:,.0f}"
        if a >= 100:
            return f"{value:.0f}"
        if a >= 10:
            return f"{value:.1f}"
        if a >= 0.01 or a == 0:
            return f"{value:.2f}"
        return f"{value:.2g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def markdown_table(table: dict) -> str:
    cols = table["columns"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for row in table["rows"]:
        lines.append("| " + " | ".join(fmt(c).replace("|", "\\|") for c in row) + " |")
    return "\n".join(lines)


def render_markdown(run: dict, png_name: str | None) -> str:
    m = run["machine"]
    out = [
        "# scrapy-dist benchmarks",
        "",
        f"Generated {run['generated']} by `{run['command']}` in {run['duration_s']:.0f} s"
        + (
            " (**quick smoke run: small sizes, not for comparison**)." if run["options"].get("quick") else "."
        ),
        "",
        "| Machine | |",
        "|---|---|",
    ]
    for label, key in MACHINE_FIELDS:
        value = f"{m.get('redis_py')} / {m.get('hiredis')}" if key is None else m.get(key)
        out.append(f"| {label} | {fmt(value)} |")
    if png_name:
        out += ["", f"![charts]({png_name})"]
    for name, result in run["benchmarks"].items():
        out += ["", f"## {name}: {result.get('title', name)}", ""]
        if result.get("status") != "ok":
            out.append(f"**{result.get('status', 'error')}**: {result.get('reason', '')}")
            if result.get("traceback"):
                out += ["", "```", result["traceback"].rstrip(), "```"]
            continue
        if result.get("summary"):
            out += [result["summary"], ""]
        for table in result.get("tables", []):
            if table.get("title"):
                out += [f"### {table['title']}", ""]
            out += [markdown_table(table), ""]
            out += [f"- {n}" for n in table.get("notes", [])]
            if table.get("notes"):
                out.append("")
        if result.get("notes"):
            out += ["Notes:", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(out).rstrip() + "\n"


def render_png(run: dict, path: Path) -> bool:
    """Grouped bar charts, one panel per chart of every benchmark. False if there is nothing to draw."""
    charts = [
        (name, chart)
        for name, result in run["benchmarks"].items()
        if result.get("status") == "ok"
        for chart in result.get("charts", [])
        if any(v is not None for vs in chart["series"].values() for v in vs)
    ]
    if not charts:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = 1 if len(charts) == 1 else 2
    nrows = math.ceil(len(charts) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 4.2 * nrows), squeeze=False)
    # one colour per series name across every panel (scrapy-redis is the same colour everywhere)
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colours: dict[str, str] = {}
    for _, chart in charts:
        for label in chart["series"]:
            colours.setdefault(label, palette[len(colours) % len(palette)])
    for ax, (name, chart) in zip(axes.flat, charts, strict=False):
        cats = chart["categories"]
        series = chart["series"]
        width = 0.8 / max(1, len(series))
        for k, (label, values) in enumerate(series.items()):
            xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(cats))]
            heights = [0 if v is None else v for v in values]
            bars = ax.bar(xs, heights, min(width, 0.3), label=label, color=colours[label])
            for bar, v in zip(bars, values, strict=True):
                text = "n/a" if v is None else fmt(float(v))
                ax.annotate(
                    text,
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    xytext=(0, 2),
                    textcoords="offset points",
                )
        ax.set_xticks(range(len(cats)))
        ax.set_xticklabels(cats)
        ax.set_title(f"{name}: {chart['title']}", fontsize=10)
        ax.set_ylabel(chart.get("ylabel", ""))
        if chart.get("log"):
            ax.set_yscale("log")
        ax.margins(y=0.15)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(charts) :]:
        ax.axis("off")
    m = run["machine"]
    fig.suptitle(
        f"scrapy-dist benchmarks — {m.get('cpu')}, {m.get('cores')} cores, "
        f"{m.get('python')}, Scrapy {m.get('scrapy')}"
        + (" — QUICK smoke run" if run["options"].get("quick") else ""),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(run: dict, out_dir: Path, stem: str = "latest") -> dict[str, Path]:
    """Write ``<stem>.json``, ``<stem>.png`` (if any chart) and ``<stem>.md``; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{stem}.json", "md": out_dir / f"{stem}.md", "png": out_dir / f"{stem}.png"}
    try:
        has_png = render_png(run, paths["png"])
    except ImportError:  # matplotlib is in the `bench` extra; the tables still get written
        has_png = False
        run.setdefault("warnings", []).append("matplotlib not installed: no chart")
    if not has_png:
        paths["png"].unlink(missing_ok=True)
        del paths["png"]
    paths["json"].write_text(json.dumps(run, indent=1, default=str) + "\n")
    paths["md"].write_text(render_markdown(run, paths["png"].name if has_png else None))
    return paths
