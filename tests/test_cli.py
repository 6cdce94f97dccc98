"""The scrapy-dist command: help, the shared --redis-url resolution order, errors, the demo."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from redis_servers import free_port

from scrapy_dist.cli import ClientFactory, main, pass_redis
from scrapy_dist.redis.embedded import EmbeddedRedis


@pytest.fixture
def probe() -> Iterator[None]:
    """A throw-away subcommand printing where its Redis came from, registered like a real one."""

    @main.command("probe")
    @click.option("--check", is_flag=True)
    @pass_redis
    def probe_cmd(redis: ClientFactory, check: bool) -> None:
        if check:
            redis.check()
        click.echo(f"{redis.source}|{redis.url}")

    yield
    main.commands.pop("probe")


@pytest.fixture
def outside_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("SCRAPY_SETTINGS_MODULE", "unset")  # so that teardown restores the original state
    monkeypatch.delenv("SCRAPY_SETTINGS_MODULE")
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    EmbeddedRedis(tmp_path / ".scrapy" / "scrapy_dist").shutdown(save=False)


@pytest.fixture
def inside_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """cwd = a Scrapy project whose settings say ``REDIS_URL = redis://project-host:6390/4``."""
    module = f"cliproj_{uuid.uuid4().hex[:8]}"
    (tmp_path / "scrapy.cfg").write_text(f"[settings]\ndefault = {module}.settings\n")
    (tmp_path / module).mkdir()
    (tmp_path / module / "__init__.py").write_text("")
    (tmp_path / module / "settings.py").write_text(
        'BOT_NAME = "cliproj"\nREDIS_URL = "redis://project-host:6390/4"\nREDIS_KEY_PREFIX = "p:"\n'
    )
    # get_project_settings() sets SCRAPY_SETTINGS_MODULE: setenv first so that teardown removes it again
    # (delenv of an unset variable records nothing to undo).
    monkeypatch.setenv("SCRAPY_SETTINGS_MODULE", "unset")
    monkeypatch.delenv("SCRAPY_SETTINGS_MODULE")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield tmp_path


def run(*args: str, env: dict[str, str | None] | None = None) -> click.testing.Result:
    return CliRunner().invoke(main, list(args), env={"REDIS_URL": None, **(env or {})})


def test_help_lists_the_option_and_the_commands() -> None:
    result = run("--help")
    assert result.exit_code == 0
    assert "--redis-url" in result.output
    assert "demo" in result.output
    sub = run("demo", "--help")
    assert sub.exit_code == 0
    assert "--redis-url" in sub.output  # pass_redis adds it to every subcommand


def test_version() -> None:
    result = run("--version")
    assert result.exit_code == 0
    assert "scrapy-dist" in result.output


def test_option_wins_over_environment_and_project(inside_project: Path, probe: None) -> None:
    result = run("--redis-url", "redis://opt:1/0", "probe", env={"REDIS_URL": "redis://env:2/0"})
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "--redis-url|redis://opt:1/0"


def test_option_after_the_subcommand_wins_too(probe: None) -> None:
    result = run("--redis-url", "redis://first:1/0", "probe", "--redis-url", "redis://second:1/0")
    assert result.output.strip() == "--redis-url|redis://second:1/0"


def test_project_wins_over_environment_as_in_workers(inside_project: Path, probe: None) -> None:
    # one order everywhere: settings, then $REDIS_URL, then the embedded Redis
    result = run("probe", env={"REDIS_URL": "redis://env:2/0"})
    assert result.output.strip() == "project settings|redis://project-host:6390/4"


def test_environment_used_outside_a_project(outside_project: Path, probe: None) -> None:
    result = run("probe", env={"REDIS_URL": "redis://env:2/0"})
    assert result.output.strip() == "REDIS_URL environment variable|redis://env:2/0"


def test_project_settings_inside_a_project(inside_project: Path, probe: None) -> None:
    result = run("probe")
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "project settings|redis://project-host:6390/4"
    # Reading the project's settings leaves no SCRAPY_SETTINGS_MODULE behind for later in-process use.
    assert "SCRAPY_SETTINGS_MODULE" not in os.environ


def test_project_settings_still_apply_with_an_explicit_url(inside_project: Path) -> None:
    factory = ClientFactory("redis://opt:1/0", environ={})
    assert factory.keys("books").queue == "p:{books}:queue"
    assert factory.settings.get("REDIS_URL") == "redis://opt:1/0"


def test_embedded_redis_when_nothing_is_configured(outside_project: Path, probe: None) -> None:
    result = run("probe")
    assert result.exit_code == 0, result.output
    source, url = result.output.strip().split("|")
    assert source == "embedded Redis"
    server = EmbeddedRedis(outside_project / ".scrapy" / "scrapy_dist")
    assert server.url() == url  # the same server `scrapy crawl` would use from here


def test_unreachable_redis_is_one_error_line_and_exit_1(probe: None) -> None:
    port = free_port()
    result = run("--redis-url", f"redis://:s3cret@127.0.0.1:{port}/0", "probe", "--check")
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith("Error: Cannot reach Redis at ")
    assert f"redis://:***@127.0.0.1:{port}/0" in lines[0]
    assert "s3cret" not in result.output
