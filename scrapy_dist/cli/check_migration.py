"""``scrapy-dist check-migration [PROJECT_DIR]``: what a scrapy-redis project becomes on scrapy-dist.

Reads the project's settings and Python files without importing or running them
(:mod:`scrapy_dist.cli.projectscan`) and prints one line per scrapy-redis setting, import, spider class,
hook and pipeline it finds: ``<file>:<line>: <status> <what> -- <what changes>``, status ``same``,
``changed`` (works differently: read the note) or ``action`` (edit the project), then a count. Exit status
0 when nothing needs action, 1 when something does, 2 when the directory cannot be read.
"""

from __future__ import annotations

from pathlib import Path

import click

from scrapy_dist.cli import main
from scrapy_dist.cli.projectscan import ACTION, CHANGE, SAME, scan_project


@main.command("check-migration")
@click.argument("project_dir", default=".", type=click.Path(file_okay=False, path_type=Path))
@click.option("--quiet", "-q", is_flag=True, help="Print only what needs action (and the count).")
def check_migration(project_dir: Path, quiet: bool) -> None:
    """List every scrapy-redis setting, import, spider pattern and hook of the project in PROJECT_DIR
    (default: here) with what changes on scrapy-dist; exit status 1 if anything needs action."""
    try:
        findings = scan_project(project_dir)
    except (FileNotFoundError, OSError) as exc:
        raise click.UsageError(str(exc)) from None
    counts = {ACTION: 0, CHANGE: 0, SAME: 0}
    for finding in findings:
        counts[finding.status] += 1
        if not quiet or finding.status == ACTION:
            click.echo(str(finding))
    if not findings:
        click.echo(f"{project_dir}: no scrapy-redis setting, import or spider found")
        return
    click.echo(f"{len(findings)} found: {counts[ACTION]} need action, {counts[CHANGE]} changed,"
               f" {counts[SAME]} same (the README's migration table says more)")
    if counts[ACTION]:
        raise SystemExit(1)
