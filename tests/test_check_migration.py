"""``scrapy-dist check-migration``: every scrapy-redis setting, import, spider pattern and hook of a project,
one line each with what changes, and an exit status saying whether anything needs action."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from scrapy_dist.cli import main
from scrapy_dist.cli.migration import ACTION, CHANGE, SAME, scan_project

PROJECTS = Path(__file__).parent / "migration_projects"


def check(path: Path, *args: str) -> tuple[int, list[str]]:
    result = CliRunner().invoke(main, ["check-migration", str(path), *args])
    return result.exit_code, result.output.splitlines()


def actions(path: Path) -> set[str]:
    return {f.subject for f in scan_project(path) if f.status == ACTION}


def switched(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(PROJECTS / name, dst, ignore=shutil.ignore_patterns("__pycache__"))
    for path in dst.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        path.write_text(text.replace("scrapy_redis", "scrapy_dist"), encoding="utf-8")
    return dst


def test_the_example_project_lists_what_to_rewrite_and_exits_1() -> None:
    code, lines = check(PROJECTS / "example")
    assert code == 1
    assert lines[-1] == "12 found: 6 need action, 0 changed, 6 same (the README's migration table says more)"
    assert lines[0].startswith("example/settings.py:7: action  DUPEFILTER_CLASS:"
                               " scrapy_redis.dupefilter.RFPDupeFilter"
                               " -- write `scrapy_dist.dupefilter.RFPDupeFilter`")
    assert actions(PROJECTS / "example") == {
        "DUPEFILTER_CLASS: scrapy_redis.dupefilter.RFPDupeFilter",
        "SCHEDULER: scrapy_redis.scheduler.Scheduler",
        "ITEM_PIPELINES: scrapy_redis.pipelines.RedisPipeline", "scrapy_redis.spiders.RedisSpider",
        "scrapy_redis.spiders.RedisCrawlSpider", "no Redis setting",
    }
    assert any("SiteCrawler.rules with a callback -- a pushed URL is fetched again, and a link to it" in line
               for line in lines)


@pytest.mark.parametrize(("name", "left"), [
    ("example", {"no Redis setting"}),  # it talked to localhost:6379; scrapy-dist's default is embedded
    ("jobs_board", set()),
    ("detail_pair/slave", {"SCHEDULER_DUPEFILTER_KEY"}),
    ("detail_pair/master", set()),  # plain Scrapy with a client of its own: nothing to do
])
def test_after_the_switch_only_what_the_switch_cannot_fix_is_left(
    tmp_path: Path, name: str, left: set[str]
) -> None:
    project = switched(name, tmp_path)
    assert actions(project) == left
    code, lines = check(project, "--quiet")
    assert code == (1 if left else 0)
    assert len(lines) == len(left) + 1


def test_hooks_clients_and_settings_that_need_action(tmp_path: Path) -> None:
    (tmp_path / "scrapy.cfg").write_text("[settings]\ndefault = proj.settings\n")
    pkg = tmp_path / "proj"
    (pkg / "spiders").mkdir(parents=True)
    (pkg / "settings.py").write_text(textwrap.dedent('''
        SCHEDULER = "scrapy_redis.scheduler.Scheduler"
        SCHEDULER_SERIALIZER = "scrapy_redis.picklecompat"
        MAX_IDLE_TIME_BEFORE_CLOSE = 10
        REDIS_PASSWORD = "secret"
        SCHEDULER_PERSIST = True
    '''))
    (pkg / "pipelines.py").write_text(textwrap.dedent('''
        from scrapy_redis.pipelines import RedisPipeline

        class Mine(RedisPipeline):
            def _process_item(self, item, spider):
                self.server.rpush("x", "y")
    '''))
    (pkg / "spiders" / "s.py").write_text(textwrap.dedent('''
        import redis
        from scrapy_redis import picklecompat
        from scrapy_redis.spiders import RedisSpider

        class Old(RedisSpider):
            name = "old"
            redis_batch_size = 5

            def next_requests(self):
                return self.server.lpop(self.redis_key)

            def make_request_from_data(self, data):
                return None

        def own():
            return redis.StrictRedis()
    '''))
    found = {(f.path, f.line, f.subject): f for f in scan_project(tmp_path)}
    status = {key[2]: f.status for key, f in found.items()}
    assert status["SCHEDULER_SERIALIZER: scrapy_redis.picklecompat"] == ACTION
    assert status["SCHEDULER_SERIALIZER"] == ACTION  # not applied, with a WARNING
    assert status["MAX_IDLE_TIME_BEFORE_CLOSE"] == CHANGE  # the alias of SCHEDULER_IDLE_BEFORE_CLOSE
    assert status["REDIS_PASSWORD"] == ACTION
    assert status["SCHEDULER_PERSIST"] == SAME  # set explicitly: the changed default does not apply
    assert status["class Mine(RedisPipeline)"] == ACTION
    assert status["Old.next_requests()"] == ACTION
    assert status["Old: self.server"] == ACTION
    assert status["Old.make_request_from_data()"] == SAME
    assert status["Old.redis_batch_size"] == SAME
    assert status["scrapy_redis.picklecompat"] == ACTION
    assert status["a Redis client of the project's own"] == ACTION  # no Redis named: localhost vs embedded
    assert found[("proj/spiders/s.py", 3, "scrapy_redis.picklecompat")].note.startswith(
        "no counterpart in scrapy-dist")
    assert found[("proj/spiders/s.py", 10, "Old.next_requests()")].note.startswith("never called")


def test_a_directory_that_is_not_there_is_a_usage_error(tmp_path: Path) -> None:
    code, lines = check(tmp_path / "missing")
    assert code == 2 and lines[-1] == f"Error: {tmp_path / 'missing'} is not a directory"


def test_a_project_without_scrapy_redis_says_so(tmp_path: Path) -> None:
    (tmp_path / "settings.py").write_text("BOT_NAME = 'x'\n")
    code, lines = check(tmp_path)
    assert code == 0 and lines == [f"{tmp_path}: no scrapy-redis setting, import or spider found"]
