"""The two lines of the design card (``SCHEDULER`` and ``DUPEFILTER_CLASS``, no add-on) and the add-on give
the same crawl: the same crawl-wide figures in ``scrapy-dist status --json``, the same worker list, the
same refusals of denied networks."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
from crawlproject import Project, make_project
from zygote import Zygote

pytestmark = pytest.mark.slow

PAGES = 120
WORKERS = 2


def _status(redis_url: str, cwd: Path) -> dict[str, Any]:
    import json

    cmd = [sys.executable, "-c", "from scrapy_dist.cli import main; main()", "--redis-url", redis_url,
           "status", "links", "--json"]
    env = {k: v for k, v in os.environ.items() if k not in ("SCRAPY_SETTINGS_MODULE", "REDIS_URL")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(cwd), env.get("PYTHONPATH")]))
    out = Zygote.run_cli(cmd, timeout=60, env=env, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def _start(tmp_path: Path, redis_url: str, site: Any, name: str, settings: dict[str, Any]) -> Project:
    """A crawl's workers, started (under its own key prefix, so two crawls can run side by side)."""
    project = make_project(tmp_path / name, {
        "REDIS_URL": redis_url, "SCHEDULER_IDLE_BEFORE_CLOSE": 2,
        "CLUSTERSTATS_INTERVAL": 1,
        # the site is on 127.0.0.1; the second seed's address is denied
        "SCHEDULER_DENY_NETWORKS": ["127.0.0.2/32"], **settings,
    })
    with open(project.root / "proj" / "settings.py", "a") as fh:  # read by `scrapy-dist status` too
        fh.write(f"REDIS_KEY_PREFIX = {name + ':'!r}\n")
    denied = site.page_url(0).replace("127.0.0.1", "127.0.0.2")
    for _ in range(WORKERS):
        project.crawl(args={"seeds": f"{site.page_url(0)},{denied}"})
    return project


def _finish(project: Project, redis_url: str) -> dict[str, Any]:
    assert project.wait_all(120) == [0] * WORKERS, project.logs()[-3000:]
    return {"status": _status(redis_url, project.root), "logs": project.logs()}


def _figures(status: dict[str, Any]) -> dict[str, Any]:
    stats = status["stats"]
    return {
        "pages": int(stats.get("response_received_count", 0)),
        "items": int(stats.get("item_scraped_count", 0)),
        "workers": status["workers_summary"],
        "refused": int(stats.get("deny_networks/refused", 0)),
        "deadletter": status["deadletter"],
        "finish_reason": stats.get("finish_reason"),
        "frontier": status["frontier"],
    }


def test_the_two_lines_and_the_addon_give_the_same_status(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    site = site_factory(pages=PAGES)
    crawls = [_start(tmp_path, redis_url, site, "twolines", {}),
              _start(tmp_path, redis_url, site, "addon", {"ADDONS": {"scrapy_dist.Addon": 0}})]
    two, addon = (_finish(project, redis_url) for project in crawls)
    two_figures, addon_figures = _figures(two["status"]), _figures(addon["status"])
    assert two_figures["pages"] == PAGES, two_figures  # every page once, crawl-wide
    assert two_figures["items"] == two_figures["pages"]
    assert two_figures["workers"] == {"running": 0, "lost": 0, "closed": WORKERS, "total": WORKERS}
    # the denied seed, refused once as it is read from the queue (a rejected entry, not a dead letter)
    assert two_figures["refused"] == 1 and two_figures["deadletter"] == 0
    assert two_figures == addon_figures
    # per worker: both runs list every worker, closed, with its pages
    assert sorted(w["state"] for w in two["status"]["workers"]) == ["closed"] * WORKERS
    assert sum(w["pages"] for w in two["status"]["workers"]) == two_figures["pages"]
    # the one WARNING naming what only the add-on gives, with the line to add
    warnings = [line for line in two["logs"].splitlines() if "runs without the add-on" in line]
    assert len(warnings) == WORKERS and 'ADDONS = {"scrapy_dist.Addon": 0}' in warnings[0]
    assert not [line for line in addon["logs"].splitlines() if "runs without the add-on" in line]
