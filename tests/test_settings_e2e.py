"""A bad setting stops ``scrapy crawl`` and the ``scrapy-dist`` command with the same one line.

Real processes: ``scrapy crawl`` in a temp project (with the add-on, and with only SCHEDULER /
DUPEFILTER_CLASS set), and the installed ``scrapy-dist`` entry point (its function forked from the
pre-imported interpreter for the bad project settings, tests/zygote.py; the console script itself for the
bad environment URL).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from zygote import Zygote

from tests.crawlproject import SPIDERS, make_project

#: (setting, value, what the line must say after "scrapy-dist: SETTING=value: ")
CASES = [
    ("REDIS_URL", "127.0.0.1:6380", "no scheme"),
    ("REDIS_URL", "redis:/host", "malformed"),
    ("REDIS_URL", "redis://host:abc/0", "the port is not a number"),
    ("REDIS_URL", "http://example.com/", "scheme http:// is not Redis"),
    ("SCHEDULER_LEASE_SECONDS", "abc", "not a number"),
    ("SCHEDULER_LEASE_SECONDS", "-5", "out of range"),
    ("BLOOMFILTER_ERROR_RATE", "2", "out of range"),
    ("REDIS_PARAMS", "{bad", "not a JSON object"),
    ("BLOOMFILTER_CAPACITY", str(10**400), "out of range"),
    # redis-py's own refusals came from deep inside the crawler's start, as tracebacks
    ("REDIS_PARAMS", '{"bogus_kw": 1}', "'bogus_kw' is not a redis-py client option"),
    ("REDIS_URL", "redis://127.0.0.1:6380/0?socket_timeout=abc", "bad query option"),
]


def _one_line(output: str, name: str, problem: str) -> str:
    assert "Traceback" not in output, output
    assert "Engine slot not assigned" not in output, output
    lines = [line for line in output.splitlines() if f"scrapy-dist: {name}=" in line]
    assert len(lines) == 1, output
    assert f": {problem}" in lines[0], lines[0]
    assert ";" in lines[0].split(f"{name}=", 1)[1], lines[0]  # "; <what is expected>"
    errors = [line for line in output.splitlines() if re.search(r"\b(ERROR|CRITICAL)\b", line)]
    assert len(errors) <= 1, output
    return lines[0]


@pytest.mark.parametrize(("name", "value", "problem"), CASES)
def test_scrapy_crawl_refuses_a_bad_setting_with_one_line(
    tmp_path: Path, name: str, value: str, problem: str
) -> None:
    project = make_project(tmp_path)
    proc = project.crawl("nofollow", settings={name: value})
    code = proc.wait(timeout=120)
    output = project.logs()
    assert code != 0, output
    line = _one_line(output, name, problem)
    assert "open as worker" not in output  # nothing started half way
    if name == "BLOOMFILTER_CAPACITY":
        assert len(line) < 300  # the value is shortened


def test_the_addon_alone_refuses_with_one_line_before_anything_opens(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    proc = project.crawl(
        "nofollow",
        settings={
            "SCHEDULER": "scrapy.core.scheduler.Scheduler",
            "DUPEFILTER_CLASS": "scrapy.dupefilters.RFPDupeFilter",
            "ADDONS": {"scrapy_dist.Addon": 0},
            "SCHEDULER_SHARDS": "0",
        },
    )
    # the add-on leaves the user's SCHEDULER alone; its extensions still check the settings first
    code = proc.wait(timeout=120)
    output = project.logs()
    assert code != 0, output
    _one_line(output, "SCHEDULER_SHARDS", "out of range")


REDIS_SPIDER = SPIDERS + '''

from scrapy_dist.spiders import RedisSpider


class SeededSpider(RedisSpider):
    name = "seeded"
'''
ADDON = {"ADDONS": {"scrapy_dist.Addon": 0}, "SCHEDULER": None, "DUPEFILTER_CLASS": None}


@pytest.mark.parametrize(
    ("spider", "settings", "name", "closest"),
    [
        # the two classic lines: the scheduler loads DUPEFILTER_CLASS
        ("nofollow", {"DUPEFILTER_CLASS": "scrapy_dist.dupefilter.BloomDupefilter"}, "DUPEFILTER_CLASS",
         "scrapy_dist.dupefilter.BloomDupeFilter"),
        # Scrapy loads SCHEDULER before any scrapy-dist component but a RedisSpider or the add-on
        ("seeded", {"SCHEDULER": "scrapy_dist.schedulr.Scheduler"}, "SCHEDULER",
         "scrapy_dist.scheduler.Scheduler"),
        ("nofollow", {**ADDON, "SCHEDULER": "scrapy_dist.scheduler.Schedular"}, "SCHEDULER",
         "scrapy_dist.scheduler.Scheduler"),
        ("nofollow", {**ADDON, "STATS_CLASS": "scrapy_dist.stats.RedisStatsColector"}, "STATS_CLASS",
         "scrapy_dist.stats.RedisStatsCollector"),
    ],
)
def test_a_misspelt_class_path_is_one_line_not_a_traceback(
    tmp_path: Path, spider: str, settings: dict[str, Any], name: str, closest: str
) -> None:
    project = make_project(tmp_path, spiders=REDIS_SPIDER)
    project.settings.update({k: v for k, v in settings.items() if v is not None})
    for unset in [k for k, v in settings.items() if v is None]:
        project.settings.pop(unset)
    code = project.crawl(spider).wait(timeout=120)
    output = project.logs()
    assert code != 0, output
    line = _one_line(output, name, "cannot be imported")
    assert line.endswith(f"did you mean {closest}?"), line


def test_scrapy_crawl_warns_about_a_misspelt_setting(tmp_path: Path, redis_url: str) -> None:
    project = make_project(tmp_path, settings={"REDIS_URL": redis_url, "SCHEDULER_IDLE_BEFORE_CLOSE": 1})
    proc = project.crawl("nofollow", settings={"SCHEDULER_PERISST": "False"})
    assert proc.wait(timeout=120) == 0, project.logs()
    output = project.logs()
    warnings = [line for line in output.splitlines() if "SCHEDULER_PERISST" in line and "WARNING" in line]
    assert len(warnings) == 1, output
    assert "did you mean SCHEDULER_PERSIST?" in warnings[0]
    # and which Redis it uses, once, at INFO
    used = [line for line in output.splitlines() if "Using Redis at" in line]
    assert len(used) == 1, output
    assert "from REDIS_URL" in used[0]


def _cli() -> str:
    found = shutil.which("scrapy-dist", path=str(Path(sys.executable).parent))
    assert found, "the scrapy-dist entry point is not installed in this environment"
    return found


@pytest.mark.parametrize(("name", "value", "problem"), CASES)
def test_cli_refuses_a_bad_project_setting_with_the_same_line(
    tmp_path: Path, name: str, value: str, problem: str
) -> None:
    make_project(tmp_path)
    with open(tmp_path / "proj" / "settings.py", "a") as fh:
        fh.write(f"\n{name} = {value!r}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "SCRAPY_SETTINGS_MODULE")}
    proc = Zygote.run_cli([_cli(), "status", "links"], cwd=tmp_path, env=env, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"scrapy-dist: {name}="), proc.stderr
    _one_line(proc.stdout + proc.stderr, name, problem)
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_cli_refuses_a_bad_environment_url_in_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SCRAPY_SETTINGS_MODULE"}
    env["REDIS_URL"] = "localhost:6379"
    proc = subprocess.run(
        [_cli(), "status", "links"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "scrapy-dist: REDIS_URL=localhost:6379: no scheme (environment variable); expected"
        " redis://[[user]:password@]host[:port][/db], rediss://... or unix:///path/to/socket[?db=N]"
    )
