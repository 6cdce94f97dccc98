"""Hosts for the fault benchmark: one Linux network namespace per host, joined by veth pairs to two bridges.

A :class:`Network` owns a hub namespace holding two bridges -- ``data`` (Redis, its replica, the Sentinels,
the workers' Redis traffic) and ``web`` (the site server and the workers' downloads) -- and one namespace
per host. A host has a ``data`` and/or ``web`` interface, each the far end of a veth pair whose near end
is a port of the hub's bridge; a partition sets the near end down (packets are dropped silently, as on a
real split: the far side notices only through timeouts), and healing sets it up again. The subnets
(:data:`DATA_NET`, :data:`WEB_NET`) exist only inside these namespaces, which have no route out, so
nothing is ever sent off this machine.

Namespaces are named ``sdf<pid>-<host>`` after the harness's process, so a run removes its own on exit
and, on start, those of runs whose process is gone (a crashed run), never those of a run still going.

Needs root and iproute2 (``ip netns``, ``ip link``); :func:`check_available` says in one line what is
missing. Processes run in a host with ``ip netns exec`` and, for a hostname of their own, ``unshare --uts``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from scrapy_dist.redis.embedded import pid_alive

T = TypeVar("T")

DATA_NET = "10.213.0"
WEB_NET = "10.213.1"
PREFIX = "sdf"
CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/var/run/netns")
_NAME = re.compile(rf"^{PREFIX}(\d+)-")


class HarnessUnavailable(RuntimeError):
    """The machine cannot build namespaces (not root, no iproute2); the message is one line saying why."""


def check_available() -> None:
    """Raise :class:`HarnessUnavailable` with the reason when namespaces cannot be built here."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        raise HarnessUnavailable(
            "the fault harness needs root (it builds network namespaces and veth pairs); run it as root"
        )
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            raise HarnessUnavailable(
                f"the fault harness needs '{tool}' (iproute2 / util-linux): run tests/netns/ensure_tools.sh"
            )


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def remove_namespace(name: str) -> None:
    """Kill what still runs in namespace ``name`` (SIGKILL) and delete it."""
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "del", name, check=False)


def remove_leftovers() -> list[str]:
    """Delete the namespaces of earlier runs whose harness process is gone; returns their names."""
    out = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NAME.match(name)
        if match and not pid_alive(int(match.group(1))):
            remove_namespace(name)
            out.append(name)
    return out


def call_in(namespace: str, fn: Callable[..., T], *args: Any, timeout: float = 60) -> T:
    """``fn(*args)`` on a fresh thread that joined ``namespace``'s network first: the sockets it opens
    live there (a socket belongs to the namespace of the thread that created it)."""
    result: dict[str, Any] = {}

    def target() -> None:
        fd = os.open(NETNS_DIR / namespace, os.O_RDONLY)
        try:
            if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {namespace} failed")
        finally:
            os.close(fd)
        try:
            result["value"] = fn(*args)
        except BaseException as exc:  # handed to the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"call in namespace {namespace} took over {timeout:g} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


@dataclass
class Host:
    """One namespace: its name, its addresses on each bridge and the hub-side ports that partition it."""

    name: str
    namespace: str
    index: int
    data_addr: str | None = None
    web_addr: str | None = None
    ports: dict[str, str] = field(default_factory=dict)  # "data"/"web" -> hub-side interface name


class Network:
    """The hub and the hosts of one run; a context manager that removes every namespace it made."""

    def __init__(self) -> None:
        check_available()
        self.run_id = f"{PREFIX}{os.getpid()}"
        self.hub = f"{self.run_id}-hub"
        self.hosts: dict[str, Host] = {}
        self.procs: list[subprocess.Popen[bytes]] = []
        self._made: list[str] = []

    def __enter__(self) -> Network:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        remove_leftovers()
        for name in [n for n in self._list() if n.startswith(self.run_id + "-")]:
            remove_namespace(name)  # a previous Network of this same process that was not closed
        self._add_namespace(self.hub)
        for bridge in ("data", "web"):
            _ip("-n", self.hub, "link", "add", bridge, "type", "bridge")
            _ip("-n", self.hub, "link", "set", bridge, "up")

    @staticmethod
    def _list() -> list[str]:
        return [ln.split()[0] for ln in _ip("netns", "list", check=False).stdout.splitlines() if ln.split()]

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def add_host(self, name: str, nets: Sequence[str] = ("data", "web")) -> Host:
        """A new namespace joined to the given bridges (``"data"``, ``"web"``); returns the :class:`Host`."""
        index = len(self.hosts) + 2
        host = Host(name=name, namespace=f"{self.run_id}-{name}", index=index)
        self._add_namespace(host.namespace)
        for net in nets:
            subnet = DATA_NET if net == "data" else WEB_NET
            port = f"{net[0]}{index}"
            addr = f"{subnet}.{index}"
            _ip("-n", self.hub, "link", "add", port, "type", "veth",
                "peer", "name", net, "netns", host.namespace)
            _ip("-n", self.hub, "link", "set", port, "master", net)
            _ip("-n", self.hub, "link", "set", port, "up")
            _ip("-n", host.namespace, "addr", "add", f"{addr}/24", "dev", net)
            _ip("-n", host.namespace, "link", "set", net, "up")
            host.ports[net] = port
            setattr(host, f"{net}_addr", addr)
        self.hosts[name] = host
        return host

    def cut(self, host: str, nets: Sequence[str] | None = None) -> None:
        """Partition ``host`` from the given bridges (all of its links by default)."""
        h = self.hosts[host]
        for net in nets or list(h.ports):
            _ip("-n", self.hub, "link", "set", h.ports[net], "down")

    def heal(self, host: str, nets: Sequence[str] | None = None) -> None:
        """Undo :meth:`cut`."""
        h = self.hosts[host]
        for net in nets or list(h.ports):
            _ip("-n", self.hub, "link", "set", h.ports[net], "up")

    def spawn(
        self, host: str, argv: Sequence[str], log: Path, *, hostname: str | None = None,
        env: dict[str, str] | None = None, cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in ``host``'s namespace (with its own hostname if given), output to ``log``.
        The returned process's pid is the program's own (``ip netns exec``, ``unshare`` and ``sh`` exec)."""
        cmd = ["ip", "netns", "exec", self.hosts[host].namespace]
        if hostname:
            cmd += ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', hostname]
        cmd += list(argv)
        with open(log, "ab") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        self.procs.append(proc)
        return proc

    def call(self, host: str, fn: Callable[..., T], *args: Any, timeout: float = 60) -> T:
        """``fn(*args)`` with its sockets in ``host``'s namespace (see :func:`call_in`)."""
        return call_in(self.hosts[host].namespace, fn, *args, timeout=timeout)

    def close(self) -> None:
        """Kill every process started here, then delete every namespace made here."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGCONT)
                    proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
        for name in reversed(self._made):
            remove_namespace(name)
        self._made.clear()

