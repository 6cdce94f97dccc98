"""Start a real local Redis Cluster (masters, optional replicas) and Redis Sentinels for tests.

Both use the ``redis-server`` binary the other fixtures use (:func:`redis_servers.redis_server_binary`),
so a cluster test exercises the same Redis version as the rest of the suite. The cluster is formed with
plain commands (``CLUSTER ADDSLOTS``, ``CLUSTER MEET``, ``CLUSTER REPLICATE``) rather than
``redis-cli --cluster create``: that works on Redis 6.2 and 7 alike and needs no second binary.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import redis
from helpers import wait_for
from redis_servers import RedisProcess, cluster_port, free_port, redis_server_binary

SLOTS = 16384


def start_own(extra_args: list[str], port: Callable[[], int] = free_port, attempts: int = 5) -> RedisProcess:
    """Start a redis-server and make sure the one answering on its port is this one: on a busy machine
    another program can take the free port first, and the ping of ``RedisProcess.start()`` would then
    reach that program's Redis."""
    for _ in range(attempts):
        server = RedisProcess(port=port(), extra_args=extra_args)
        try:
            server.start()
        except RuntimeError:  # ours exited (port taken) and nothing answers there either
            server.stop()
            continue
        if is_own(server):
            return server
        server.stop()
    raise RuntimeError("could not start a redis-server on a port of its own")


def is_own(server: RedisProcess) -> bool:
    """Whether the Redis answering on ``server.port`` is ``server``'s process."""
    assert server.proc is not None
    if server.proc.poll() is not None:
        return False
    with redis.Redis(port=server.port, socket_timeout=5) as c:
        try:
            return int(c.info("server")["process_id"]) == server.proc.pid
        except redis.RedisError:
            return False


def _wait(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.05) -> None:
    # a node that is starting, failing over or re-syncing may refuse connections or commands for a while
    wait_for(condition, timeout, what, interval, ignore=(redis.RedisError, OSError))


