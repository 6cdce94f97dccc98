"""`scrapy-dist demo --redis-url` keeps the Redis password off the workers' command lines (``ps``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis
from helpers import read_demo_until_crawling

PASSWORD = "pw-Never-In-Argv-7f3a"


def test_worker_argv_holds_no_password(redis_url: str, redis_client: redis.Redis) -> None:
    # A password-protected user on the session server (dropped at the end).
    redis_client.acl_setuser("demo-secret", enabled=True, passwords=[f"+{PASSWORD}"],
                             keys=["*"], channels=["*"], commands=["+@all"])
    url = redis_url.replace("redis://", f"redis://demo-secret:{PASSWORD}@")
    try:
        _check_demo(url)
    finally:
        redis_client.acl_deluser("demo-secret")


def _cmdline(pid: int) -> str:
    """What ``ps`` shows as the command line of ``pid`` (waiting out the moment before exec)."""
    for _ in range(100):
        try:
            text = Path(f"/proc/{pid}/cmdline").read_bytes().decode().replace("\0", " ")
        except OSError:
            return ""
        if "crawl" in text:
            return text
        time.sleep(0.05)
    return text


def _check_demo(url: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "SCRAPY_SETTINGS_MODULE")}
    proc = subprocess.Popen(
        [sys.executable, "-c", "from scrapy_dist.cli import main; main()", "demo", "--workers", "2",
         "--pages", "300", "--no-chaos", "--redis-url", url],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    argvs: list[str] = []
    try:
        lines, crawled = read_demo_until_crawling(proc, lambda pid: argvs.append(_cmdline(pid)))
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines) + rest
    # The workers did reach the password-protected Redis (pages got crawled) ...
    assert len(argvs) == 2, out
    assert crawled, out
    # ... and the password was on no command line, nor in the demo's output.
    for argv in argvs:
        assert "scrapy" in argv and "crawl" in argv, out
        assert PASSWORD not in argv, argv
    assert PASSWORD not in out
