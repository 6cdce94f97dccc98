"""Which processes are the embedded Redis servers: the ``Popen`` handles of those this process started,
and whether a pid (read from an untrusted state file) is a live ``redis-server`` working in a given
directory, so that a recycled pid or another project's server is never taken for ours."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

__all__ = ["children", "pid_alive", "pid_is_redis"]

# Popen handles of servers this process started: kept so they are reaped after shutdown() and never
# garbage-collected while running (which would only warn; the server keeps running either way).
children: dict[int, subprocess.Popen[bytes]] = {}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):
        return False
    child = children.get(pid)
    # An exited process is a zombie until its parent reaps it: kill(0) succeeds but it is dead.
    if child is not None:
        return child.poll() is None
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def pid_is_redis(pid: int, directory: Path) -> bool:
    """Whether ``pid`` is a live redis-server working in ``directory`` (so a recycled pid, or another
    project's server, is not mistaken for ours)."""
    if not pid_alive(pid):
        return False
    try:
        if "redis" not in Path(f"/proc/{pid}/comm").read_text():
            return False
        return os.path.realpath(f"/proc/{pid}/cwd") == os.path.realpath(directory)
    except OSError:  # no /proc (macOS) or not ours to inspect: ask ps for the name only
        try:
            out = subprocess.run(
                ["ps", "-o", "comm=", "-p", str(pid)], capture_output=True, text=True, timeout=5
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return True
        return "redis" in out
