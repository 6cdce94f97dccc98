"""A TCP proxy that adds network latency in front of Redis and counts Redis round trips.

Run it standalone::

    python -m benchmarks.proxy --target 127.0.0.1:6379 --rtt-ms 1.0

It prints one JSON line ``{"listen_port": ..., "control_port": ...}`` when ready. Connecting to the control
port and sending ``stats`` (or ``reset``, which also zeroes the counters) answers one JSON line of counters.

**Latency.** Every chunk read from either side is forwarded ``rtt/2`` after it was read, in order. Chunks are
not serialized behind each other: the proxy keeps reading while earlier chunks wait, so a pipeline of 1,000
commands costs one delay, not 1,000 (a delay line, not a queue with one slot).

**Jitter.** With ``--jitter-ms J`` each chunk's one-way delay is drawn uniformly from ``rtt/2 +- J/2`` (so a
round trip takes ``rtt +- J``), never earlier than the chunk before it: a TCP stream keeps its order.

The event loop uses ``select()`` rather than ``epoll``: ``epoll_wait`` takes whole milliseconds and asyncio
rounds a timer *up* to the next one, which would turn a 0.5 ms delay into 1 ms; ``select`` takes
microseconds. (A proxy has a handful of sockets, far below select's FD limit.)

**Round trips.** Per connection, a *round trip* is a client-to-server burst: the first chunk the client sends,
and every chunk it sends after it has received data from the server since its previous chunk. Pipelined
commands sent before the reply arrives add no round trip; a command sent after waiting for a reply does.
"Received" means the proxy has delivered (written) server data to the client. The total is summed over all
connections. This is exactly the number of times a client had to wait one network round trip.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import selectors
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

#: Stop reading a side when this many bytes wait in its delay line (backpressure).
MAX_BUFFERED = 8 * 1024 * 1024
#: Timers fire this much early: waking from select() takes ~25-50 us on this kind of VM; the flush then
#: spins the remaining microseconds so a chunk leaves close to its due time, not 50-100 us after it.
WAKE_EARLY = 60e-6


@dataclass
class ProxyStats:
    """Counters of one proxy since start (or the last reset)."""

    connections: int = 0
    round_trips: int = 0
    client_chunks: int = 0
    server_chunks: int = 0
    client_bytes: int = 0
    server_bytes: int = 0


class _DelayLine:
    """Forwards chunks to ``transport`` ``delay`` seconds after they were pushed, preserving order."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, delay: float, on_deliver=None, jitter: float = 0.0
    ) -> None:
        self.loop = loop
        self.delay = delay
        self.jitter = jitter
        self._last_due = 0.0
        self.transport: asyncio.Transport | None = None
        self.source: asyncio.Transport | None = None  # paused when too much is buffered
        self.on_deliver = on_deliver
        self._chunks: collections.deque[tuple[float, bytes]] = collections.deque()
        self._buffered = 0
        self._timer: asyncio.TimerHandle | None = None
        self._source_paused = False
        self.closing = False

    def push(self, data: bytes) -> None:
        if self.delay <= 0 and not self.jitter and not self._chunks and self.transport is not None:
            self._write(data)
            return
        due = self.loop.time() + self.delay
        if self.jitter:
            due = max(self._last_due, due + random.uniform(-self.jitter, self.jitter))
            self._last_due = due
        self._chunks.append((due, data))
        self._buffered += len(data)
        if self._buffered > MAX_BUFFERED and self.source is not None and not self._source_paused:
            self.source.pause_reading()
            self._source_paused = True
        if self._timer is None and self.transport is not None:
            self._timer = self.loop.call_at(due - WAKE_EARLY, self._flush)

    def attach(self, transport: asyncio.Transport) -> None:
        """Set the destination (the upstream connection may open after the client sent data)."""
        self.transport = transport
        if self._chunks and self._timer is None:
            self._timer = self.loop.call_at(self._chunks[0][0] - WAKE_EARLY, self._flush)

    def _flush(self) -> None:
        self._timer = None
        clock = self.loop.time
        if self._chunks:
            first_due = self._chunks[0][0]
            while clock() < first_due:  # at most WAKE_EARLY (plus a late wake-up: none)
                pass
        limit = clock()
        out = []
        while self._chunks and self._chunks[0][0] <= limit:
            _, data = self._chunks.popleft()
            self._buffered -= len(data)
            out.append(data)
        if out:
            self._write(b"".join(out))
        if self._chunks:
            self._timer = self.loop.call_at(self._chunks[0][0] - WAKE_EARLY, self._flush)
        elif self.closing and self.transport is not None:
            self.transport.close()
        if self._source_paused and self._buffered <= MAX_BUFFERED // 2 and self.source is not None:
            self._source_paused = False
            self.source.resume_reading()

    def _write(self, data: bytes) -> None:
        assert self.transport is not None
        if self.transport.is_closing():
            return
        self.transport.write(data)
        if self.on_deliver is not None:
            self.on_deliver()

    def close_when_drained(self) -> None:
        self.closing = True
        if not self._chunks and self.transport is not None:
            self.transport.close()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._chunks.clear()


