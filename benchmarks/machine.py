"""What the benchmark ran on: CPU, cores, memory, OS, and the versions of everything measured."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata

from benchmarks.redis_server import redis_server_binary


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _redis_version() -> str:
    binary = redis_server_binary()
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except OSError as exc:
        return f"unavailable ({exc})"
    # "Redis server v=6.2.12 sha=... malloc=jemalloc-5.1.0 bits=64 build=..."
    fields = dict(part.split("=", 1) for part in out.split() if "=" in part)
    return f"{fields.get('v', out.strip())} (malloc={fields.get('malloc', '?')}, {binary})"


def describe() -> dict:
    """A JSON-able description of this machine and the software versions under test."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "os": f"{platform.system()} {platform.release()}",
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "scrapy": _version("scrapy"),
        "twisted": _version("twisted"),
        "redis_server": _redis_version(),
        "redis_py": _version("redis"),
        "hiredis": _version("hiredis"),
        "scrapy_redis": _version("scrapy-redis"),
        "scrapy_dist": _version("scrapy-dist"),
    }


class CpuMeter:
    """System-wide busy CPU time between ``start()`` and ``stop()``, to tell how much of the machine
    something other than the measured process used (other sessions' tests make results noisy)."""

    def __init__(self) -> None:
        self._busy = self._total = 0.0
        self._t = 0.0
        self.load_before: float | None = None

    @staticmethod
    def _read() -> tuple[float, float]:
        try:
            with open("/proc/stat") as f:
                fields = [float(x) for x in f.readline().split()[1:9]]
        except OSError:
            return 0.0, 0.0
        hz = os.sysconf("SC_CLK_TCK")
        idle = fields[3] + fields[4]  # idle + iowait
        return (sum(fields) - idle) / hz, sum(fields) / hz

    def start(self) -> CpuMeter:
        self.load_before = os.getloadavg()[0]
        self._busy, self._total = self._read()
        return self

    def stop(self, own_cpu_s: float, wall_s: float) -> dict:
        """``busy_cores``: average cores busy machine-wide; ``other_cores``: minus ``own_cpu_s``."""
        busy, _ = self._read()
        busy_cores = (busy - self._busy) / wall_s if wall_s else 0.0
        return {
            "load_avg_before": self.load_before,
            "busy_cores": round(busy_cores, 2),
            "other_cores": round(max(0.0, busy_cores - own_cpu_s / wall_s), 2) if wall_s else None,
        }
