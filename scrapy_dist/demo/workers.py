"""The demo's workers: real ``scrapy crawl demo`` processes of the example project, started, watched,
stopped and (for chaos) killed by :mod:`scrapy_dist.demo.run`. They reach the demo's Redis without its
password in the process list (:func:`worker_env`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scrapy_dist.demo.report import Snapshot, WorkerRow
from scrapy_dist.exceptions import ScrapyDistError

__all__ = [
    "EXAMPLE_PROJECT",
    "SPIDER",
    "STOP_GRACE",
    "Worker",
    "WorkerFleet",
    "fleet_rows",
    "locate_project",
    "worker_env",
    "worker_settings",
]

#: The spider every worker runs.
SPIDER = "demo"
#: Seconds a stopped worker gets to close cleanly (give its leases back) before it is killed.
STOP_GRACE = 10.0

_WORKER_SETTINGS_MODULE = "scrapy_dist_demo_worker_settings"
_WORKER_URL_VARIABLE = "SCRAPY_DIST_DEMO_REDIS_URL"

#: ``example_project/`` of a source checkout: the repository root is the package's parent directory.
EXAMPLE_PROJECT = Path(__file__).resolve().parents[2] / "example_project"
#: where a wheel carries example_project (pyproject.toml: tool.hatch.build.targets.wheel.force-include)
PACKAGED_PROJECT = Path(__file__).resolve().parents[1] / "_example_project"


def _is_project(path: Path) -> bool:
    return (path / "scrapy.cfg").is_file() and (path / "example_project" / "spiders" / "demo.py").is_file()


def locate_project(run_dir: Path, example: Path | None = None) -> tuple[Path, bool]:
    """The project directory the workers run in, and whether it is the wheel's packaged copy.

    ``example_project/`` of the source checkout when it is there, else the copy inside the package.
    """
    example = EXAMPLE_PROJECT if example is None else example
    if _is_project(example):
        return example, False
    if _is_project(PACKAGED_PROJECT):
        return PACKAGED_PROJECT, True
    raise ScrapyDistError(f"example_project not found (looked in {example} and {PACKAGED_PROJECT})")


@dataclass
class Worker:
    """One ``scrapy crawl demo`` process started by the demo."""

    number: int
    proc: subprocess.Popen[bytes]
    log: Path
    state: str = "running"  #: running, killed, exited, failed, stopped
    exit_status: int | None = None
    killed_at: float | None = None  #: monotonic time of the chaos SIGKILL

    @property
    def pid(self) -> int:
        return self.proc.pid

    def describe_failure(self, lines: int = 8) -> str:
        """Which worker failed and how, with the end of its log."""
        try:
            tail = self.log.read_text(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            tail = []
        head = f"worker {self.number} (pid {self.pid}): exit status {self.exit_status}; log {self.log}"
        return "\n".join([head, *(f"    {line}" for line in tail)])


def _project_settings_module(project: Path) -> str:
    """The settings module named by the project's ``scrapy.cfg``."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(project / "scrapy.cfg")
    return cfg.get("settings", "default", fallback="example_project.settings")


def worker_settings(prefix: str, embedded_dir: Path | None) -> dict[str, str]:
    """``-s`` settings of every worker: this run's key prefix and the demo's Redis (``embedded_dir``: the
    directory of the embedded Redis the demo uses, ``None`` for a Redis given by URL)."""
    # the demo site is on 127.0.0.1, which the default SCHEDULER_DENY_NETWORKS refuses
    out = {"REDIS_KEY_PREFIX": prefix, "SCHEDULER_DENY_NETWORKS": ""}
    if embedded_dir is not None:
        # Point the workers at the embedded server by its directory rather than its URL, so its
        # password stays out of the process list; blank the other Redis settings so that a REDIS_URL
        # added to the project's settings.py cannot send the workers elsewhere.
        out.update({
            "REDIS_URL": "", "REDIS_HOST": "", "REDIS_PORT": "", "REDIS_SENTINELS": "",
            "REDIS_EMBEDDED_DIR": str(embedded_dir),
        })
    else:
        # The URL (and its password) reaches the workers by environment, never on the command line
        # (which every local user can read with `ps`): see worker_env().
        out.update({"REDIS_SENTINELS": ""})
    return out


