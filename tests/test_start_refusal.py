"""A crawl refused at start (a bad setting, Redis not answering) is one ERROR line and a clean stop, from
``scrapy crawl`` (exit status 1) and from scripts (no traceback, the process goes on)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from redis_servers import free_port

TWO_LINES = (
    'SCHEDULER = "scrapy_dist.scheduler.Scheduler"\n'
    'DUPEFILTER_CLASS = "scrapy_dist.dupefilter.BloomDupeFilter"\n'
)
ADDON = 'ADDONS = {"scrapy_dist.Addon": 0}\n'

SPIDER = """
import scrapy


class TinySpider(scrapy.Spider):
    name = "tiny"

    async def start(self):
        yield scrapy.Request("http://127.0.0.1:9/")

    def parse(self, response):
        pass
"""

PROCESS_SCRIPT = """
import sys
from scrapy.crawler import CrawlerProcess
from scrapy.utils.project import get_project_settings

process = CrawlerProcess(get_project_settings())
process.crawl("tiny")
process.start()
print("after the crawl: bootstrap_failed=%s" % process.bootstrap_failed, flush=True)
"""

RUNNER_SCRIPT = """
from scrapy.utils.reactor import install_reactor

install_reactor("twisted.internet.asyncioreactor.AsyncioSelectorReactor")
from scrapy.crawler import CrawlerRunner
from scrapy.utils.log import configure_logging
from scrapy.utils.project import get_project_settings
from twisted.internet import defer, reactor

configure_logging()
runner = CrawlerRunner(get_project_settings())


@defer.inlineCallbacks
def main():
    yield runner.crawl("tiny")
    print("the application goes on: bootstrap_failed=%s" % runner.bootstrap_failed, flush=True)
    reactor.stop()


main()
reactor.run()
print("the process ends normally", flush=True)
"""


def _project(tmp_path: Path, settings: str) -> Path:
    (tmp_path / "scrapy.cfg").write_text("[settings]\ndefault = tinyproj.settings\n")
    pkg = tmp_path / "tinyproj"
    (pkg / "spiders").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "spiders" / "__init__.py").write_text("")
    (pkg / "settings.py").write_text(
        'BOT_NAME = "tinyproj"\nSPIDER_MODULES = ["tinyproj.spiders"]\nLOG_LEVEL = "INFO"\n' + settings
    )
    (pkg / "spiders" / "tiny.py").write_text(textwrap.dedent(SPIDER))
    (tmp_path / "process.py").write_text(textwrap.dedent(PROCESS_SCRIPT))
    (tmp_path / "runner.py").write_text(textwrap.dedent(RUNNER_SCRIPT))
    return tmp_path


def _run(cwd: Path, *args: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SCRAPY_SETTINGS_MODULE", "REDIS_URL")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), str(cwd),
                                                      env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def _problems(output: str) -> list[str]:
    return [line for line in output.splitlines()
            if re.search(r"\b(ERROR|CRITICAL)\b|Traceback|Unhandled error", line)]


BAD_SETTING = "SCHEDULER_LEASE_SECONDS = -3\n"
BAD_LINE = "scrapy-dist: SCHEDULER_LEASE_SECONDS=-3: out of range; expected a positive number"


@pytest.mark.parametrize("path", [TWO_LINES, ADDON], ids=["two-lines", "addon"])
def test_scrapy_crawl_with_a_bad_setting_is_one_error_line_and_exit_1(
    tmp_path: Path, redis_url: str, path: str
) -> None:
    project = _project(tmp_path, path + f"REDIS_URL = {redis_url!r}\n" + BAD_SETTING)
    code, output = _run(project, "-m", "scrapy", "crawl", "tiny")
    assert code == 1, output
    problems = _problems(output)
    assert len(problems) == 1, output
    assert BAD_LINE in problems[0]
    assert "Spider closed (scrapy_dist_refused)" in output


def test_scrapy_crawl_with_redis_away_is_one_error_line_and_exit_1(tmp_path: Path) -> None:
    port = free_port()
    project = _project(tmp_path, TWO_LINES + f'REDIS_URL = "redis://127.0.0.1:{port}/0"\n')
    code, output = _run(project, "-m", "scrapy", "crawl", "tiny")
    assert code == 1, output
    problems = _problems(output)
    assert len(problems) == 1, output
    assert f"Cannot reach Redis at redis://127.0.0.1:{port}/0" in problems[0]


def test_a_crawler_process_script_gets_the_one_line_and_goes_on(tmp_path: Path, redis_url: str) -> None:
    project = _project(tmp_path, TWO_LINES + f"REDIS_URL = {redis_url!r}\n" + BAD_SETTING)
    code, output = _run(project, "process.py")
    assert code == 0, output
    problems = _problems(output)
    assert len(problems) == 1 and BAD_LINE in problems[0], output
    assert "after the crawl: bootstrap_failed=True" in output


def test_a_crawler_runner_application_goes_on_after_the_refused_crawl(tmp_path: Path, redis_url: str) -> None:
    project = _project(tmp_path, ADDON + f"REDIS_URL = {redis_url!r}\n" + BAD_SETTING)
    code, output = _run(project, "runner.py")
    assert code == 0, output
    problems = _problems(output)
    assert len(problems) == 1 and BAD_LINE in problems[0], output
    assert "the application goes on: bootstrap_failed=True" in output
    assert "the process ends normally" in output
