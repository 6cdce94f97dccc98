"""Subprocesses of the benchmarks (``scrapy crawl`` workers)."""

from __future__ import annotations

import signal
import subprocess


def interrupt(proc: subprocess.Popen, grace: float) -> None:
    """Stop a crawl as Ctrl-C does (SIGINT: a graceful close), killing it after ``grace`` seconds."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
