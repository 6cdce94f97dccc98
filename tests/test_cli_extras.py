"""The metrics and dashboard commands refuse in one line what cannot work, before serving anything."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from scrapy_dist.cli import main


@pytest.fixture
def outside_a_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SCRAPY_SETTINGS_MODULE", raising=False)


def test_metrics_needs_a_crawl_to_export(redis_url: str, outside_a_project: None) -> None:
    result = CliRunner().invoke(main, ["--redis-url", redis_url, "metrics"])
    assert result.exit_code == 2
    assert "name the crawls to export: scrapy-dist metrics SPIDER..." in result.output


def test_dashboard_beyond_loopback_needs_a_token(redis_url: str, outside_a_project: None,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SCRAPY_DIST_DASHBOARD_TOKEN", raising=False)
    result = CliRunner().invoke(main, ["--redis-url", redis_url, "dashboard", "books", "--host", "0.0.0.0"])
    assert result.exit_code == 1
    assert result.output.strip() == (
        "Error: the dashboard listens on 0.0.0.0 only with a token: add --token"
        " (or $SCRAPY_DIST_DASHBOARD_TOKEN), or keep the default --host 127.0.0.1")


@pytest.mark.parametrize("command", [["metrics", "books"], ["dashboard", "books"]])
def test_a_port_in_use_is_one_line(command: list[str], redis_url: str, outside_a_project: None) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        result = CliRunner().invoke(main, ["--redis-url", redis_url, *command, "--port", port])
    assert result.exit_code == 1, result.output
    assert f"cannot listen on 127.0.0.1:{port}" in result.output
    assert "Traceback" not in result.output
