"""The CLI never works on the wrong thing quietly: the real ``scrapy-dist`` entry point outside
any project, in a fresh ``scrapy startproject`` project with a typo in the spider name, and one meaning per
short flag."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from zygote import Zygote

BIN = Path(sys.executable).parent
SCRAPY_DIST = str(BIN / "scrapy-dist")


def cli(cwd: Path, *args: str, redis_url: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "SCRAPY_SETTINGS_MODULE")}
    if redis_url:
        env["REDIS_URL"] = redis_url
    return subprocess.run([SCRAPY_DIST, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def shop_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``scrapy startproject shopproj`` plus one spider, ``shop``."""
    root = tmp_path_factory.mktemp("proj")
    subprocess.run([str(BIN / "scrapy"), "startproject", "shopproj"], cwd=root, check=True,
                   capture_output=True, timeout=60)
    project = root / "shopproj"
    (project / "shopproj" / "spiders" / "shop.py").write_text(
        "import scrapy\n\n\nclass Shop(scrapy.Spider):\n    name = 'shop'\n"
    )
    return project


@pytest.mark.parametrize("command", [["status", "site"], ["pause", "site"], ["items", "site"],
                                     ["dead", "site"], ["push", "site", "http://a.example/"],
                                     ["redis-cli", "ping"]])
def test_outside_a_project_without_redis_one_line_and_no_embedded_server(
    tmp_path: Path, command: list[str]
) -> None:
    res = cli(tmp_path, *command)
    assert res.returncode == 1, res
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("scrapy-dist: no Scrapy project here")
    assert "--redis-url URL or $REDIS_URL" in lines[0]
    assert not (tmp_path / ".scrapy").exists()  # no fresh embedded server started in the cwd


def test_outside_a_project_an_explicit_redis_is_used(tmp_path: Path, redis_url: str) -> None:
    res = cli(tmp_path, "status", "site", "--json", redis_url=redis_url)
    assert res.returncode == 0, res.stderr
    assert '"spider": "site"' in res.stdout


@pytest.mark.parametrize("command", ["status", "pause", "push", "items", "dead", "resume"])
def test_an_unknown_spider_is_refused_with_the_closest_name(
    shop_project: Path, redis_url: str, command: str
) -> None:
    extra = ["http://a.example/"] if command == "push" else []
    res = cli(shop_project, command, "shpo", *extra, redis_url=redis_url)
    assert res.returncode == 1, res
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert lines == ["scrapy-dist: no spider 'shpo' in this project (did you mean 'shop'? it has: shop); "
                     "--force to use the name anyway"]


def test_force_goes_ahead_with_an_unknown_name(
    shop_project: Path, redis_url: str, redis_client: object
) -> None:
    res = cli(shop_project, "push", "shpo", "http://a.example/", "--force", redis_url=redis_url)
    assert res.returncode == 0, res.stderr
    assert redis_client.lrange("shpo:start_urls", 0, -1) == [b"http://a.example/"]  # type: ignore[attr-defined]
    assert cli(shop_project, "status", "shop", "--json", redis_url=redis_url).returncode == 0


def test_short_f_means_follow_everywhere(tmp_path: Path) -> None:
    # option parsing only: the console script's entry point forked from the zygote, as most CLI tests do
    def forked(*args: str, redis_url: str = "") -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "SCRAPY_SETTINGS_MODULE")}
        env.update({"REDIS_URL": redis_url} if redis_url else {})
        return Zygote.run_cli([SCRAPY_DIST, *args], cwd=tmp_path, env=env, timeout=60)

    items_help = forked("items", "--help").stdout
    assert "-f, --follow" in items_help
    push = forked("push", "site", "-f", "urls.txt", redis_url="redis://127.0.0.1:1/0")
    assert push.returncode == 2 and "No such option '-f'" in push.stderr
    assert "--file" in forked("push", "--help").stdout
