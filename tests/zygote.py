"""A Python that has already imported Scrapy, Twisted, redis-py and scrapy-dist, and forks ``scrapy crawl``
workers for the end-to-end tests.

A worker started with ``python -m scrapy crawl`` spends most of its CPU before crawling: importing Scrapy,
Twisted and their components costs about as much as a short test crawl, and the end-to-end tests start
hundreds of workers on a two-core machine. :func:`start` forks each worker from this pre-imported process
instead (the reactor is not installed before the fork: the worker installs its own, as ``scrapy crawl``
does), so a worker is still a real process of its own -- its own pid, killed with SIGKILL, stopped with
SIGSTOP, its exit code reported -- that runs Scrapy's own ``scrapy crawl`` from its first line of
``scrapy.cmdline.execute``.

The server (``python tests/zygote.py``, one per test process, started on first use) reads requests on a
``SOCK_SEQPACKET`` Unix socket: a JSON message ``{"argv", "cwd", "env"}`` with the worker's log file
descriptor attached. It answers with the pid, then, on the same connection, the exit code (as
:class:`subprocess.Popen` reports it: minus the signal's number for a worker killed by one). It exits when
the test process that started it closes its stdin.

:meth:`Zygote.run_cli` forks a ``scrapy-dist`` command (or a short ``python -m scrapy`` one) the same way:
its entry point (``scrapy_dist.cli:main``, ``scrapy.cmdline.execute``) called in the child with the
command's argv, working directory, environment and standard input; its exit code and output as
:func:`subprocess.run` gives them. A few tests keep running the real console scripts and interpreter.

Set ``SCRAPY_DIST_TEST_FORK=0`` to start every worker and command with a fresh interpreter instead.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import json
import locale
import os
import pkgutil
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

_BUFFER = 1 << 20


def _preload() -> None:
    """Import what a crawl imports: Scrapy's default components (named in its default settings), the
    download handlers, and every scrapy-dist module. Missing optional dependencies are skipped."""
    from scrapy.settings import default_settings

    import scrapy_dist

    paths: set[str] = set()
    for name in dir(default_settings):
        value = getattr(default_settings, name)
        for path in value if isinstance(value, dict) else [value]:
            if isinstance(path, str) and path.startswith("scrapy.") and "." in path:
                paths.add(path.rsplit(".", 1)[0])
    paths.update(["scrapy.cmdline", "scrapy.crawler", "scrapy.core.engine", "scrapy.commands.crawl",
                  "scrapy.core.downloader.handlers.http11", "scrapy.core.downloader.contextfactory",
                  "twisted.internet.asyncioreactor", "redis.asyncio"])
    paths.update(m.name for m in pkgutil.walk_packages(scrapy_dist.__path__, "scrapy_dist."))
    for path in sorted(paths):
        with contextlib.suppress(Exception):  # an optional dependency of a component no test uses
            importlib.import_module(path)
    if "twisted.internet.reactor" in sys.modules:
        raise SystemExit("zygote: a preloaded module installed a reactor: the workers must choose theirs")
    # the bloom filter's sizes are cached per process: planned once here for the test projects' capacity
    # and the default one, instead of in every worker that opens a filter
    from scrapy_dist.dupefilter.bloom import BloomPlan

    for capacity in (100_000, 100_000_000):
        BloomPlan(capacity, 0.001)


def _serve(path: str) -> dict[str, Any] | None:
    """Serve until stdin closes (returns None) or, in a forked worker, return that worker's request."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    conns: list[socket.socket] = []
    while True:
        readable, _, _ = select.select([sys.stdin, listener, *conns], [], [], 0.02)
        if sys.stdin in readable and not sys.stdin.buffer.read1(1):
            for pid in children:
                _kill(pid)
            return None
        if listener in readable:
            conns.append(listener.accept()[0])
        for conn in [c for c in conns if c in readable]:
            conns.remove(conn)
            message, fds, _, _ = socket.recv_fds(conn, _BUFFER, 3)
            if not message:
                for fd in fds:
                    os.close(fd)
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in [*conns, *children.values()]:
                    other.close()
                conn.close()
                request: dict[str, Any] = json.loads(message)
                request["fds"] = fds
                return request
            for fd in fds:
                os.close(fd)
            conn.send(json.dumps({"pid": pid}).encode())
            children[pid] = conn
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid)
            with contextlib.suppress(OSError):
                conn.send(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode())
            conn.close()


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _run_worker(request: dict[str, Any]) -> None:
    """In the forked child: become ``python -m scrapy <argv>`` (or the ``scrapy-dist`` command, for a request
    whose ``entry`` is ``scrapy-dist``) in ``cwd`` with ``env``."""
    fds = request["fds"]
    if len(fds) == 3:  # stdin, stdout, stderr of their own
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
    else:  # the output to one file, nothing to read
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[0], 2)
        os.close(devnull)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    if request.get("netns"):
        _enter_host(request["netns"], request["hostname"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    # as `python -m` or `python -c`: the working directory first, not tests/ (a console script: its bin/)
    sys.path[:1] = [request.get("path0") or request["cwd"], *extra]
    for entry in extra:  # what the interpreter would have imported at start-up from its PYTHONPATH
        if (Path(entry) / "sitecustomize.py").exists():
            sys.modules.pop("sitecustomize", None)
            importlib.import_module("sitecustomize")
            break
    if request.get("entry") == "scrapy-dist":
        # click names the program after argv[0]: "-c" for `python -c`, the script's path for the console
        # script
        sys.argv = [request.get("argv0") or "scrapy-dist", *request["argv"]]
        from scrapy_dist.cli import main

        main()
        return
    sys.argv = ["scrapy", *request["argv"]]
    from scrapy.cmdline import execute

    execute(sys.argv)


def _enter_host(namespace: str, hostname: str) -> None:
    """Join network namespace ``namespace`` (``ip netns``) with a hostname of its own, as ``ip netns exec
    NAMESPACE unshare --uts`` + ``hostname`` do for the fault tests' workers."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0 or libc.unshare(0x04000000) != 0:  # CLONE_NEWNET, CLONE_NEWUTS
            raise OSError(ctypes.get_errno(), f"cannot enter namespace {namespace}")
    finally:
        os.close(fd)
    socket.sethostname(hostname)


class ForkedWorker:
    """The :class:`subprocess.Popen` face of a worker forked by the zygote (its output goes to a file, or
    to pipes read through ``stdout`` and ``stderr``)."""

    stdin = None

    def __init__(self, args: list[str], pid: int, conn: socket.socket) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn
        self.stdout: io.TextIOWrapper | None = None
        self.stderr: io.TextIOWrapper | None = None

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """As :meth:`subprocess.Popen.communicate` (nothing to send): both outputs to their end, the exit."""
        outputs: dict[int, str] = {}
        streams = [s for s in (self.stdout, self.stderr) if s is not None]

        def read(i: int, stream: io.TextIOWrapper) -> None:
            outputs[i] = stream.read()

        readers = [threading.Thread(target=read, args=(i, s), daemon=True) for i, s in enumerate(streams)]
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for stream in streams:
            stream.close()
        got = iter(outputs[i] for i in range(len(streams)))
        return (next(got) if self.stdout else None), (next(got) if self.stderr else None)

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._collect()
        assert self.returncode is not None
        return self.returncode

    def _collect(self) -> None:
        message = self._conn.recv(_BUFFER)
        self._conn.close()
        if not message:
            raise RuntimeError(f"the zygote went away before worker {self.pid} ended")
        self.returncode = json.loads(message)["code"]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> ForkedWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.wait()


class Zygote:
    """The client: starts the server on first use, one per test process."""

    _lock = threading.Lock()
    _server: subprocess.Popen[bytes] | None = None
    _path = ""

    @classmethod
    def enabled(cls) -> bool:
        return os.environ.get("SCRAPY_DIST_TEST_FORK", "1") != "0" and hasattr(os, "fork")

    @classmethod
    def _ensure(cls) -> str:
        with cls._lock:
            if cls._server is None or cls._server.poll() is not None:
                cls._path = os.path.join(tempfile.mkdtemp(prefix="zygote-"), "sock")
                cls._server = subprocess.Popen(
                    [sys.executable, __file__, cls._path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                )
                assert cls._server.stdout is not None
                line = cls._server.stdout.readline()
                if line.strip() != b"ready":
                    raise RuntimeError("the test zygote did not start (SCRAPY_DIST_TEST_FORK=0: without it)")
            return cls._path

    @classmethod
    def start(cls, argv: list[str], cwd: Path, env: dict[str, str], out: int, netns: str = "",
              hostname: str = "") -> ForkedWorker:
        """Fork ``python -m scrapy <argv>`` in ``cwd`` with ``env``, its output to file descriptor ``out``
        (in network namespace ``netns`` with its own ``hostname``, if given)."""
        return cls._fork({"argv": argv, "cwd": str(cwd), "env": env, "netns": netns, "hostname": hostname},
                         [out], [sys.executable, "-m", "scrapy", *argv])

    @classmethod
    def _fork(cls, request: dict[str, Any], fds: list[int], args: list[str]) -> ForkedWorker:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(cls._ensure())
        socket.send_fds(conn, [json.dumps(request).encode()], fds)
        pid = json.loads(conn.recv(_BUFFER))["pid"]
        return ForkedWorker(args, pid, conn)

    @classmethod
    def run_cli(
        cls,
        args: list[str],
        cwd: Path | str | None = None,
        env: dict[str, str] | None = None,
        input: str | None = None,  # noqa: A002 -- as subprocess.run's
        timeout: float | None = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """``subprocess.run(args, capture_output=True, text=True, ...)`` for a ``scrapy-dist`` command --
        ``args`` starting with the console script's path or with ``python -c "from scrapy_dist.cli import
        main; main()"`` -- or a ``python -m scrapy`` command, forked from the zygote: the same entry point,
        argv, working directory, environment, standard input, exit code and output. Without the zygote
        (SCRAPY_DIST_TEST_FORK=0), ``subprocess.run`` itself."""
        env = dict(os.environ if env is None else env)
        cwd = os.getcwd() if cwd is None else str(cwd)
        if not cls.enabled():
            return subprocess.run(args, cwd=cwd, env=env, input=input, capture_output=True, text=True,
                                  timeout=timeout, check=check)
        request = cls._command(args, cwd, env)
        with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as out, \
                tempfile.TemporaryFile() as err:
            if input is not None:
                stdin.write(input.encode(locale.getpreferredencoding(False)))
                stdin.seek(0)
            proc = cls._fork(request, [stdin.fileno(), out.fileno(), err.fileno()], args)
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise
            output = []
            for fh in (out, err):
                fh.seek(0)
                # as text=True: the locale's encoding, universal newlines
                output.append(io.TextIOWrapper(io.BytesIO(fh.read()),
                                               encoding=locale.getpreferredencoding(False)).read())
        done = subprocess.CompletedProcess(args, code, output[0], output[1])
        if check:
            done.check_returncode()
        return done

    @classmethod
    def popen_cli(
        cls, args: list[str], cwd: Path | str | None = None, env: dict[str, str] | None = None,
    ) -> subprocess.Popen[str] | ForkedWorker:
        """``subprocess.Popen(args, stdout=PIPE, stderr=PIPE, text=True, ...)`` for a command
        :meth:`run_cli` takes, forked from the zygote (standard input: nothing to read)."""
        env = dict(os.environ if env is None else env)
        cwd = os.getcwd() if cwd is None else str(cwd)
        if not cls.enabled():
            return subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
        request = cls._command(args, cwd, env)
        (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
        devnull = os.open(os.devnull, os.O_RDONLY)
        try:
            proc = cls._fork(request, [devnull, out_w, err_w], args)
        finally:
            for fd in (devnull, out_w, err_w):
                os.close(fd)
        encoding = locale.getpreferredencoding(False)
        proc.stdout = open(out_r, encoding=encoding)  # noqa: SIM115 -- closed by the caller, as Popen's
        proc.stderr = open(err_r, encoding=encoding)  # noqa: SIM115
        return proc

    @staticmethod
    def _command(args: list[str], cwd: str, env: dict[str, str]) -> dict[str, Any]:
        """The zygote's request for a command line :meth:`run_cli` takes."""
        entry = "scrapy-dist"
        if args[:3] == [sys.executable, "-m", "scrapy"]:
            entry, argv0, path0, argv = "scrapy", "scrapy", cwd, args[3:]
        elif args[:2] == [sys.executable, "-c"]:
            assert args[2].replace(" ", "") == "fromscrapy_dist.cliimportmain;main()", args
            argv0, path0, argv = "-c", cwd, args[3:]
        else:
            assert Path(args[0]).name == "scrapy-dist", args
            script = shutil.which(args[0], path=env.get("PATH")) if os.sep not in args[0] else args[0]
            assert script, args
            argv0, path0, argv = args[0], str(Path(script).resolve().parent), args[1:]
        return {"argv": argv, "cwd": cwd, "env": env, "entry": entry, "argv0": argv0, "path0": path0}


if __name__ == "__main__":
    _preload()
    # what is imported now lives as long as any worker: out of the collector's sight, a worker's collections
    # (and the last one, at exit) no longer walk -- and copy, page by page -- every object of Scrapy,
    # Twisted and the rest it shares with this process
    gc.freeze()
    work = _serve(sys.argv[1])
    if work is not None:
        _run_worker(work)