def worker_env(project: Path, run_dir: Path, redis_url: str | None) -> dict[str, str]:
    """Environment of every worker. With a ``redis_url`` (``None``: the embedded Redis) the URL goes in
    ``SCRAPY_DIST_DEMO_REDIS_URL`` (a process's environment is readable only by its user) and
    ``SCRAPY_SETTINGS_MODULE`` names a small settings module, written once into ``run_dir``, that loads the
    project's settings and takes ``REDIS_URL`` from that variable."""
    env = {k: v for k, v in os.environ.items() if k not in ("SCRAPY_SETTINGS_MODULE", "SCRAPY_PROJECT")}
    if redis_url is None:
        return env
    module_dir = run_dir / "worker-settings"
    module_dir.mkdir(mode=0o700, exist_ok=True)
    base = _project_settings_module(project)
    (module_dir / f"{_WORKER_SETTINGS_MODULE}.py").write_text(
        f"import os\n\nfrom {base} import *  # noqa: F403\n\n"
        f'REDIS_URL = os.environ["{_WORKER_URL_VARIABLE}"]\nREDIS_HOST = REDIS_PORT = None\n'
    )
    env[_WORKER_URL_VARIABLE] = redis_url
    env["SCRAPY_SETTINGS_MODULE"] = _WORKER_SETTINGS_MODULE
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(module_dir), str(project), os.environ.get("PYTHONPATH", "")) if p
    )
    return env


@dataclass
class WorkerFleet:
    """The workers of one demo run, all started in ``project`` with the same settings and environment,
    each logging to ``worker-<n>.log`` in ``run_dir``."""

    project: Path
    run_dir: Path
    settings: dict[str, str]
    env: dict[str, str]
    workers: list[Worker] = field(default_factory=list)

    def start(self) -> Worker:
        """Start one ``scrapy crawl demo`` in the project, its output going to ``worker-<n>.log``."""
        number = len(self.workers) + 1
        cmd = [sys.executable, "-m", "scrapy", "crawl", SPIDER]
        for name, value in self.settings.items():
            cmd += ["-s", f"{name}={value}"]
        log = self.run_dir / f"worker-{number}.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                cmd, cwd=self.project, env=self.env, stdin=subprocess.DEVNULL, stdout=fh,
                stderr=subprocess.STDOUT,
                # Own process group: Ctrl-C in the terminal reaches the demo only, which then stops the
                # workers itself (gracefully, then for good).
                start_new_session=True,
            )
        worker = Worker(number, proc, log)
        self.workers.append(worker)
        return worker

    def reap(self) -> None:
        """Note the workers that exited."""
        for w in self.workers:
            if w.state == "running" and w.proc.poll() is not None:
                w.exit_status = w.proc.returncode
                w.state = "exited" if w.exit_status == 0 else "failed"

    def running(self) -> list[Worker]:
        return [w for w in self.workers if w.state == "running"]

    def stop(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM the running workers (Scrapy closes cleanly and gives its leases back), SIGKILL them
        after ``grace`` seconds."""
        alive = self.running()
        for w in alive:
            with contextlib.suppress(ProcessLookupError):
                w.proc.terminate()
        deadline = time.monotonic() + grace
        for w in alive:
            try:
                w.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            w.exit_status = w.proc.returncode
            w.state = "stopped"

    def kill(self, worker: Worker) -> None:
        """SIGKILL one worker (chaos): its leased requests go back to the queue once their leases run out."""
        worker.proc.kill()
        worker.proc.wait()
        worker.state = "killed"
        worker.killed_at = time.monotonic()
        worker.exit_status = worker.proc.returncode


def fleet_rows(
    snap: Snapshot, workers: list[Worker], status_rows: dict[int, dict[str, Any]], meters: dict[int, Any],
    now: float, lease_seconds: float,
) -> None:
    """Add one :class:`WorkerRow` per worker to ``snap`` from its process state and its row in the crawl's
    status (``status_rows`` by pid); a killed worker's leases count as orphaned until they expire.
    ``meters`` keeps a rate meter per pid between calls."""
    from scrapy_dist.demo.site import RATE_WINDOW
    from scrapy_dist.extensions.clusterstats import RateMeter

    for w in workers:
        row = status_rows.get(w.pid)
        state = w.state
        pages = leases = None
        rate = None
        if row is not None:
            pages, leases = row["pages"], row["leases"]
            meter = meters.setdefault(w.pid, RateMeter(span=RATE_WINDOW))  # as the site tally
            meter.add(float(pages), now)
            rate = meter.per_minute() / 60.0
            if state == "running" and row["state"] == "closed":
                state = "closing"
        elif state == "running":
            state = "starting"
        if w.state == "killed":
            # its leases stay listed until they expire: the crawl waits for them (see orphan_note)
            state, rate = "killed (chaos)", None
            if leases and w.killed_at is not None:
                snap.orphaned += leases
                snap.orphaned_expire_in = max(snap.orphaned_expire_in, w.killed_at + lease_seconds - now)
        elif w.state in ("exited", "failed", "stopped"):
            state, rate, leases = f"{w.state} ({w.exit_status})", None, None
        snap.workers.append(WorkerRow(w.number, w.pid, state, pages, rate, leases))