class LocalCluster:
    """A Redis Cluster of ``masters`` masters with ``replicas`` replicas each, on 127.0.0.1.

    ``node_timeout_ms`` is ``cluster-node-timeout``: how long a master may be silent before its replica
    takes over. Replicas fail over even after a long disconnection (``cluster-replica-validity-factor
    0``) and sync without the default 5 s delay, so a test's failover happens within ~2 timeouts.
    """

    def __init__(
        self,
        masters: int = 3,
        replicas: int = 0,
        node_timeout_ms: int = 1000,
        extra_args: list[str] | None = None,
    ) -> None:
        self.n_masters = masters
        self.n_replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.extra_args = extra_args or []
        self.nodes: list[RedisProcess] = []
        self.ids: dict[int, str] = {}  # port -> node id

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> LocalCluster:
        args = [
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--cluster-replica-validity-factor", "0",
            "--repl-diskless-sync", "yes",
            "--repl-diskless-sync-delay", "0",
            *self.extra_args,
        ]
        total = self.n_masters * (1 + self.n_replicas)
        try:
            for _ in range(total):
                self.nodes.append(start_own(args, port=cluster_port))
            self._form(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _form(self, timeout: float) -> None:
        masters = self.nodes[: self.n_masters]
        for node in self.nodes:
            with redis.Redis(port=node.port, decode_responses=True) as c:
                self.ids[node.port] = c.execute_command("CLUSTER", "MYID")
        for i, node in enumerate(masters):
            lo, hi = i * SLOTS // self.n_masters, (i + 1) * SLOTS // self.n_masters
            with redis.Redis(port=node.port) as c:
                c.execute_command("CLUSTER", "ADDSLOTS", *range(lo, hi))
        with redis.Redis(port=self.nodes[0].port) as first:
            for node in self.nodes[1:]:
                first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
        # A node can only replicate a master it already knows.
        _wait(lambda: all(self._known(n) >= len(self.nodes) for n in self.nodes), timeout, "cluster MEET")
        for j, node in enumerate(self.nodes[self.n_masters :]):
            master = masters[j % self.n_masters]
            with redis.Redis(port=node.port) as c:
                c.execute_command("CLUSTER", "REPLICATE", self.ids[master.port])
        self.wait_ok(timeout)
        for node in self.nodes[self.n_masters :]:
            _wait_in_sync(node, timeout)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    # -- inspection -----------------------------------------------------------------------------
    @staticmethod
    def _known(node: RedisProcess) -> int:
        with redis.Redis(port=node.port, decode_responses=True, socket_timeout=2) as c:
            lines = c.execute_command("CLUSTER", "NODES")
        text = lines if isinstance(lines, str) else "\n".join(lines)
        return sum(1 for line in text.splitlines() if line.strip() and "handshake" not in line)

    def alive(self) -> list[RedisProcess]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    @property
    def url(self) -> str:
        """URL of one live node (any node of a cluster will do for a cluster client)."""
        return self.alive()[0].url

    def _state_ok(self, node: RedisProcess) -> bool:
        with redis.Redis(port=node.port, socket_timeout=2) as c:
            return "cluster_state:ok" in _cluster_info(c)

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node reports ``cluster_state:ok``."""
        _wait(lambda: all(self._state_ok(n) for n in self.alive()), timeout, "cluster_state:ok")

    def flushall(self) -> None:
        """Empty every live node (a cluster shared by a module's tests)."""
        for node in self.alive():
            with redis.Redis(port=node.port, socket_timeout=5) as c:
                c.flushall()

    def master_of(self, key: str) -> RedisProcess:
        """The live node that currently serves ``key``'s slot as a master."""
        node = self.alive()[0]
        with redis.Redis(port=node.port, socket_timeout=2) as c:
            slot = int(c.execute_command("CLUSTER", "KEYSLOT", key))
            for lo, hi, primary, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if lo <= slot <= hi:
                    port = int(primary[1])
                    return next(n for n in self.nodes if n.port == port)
        raise RuntimeError(f"slot of {key!r} is not served")

    def kill(self, node: RedisProcess) -> None:
        """SIGKILL one node (no shutdown, no final save)."""
        node.kill()

    def wait_failover(self, key: str, old: RedisProcess, timeout: float = 30.0) -> RedisProcess:
        """Until a live node other than ``old`` serves ``key`` and the cluster is ok again; returns it."""

        def promoted() -> bool:
            return self.master_of(key) is not old

        _wait(promoted, timeout, f"a replica to take over {key!r}", interval=0.1)
        self.wait_ok(timeout)
        return self.master_of(key)


def _replication(node: RedisProcess) -> dict[str, object]:
    with redis.Redis(port=node.port, decode_responses=True, socket_timeout=2) as c:
        return dict(c.info("replication"))


def _wait_in_sync(replica: RedisProcess, timeout: float) -> None:
    def up() -> bool:
        return _replication(replica)["master_link_status"] == "up"

    _wait(up, timeout, f"replica {replica.port} in sync")


def _cluster_info(client: redis.Redis) -> str:
    raw = client.execute_command("CLUSTER INFO")
    if isinstance(raw, dict):
        return "\n".join(f"{k}:{v}" for k, v in raw.items())
    return raw.decode() if isinstance(raw, bytes) else str(raw)


class SentinelProcess:
    """One ``redis-server --sentinel`` on 127.0.0.1 watching ``master_name``.

    ``down_after_ms`` is how long the master may be silent before it is considered down; with a quorum
    of ``quorum`` Sentinels agreeing, one of them promotes a replica.
    """

    def __init__(
        self,
        master_port: int,
        master_name: str = "mymaster",
        quorum: int = 1,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
        password: str | None = None,
    ) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="scrapy-dist-sentinel-"))
        self.master_port = master_port
        self.master_name = master_name
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.password = password  # the Sentinel's own requirepass
        self.proc: subprocess.Popen[bytes] | None = None

    def _config(self) -> str:
        m = self.master_name
        lines = [
            f"port {self.port}",
            "bind 127.0.0.1",
            f"dir {self.dir}",
            f"logfile {self.dir / 'sentinel.log'}",
            f"sentinel monitor {m} 127.0.0.1 {self.master_port} {self.quorum}",
            f"sentinel down-after-milliseconds {m} {self.down_after_ms}",
            f"sentinel failover-timeout {m} {self.failover_timeout_ms}",
            f"sentinel parallel-syncs {m} 1",
        ]
        if self.password is not None:
            lines.append(f"requirepass {json.dumps(self.password)}")
        return "\n".join(lines) + "\n"

    def start(self, timeout: float = 10.0) -> SentinelProcess:
        # Sentinel rewrites its config file (known replicas, epochs), so it gets its own copy.
        conf = self.dir / "sentinel.conf"
        conf.write_text(self._config())
        self.proc = subprocess.Popen(
            [redis_server_binary(), str(conf), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        with self._client() as probe:
            _wait(
                lambda: probe.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.master_name),
                timeout,
                f"sentinel on port {self.port}",
            )
        return self

    def _client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password, socket_timeout=2)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def master_port_now(self) -> int:
        """The port of the master this Sentinel currently names."""
        with self._client() as c:
            _host, port = c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.master_name)
        return int(port)

    def replicas_known(self) -> int:
        with self._client() as c:
            return len(c.execute_command("SENTINEL", "REPLICAS", self.master_name))

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class SentinelGroup:
    """A master, ``replicas`` replicas and ``sentinels`` Sentinels (quorum: a majority of them)."""

    def __init__(
        self,
        replicas: int = 1,
        sentinels: int = 3,
        master_name: str = "mymaster",
        down_after_ms: int = 1000,
        server_args: list[str] | None = None,
        sentinel_password: str | None = None,
    ) -> None:
        self.n_replicas = replicas
        self.n_sentinels = sentinels
        self.master_name = master_name
        self.down_after_ms = down_after_ms
        self.server_args = server_args or []
        self.sentinel_password = sentinel_password
        self.servers: list[RedisProcess] = []
        self.sentinels: list[SentinelProcess] = []

    def start(self, timeout: float = 30.0) -> SentinelGroup:
        try:
            master = start_own(self.server_args)
            self.servers.append(master)
            for _ in range(self.n_replicas):
                replica = start_own([
                    *self.server_args,
                    "--replicaof", "127.0.0.1", str(master.port),
                    "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0",
                ])
                self.servers.append(replica)
            for replica in self.servers[1:]:
                _wait_in_sync(replica, timeout)
            quorum = self.n_sentinels // 2 + 1
            for _ in range(self.n_sentinels):
                self.sentinels.append(
                    SentinelProcess(
                        master.port, self.master_name, quorum, self.down_after_ms,
                        password=self.sentinel_password,
                    ).start()
                )
            # Sentinels find the replicas through the master's INFO (every 10 s at first; faster once
            # they have met through the master's hello channel). A failover needs them known.
            _wait(
                lambda: all(s.replicas_known() >= self.n_replicas for s in self.sentinels),
                timeout, "sentinels to discover the replicas", interval=0.2,
            )
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.sentinels]

    def master(self) -> RedisProcess:
        port = self.sentinels[0].master_port_now()
        return next(s for s in self.servers if s.port == port)

    def kill_master(self, timeout: float = 30.0) -> tuple[RedisProcess, RedisProcess]:
        """SIGKILL the master; returns ``(old, new)`` once every Sentinel names the promoted replica and
        it takes writes (about ``down_after_ms`` plus an election)."""
        old = self.master()
        old.kill()
        _wait(
            lambda: all(s.master_port_now() != old.port for s in self.sentinels),
            timeout, "the sentinels to promote a replica", interval=0.1,
        )
        new = self.master()
        _wait(lambda: _replication(new)["role"] == "master", timeout, "the new master to take writes")
        return old, new

    def stop(self) -> None:
        for sentinel in self.sentinels:
            sentinel.stop()
        for server in self.servers:
            server.stop()
