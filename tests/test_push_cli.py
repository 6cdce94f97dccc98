"""``scrapy-dist push``: local validation with the spider's rules, pipelined pushes, the report."""

from __future__ import annotations

import json
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from scrapy_dist.cli import main
from scrapy_dist.cli import push as push_module
from scrapy_dist.cli.push import PushOptions, push_seeds
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.seeds import SeedRules

KEYS = CrawlKeys("books")


def run(redis_url: str, *args: str, input: bytes | None = None) -> Result:  # noqa: A002
    return CliRunner().invoke(
        main, ["--redis-url", redis_url, "push", *args], input=input, env={"REDIS_URL": None}
    )


def _isolate_settings_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """get_project_settings() sets $SCRAPY_SETTINGS_MODULE; a bare delenv of an unset variable records
    nothing to undo, so the value would leak into later tests' ``scrapy crawl`` processes. setenv first
    records the original state."""
    monkeypatch.setenv("SCRAPY_SETTINGS_MODULE", "")
    monkeypatch.delenv("SCRAPY_SETTINGS_MODULE")


@pytest.fixture
def outside_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    _isolate_settings_module(monkeypatch)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_urls_and_file_are_validated_and_pushed_in_order(
    redis_url: str, redis_client: Any, outside_project: Path
) -> None:
    seeds = outside_project / "seeds.txt"
    seeds.write_bytes(
        b"# seeds for books\n"
        b"http://a.example/1\n"
        b"\n"
        b"\xff\xfe not utf-8\n"
        b'{"url": "http://a.example/2", "meta": {"k": 1}}\n'
        b"ftp://a.example/nope\n"
        b'{"url": "http://a.example/3", "callback": "_private"}\n'
        b"  http://a.example/4  \r\n"
    )
    res = run(redis_url, "books", "http://a.example/0", "--file", str(seeds))
    assert res.exit_code == 1, res.output  # something was rejected: status 1, the rest pushed anyway
    assert redis_client.lrange(KEYS.start_urls, 0, -1) == [
        b"http://a.example/0",
        b"http://a.example/1",
        b'{"url": "http://a.example/2", "meta": {"k": 1}}',
        b"http://a.example/4",
    ]
    assert "Pushed 4 seeds to 'books:start_urls' (list)" in res.output
    assert "rejected 3" in res.output
    assert "not_utf8 1" in res.output and "bad_scheme 1" in res.output and "bad_callback 1" in res.output
    assert f"{seeds}:4: not_utf8" in res.output and f"{seeds}:6: bad_scheme" in res.output


def test_rejections_beyond_the_examples_are_counted_not_hidden(redis_url: str, outside_project: Path) -> None:
    res = run(redis_url, "books", *[f"bad-{i}.example" for i in range(push_module.EXAMPLES + 3)])
    assert res.exit_code == 1, res.output
    assert res.output.count("  argument ") == push_module.EXAMPLES, res.output
    assert f"... and 3 more (only the first {push_module.EXAMPLES} are shown)" in res.output
    res = run(redis_url, "books", "bad.example")
    assert "more" not in res.output, res.output


def test_all_valid_exits_zero_and_reads_stdin(
    redis_url: str, redis_client: Any, outside_project: Path
) -> None:
    res = run(redis_url, "books", "--file", "-", input=b"http://a.example/x\nhttp://a.example/y\n")
    assert res.exit_code == 0, res.output
    assert "Pushed 2 seeds" in res.output and "rejected 0" in res.output
    assert redis_client.llen(KEYS.start_urls) == 2