class _Upstream(asyncio.Protocol):
    def __init__(self, conn: _ProxiedConnection) -> None:
        self.conn = conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.conn.upstream_made(transport)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        self.conn.from_server(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.down.close_when_drained()


class _ProxiedConnection(asyncio.Protocol):
    """The client side of one proxied connection; owns both delay lines and the round-trip state."""

    def __init__(self, proxy: LatencyProxy) -> None:
        self.proxy = proxy
        loop = proxy.loop
        self.up = _DelayLine(loop, proxy.one_way, jitter=proxy.jitter)  # client -> server
        self.down = _DelayLine(loop, proxy.one_way, self._delivered, proxy.jitter)  # server -> client
        # True until the first send, so the first burst counts as a round trip.
        self._client_got_reply = True
        self.client: asyncio.Transport | None = None
        self.server: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.client = transport  # type: ignore[assignment]
        self.down.attach(self.client)  # type: ignore[arg-type]
        self.up.source = self.client  # type: ignore[assignment]
        self.proxy.stats.connections += 1
        self.proxy.loop.create_task(self._connect())

    async def _connect(self) -> None:
        try:
            await self.proxy.loop.create_connection(
                lambda: _Upstream(self), self.proxy.target_host, self.proxy.target_port
            )
        except OSError:
            if self.client is not None:
                self.client.close()

    def upstream_made(self, transport: asyncio.Transport) -> None:
        if self.client is None or self.client.is_closing():  # the client left while we connected
            transport.close()
            return
        self.server = transport
        self.down.source = transport
        self.up.attach(transport)

    def data_received(self, data: bytes) -> None:
        self.from_client(data)

    def from_client(self, data: bytes) -> None:
        stats = self.proxy.stats
        stats.client_chunks += 1
        stats.client_bytes += len(data)
        if self._client_got_reply:
            stats.round_trips += 1
            self._client_got_reply = False
        self.up.push(data)

    def from_server(self, data: bytes) -> None:
        self.proxy.stats.server_chunks += 1
        self.proxy.stats.server_bytes += len(data)
        self.down.push(data)

    def _delivered(self) -> None:
        self._client_got_reply = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.up.close_when_drained()
        if self.server is None:
            self.up.cancel()


class LatencyProxy:
    """Forwards ``listen -> target`` adding ``rtt_ms / 2`` each way and counting round trips."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        rtt_ms: float = 1.0,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        jitter_ms: float = 0.0,
    ) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.one_way = rtt_ms / 2000.0
        self.jitter = jitter_ms / 2000.0
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.stats = ProxyStats()
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]

    async def serve(self, ready=None) -> None:
        """Serve until cancelled; ``ready(listen_port, control_port)`` is called once listening."""
        self.loop = asyncio.get_running_loop()
        server = await self.loop.create_server(
            lambda: _ProxiedConnection(self), self.listen_host, self.listen_port
        )
        control = await asyncio.start_server(self._control, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        control_port = control.sockets[0].getsockname()[1]
        if ready is not None:
            ready(port, control_port)
        async with server, control:
            await asyncio.Future()  # until cancelled

    async def _control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        command = (await reader.readline()).strip().decode() or "stats"
        out = asdict(self.stats)
        if command == "reset":
            self.stats = ProxyStats()
        writer.write(json.dumps(out).encode() + b"\n")
        await writer.drain()
        writer.close()


def _parse_hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def _tune_process() -> None:
    """Ask Linux for 1 ns timer slack (default 50 us) so sub-millisecond sleeps end on time, and, when
    allowed (root), a higher CPU priority: the proxy plays the network, whose latency must not grow
    because other processes keep the cores busy. It uses little CPU, so it takes little from them."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK
    except (OSError, AttributeError):
        pass  # not Linux: timers are just a little later
    with contextlib.suppress(OSError, AttributeError):  # not root: normal priority
        os.nice(-10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.proxy", description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, help="HOST:PORT to forward to")
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (port 0 = free)")
    parser.add_argument("--rtt-ms", type=float, default=1.0, help="added round-trip time (default 1.0)")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="round trips vary by +- this")
    args = parser.parse_args(argv)
    host, port = _parse_hostport(args.target)
    listen_host, listen_port = _parse_hostport(args.listen)
    proxy = LatencyProxy(host, port, args.rtt_ms, listen_host, listen_port, args.jitter_ms)

    def ready(port: int, control_port: int) -> None:
        print(json.dumps({"listen_port": port, "control_port": control_port}), flush=True)

    _tune_process()
    loop = asyncio.SelectorEventLoop(selectors.SelectSelector())
    asyncio.set_event_loop(loop)
    task = loop.create_task(proxy.serve(ready))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        loop.run_until_complete(task)
    except asyncio.CancelledError:
        pass
    finally:
        print(json.dumps(asdict(proxy.stats)), flush=True)
        loop.close()


class ProxyProcess:
    """The proxy in a child process (so it never competes for the harness's GIL)."""

    def __init__(self, target_port: int, rtt_ms: float, target_host: str = "127.0.0.1") -> None:
        self.target = f"{target_host}:{target_port}"
        self.rtt_ms = rtt_ms
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self.control_port = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> ProxyProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.proxy", "--target", self.target, "--rtt-ms", str(self.rtt_ms)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=_repo_root(),
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("latency proxy did not start")
        info = json.loads(line)
        self.port, self.control_port = info["listen_port"], info["control_port"]
        return self

    def _command(self, command: str) -> dict:
        with socket.create_connection(("127.0.0.1", self.control_port), timeout=10) as s:
            s.sendall(command.encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
        return json.loads(data)

    def stats(self) -> dict:
        """Counters since start or the last reset."""
        return self._command("stats")

    def reset(self) -> dict:
        """Zero the counters; returns their values before."""
        return self._command("reset")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()

    def __enter__(self) -> ProxyProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _repo_root() -> str:
    from pathlib import Path

    return str(Path(__file__).resolve().parent.parent)


def measure_rtt(port: int, samples: int = 200) -> dict:
    """Median / p90 PING round-trip time (ms) to a Redis on ``port`` with one synchronous client."""
    import redis

    client = redis.Redis(port=port)
    client.ping()
    times = []
    for _ in range(samples):
        t = time.perf_counter()
        client.ping()
        times.append((time.perf_counter() - t) * 1000)
    client.close()
    times.sort()
    return {"median_ms": times[len(times) // 2], "p90_ms": times[int(len(times) * 0.9)]}


if __name__ == "__main__":
    main()