def test_priority_and_meta_turn_urls_into_json(
    redis_url: str, redis_client: Any, outside_project: Path
) -> None:
    res = run(
        redis_url, "books", "http://a.example/1",
        '{"url": "http://a.example/2", "priority": 9, "meta": {"a": 0}}',
        "--priority", "4", "--meta", '{"a": 1, "src": "cli"}',
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    got = [json.loads(x) for x in redis_client.lrange(KEYS.start_urls, 0, -1)]
    assert got[0] == {"url": "http://a.example/1", "priority": 4, "meta": {"a": 1, "src": "cli"}}
    # the seed's own priority and meta keys win
    assert got[1] == {"url": "http://a.example/2", "priority": 9, "meta": {"a": 0, "src": "cli"}}


def test_bad_meta_option_is_a_usage_error(redis_url: str, outside_project: Path) -> None:
    for meta in ("[1]", "{not json", '{"x": 100000000000000000000000}'):
        res = run(redis_url, "books", "http://a.example/", "--meta", meta)
        assert res.exit_code == 2 and "--meta" in res.output, res.output


def test_dry_run_pushes_nothing(redis_url: str, redis_client: Any, outside_project: Path) -> None:
    res = run(redis_url, "books", "http://a.example/", "nope", "--dry-run")
    assert res.exit_code == 1
    assert "Dry run: 1 valid seeds" in res.output and "bad_url 1" in res.output
    assert not redis_client.exists(KEYS.start_urls)


def test_no_seeds_is_a_usage_error(redis_url: str, outside_project: Path) -> None:
    assert run(redis_url, "books").exit_code == 2


def test_a_missing_or_unreadable_file_is_a_usage_error(
    redis_url: str, redis_client: Any, outside_project: Path
) -> None:
    # a typo'd --file was a FileNotFoundError traceback
    for path in (outside_project / "no-such-seeds.txt", outside_project):
        res = run(redis_url, "books", "--file", str(path))
        assert res.exit_code == 2 and "--file" in res.output and "Traceback" not in res.output, res.output
    assert not redis_client.exists(KEYS.start_urls)


def test_a_key_of_another_type_is_refused(redis_url: str, redis_client: Any, outside_project: Path) -> None:
    redis_client.sadd(KEYS.start_urls, "x")
    res = run(redis_url, "books", "http://a.example/")
    assert res.exit_code == 1 and "is a set, but books reads a list" in res.output
    assert redis_client.smembers(KEYS.start_urls) == {b"x"}


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """cwd = a Scrapy project: a RedisSpider ``books`` fed by a ZSET (custom_settings), small seed limit."""
    module = f"pushproj_{uuid.uuid4().hex[:8]}"
    (tmp_path / "scrapy.cfg").write_text(f"[settings]\ndefault = {module}.settings\n")
    pkg = tmp_path / module
    (pkg / "spiders").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "spiders" / "__init__.py").write_text("")
    (pkg / "settings.py").write_text(
        f'BOT_NAME = "pushproj"\nSPIDER_MODULES = ["{module}.spiders"]\nREDIS_START_URLS_MAX_BYTES = 200\n'
    )
    (pkg / "spiders" / "books.py").write_text(
        textwrap.dedent(
            """
            from scrapy_dist.spiders import RedisSpider

            class Books(RedisSpider):
                name = "books"
                redis_key = "feed:%(name)s"
                custom_settings = {"REDIS_START_URLS_AS_ZSET": True}

                def parse(self, response):
                    pass

                def parse_item(self, response):
                    pass
            """
        )
    )
    _isolate_settings_module(monkeypatch)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield tmp_path


def test_inside_a_project_the_spiders_key_kind_limits_and_callbacks_apply(
    redis_url: str, redis_client: Any, project: Path
) -> None:
    res = run(
        redis_url, "books",
        "http://a.example/plain",
        '{"url": "http://a.example/cb", "callback": "parse_item", "priority": 7}',
        '{"url": "http://a.example/missing-cb", "callback": "parse_nothing"}',
        '{"url": "http://a.example/framework-cb", "callback": "start"}',
        "http://a.example/" + "x" * 300,
        "--priority", "3",
    )  # fmt: skip
    assert res.exit_code == 1, res.output
    assert "No spider" not in res.output
    key = "feed:books"
    assert redis_client.type(key) == b"zset"
    assert redis_client.zrange(key, 0, -1, withscores=True) == [
        (b"http://a.example/plain", 3.0),
        (b'{"url": "http://a.example/cb", "callback": "parse_item", "priority": 7}', 7.0),
    ]
    assert "bad_callback 2" in res.output and "too_large 1" in res.output


def test_status_counts_the_seeds_where_push_put_them(redis_url: str, project: Path) -> None:
    # status read <name>:start_urls whatever the spider's redis_key and custom_settings: seeds waiting in
    # feed:books (a ZSET) showed as 0
    assert run(redis_url, "books", "http://a.example/1", "http://a.example/2").exit_code == 0
    res = CliRunner().invoke(main, ["--redis-url", redis_url, "status", "books", "--json"],
                             env={"REDIS_URL": None})
    assert res.exit_code == 0, res.output
    seeds = json.loads(res.output)["seeds"]
    assert (seeds["key"], seeds["type"], seeds["waiting"]) == ("feed:books", "zset", 2)


def test_push_seeds_pipelines_many_chunks(
    redis_url: str, redis_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(push_module, "CHUNK", 7)
    monkeypatch.setattr(push_module, "CHUNKS_PER_ROUND_TRIP", 3)
    seeds = [(f"line {i}", f"http://a.example/{i}".encode() if i % 10 else b"bad") for i in range(1000)]
    report = push_seeds(redis_client, KEYS.start_urls, seeds, PushOptions(rules=SeedRules()))
    assert report.pushed == report.accepted == 900 and report.rejected == {"bad_url": 100}
    got = redis_client.lrange(KEYS.start_urls, 0, -1)
    assert got == [raw for _, raw in seeds if raw != b"bad"]


def test_push_seeds_set_and_zset(redis_client: Any) -> None:
    seeds = [("a", b"http://a.example/1"), ("b", b"http://a.example/1"), ("c", b"http://a.example/2")]
    push_seeds(redis_client, "s", seeds, PushOptions(kind="set"))
    assert redis_client.smembers("s") == {b"http://a.example/1", b"http://a.example/2"}
    report = push_seeds(redis_client, "z", seeds, PushOptions(kind="zset", priority=-2))
    assert report.pushed == 3
    assert redis_client.zrange("z", 0, -1, withscores=True) == [
        (b"http://a.example/1", -2.0),
        (b"http://a.example/2", -2.0),
    ]
