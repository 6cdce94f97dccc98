"""`scrapy-dist status|pause|resume` and the status reader, against a crawl state written into a real Redis
(the same scripts the workers use write the heartbeats and stats); `status --watch` in a pseudo-terminal."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from helpers import lease_key
from zygote import Zygote

from scrapy_dist.cli import main
from scrapy_dist.frontier.layout import ControlState
from scrapy_dist.monitor import leases_by_worker, read_status, window_totals
from scrapy_dist.redis import scripts
from scrapy_dist.redis.keys import CrawlKeys

CLI = [sys.executable, "-c", "from scrapy_dist.cli import main; main()"]  # the scrapy-dist command

KEYS = CrawlKeys("books")
RUNNING, LOST, CLOSED = "hostA:111:aaaa", "hostB:222:bbbb", "hostC:333:cccc"


@pytest.fixture(autouse=True)
def outside_any_project(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """The CLI reads a Scrapy project's settings when run inside one: these tests run outside any."""
    monkeypatch.setenv("SCRAPY_SETTINGS_MODULE", "unset")  # so that teardown restores the original state
    monkeypatch.delenv("SCRAPY_SETTINGS_MODULE")
    monkeypatch.chdir(tmp_path)


def heartbeat(client: redis.Redis, worker: str, seq: int, fields: dict[str, str], ops: list[str],
              final: bool = False) -> None:
    script = scripts.register(client, "clusterstats")
    args: list[Any] = [worker, seq, 3600, "1" if final else "0", len(fields)]
    for k, v in fields.items():
        args += [k, v]
    script(keys=[KEYS.stats, KEYS.workers, KEYS.worker(worker)], args=args + ops)


@pytest.fixture
def crawl_state(redis_client: redis.Redis) -> redis.Redis:
    """A crawl in progress: 3 queued, 3 leased (2 by a running worker, 1 by a lost one), 1 delayed, dead
    letters, seeds waiting and rejected, a bloom filter, merged stats and an error window."""
    c = redis_client
    c.zadd(KEYS.queue, {b"q1": 0, b"q2": 0, b"q3": -1})
    # lease keys: two tagged with their holder (as sync files them), one untagged with its lease meta (as
    # an older version filed it)
    c.zadd(KEYS.leases, {lease_key(b"l1", RUNNING): 1e10, lease_key(b"l2", RUNNING): 1e10, b"l3": 1e10})
    c.hset(KEYS.lease_meta, mapping={b"l3": f"0 {LOST}"})
    c.zadd(KEYS.delayed, {b"d1": 1e10})
    c.rpush(KEYS.deadletter, '{"reason": "a"}', '{"reason": "b"}')
    c.rpush(KEYS.start_urls, "http://a/", "http://b/", "http://c/", "http://d/")
    c.rpush(KEYS.start_urls_rejected, "{}")
    c.rpush(KEYS.queue_rejected, "{}", "{}")
    c.hset(KEYS.bloom, mapping={"capacity": 1000, "error_rate": "0.001", "block_bits": 2**31, "n": 100})
    # heartbeats every 10 s: the running worker stays running for 30 s, however late a loaded machine
    # starts the status command (with 1 s, one started 3 s late saw it lost); the lost one was seen 100 s ago
    info = {"interval": "10.0", "state": "running", "pages": "42", "items": "40", "errors": "2",
            "pages_per_min": "120.0", "host": "hostA", "pid": "111", "started": "1.0"}
    heartbeat(c, RUNNING, 1, info, ["sum", "response_received_count", "42", "sum", "item_scraped_count", "40",
                                    "min", "start_time", "2024-01-01T00:00:00.000000+00:00"])
    heartbeat(c, CLOSED, 1, {**info, "pages": "8", "host": "hostC", "pid": "333"},
              ["sum", "response_received_count", "8"], final=True)
    heartbeat(c, CLOSED, 2, {**info, "state": "closed", "finish_reason": "shutdown", "pages": "8"}, [])
    c.zadd(KEYS.workers, {LOST: time.time() - 100})
    c.hset(KEYS.worker(LOST), mapping={**info, "pages": "7", "host": "hostB", "pid": "222"})
    now = time.time()
    bucket = int(now // 2)
    c.hset(KEYS.errors, mapping={
        "_bucket": "2.0", "_window": "60.0", f"{bucket}|attempts": 50, f"{bucket}|errors": 5,
        f"{bucket}|r:http/500": 4, f"{bucket}|r:spider/KeyError": 1,
        f"{bucket - 100}|errors": 1000,  # that bucket left the window
    })
    return c


def test_window_totals_count_only_the_window() -> None:
    raw = {b"_bucket": b"10", b"_window": b"60", b"100|attempts": b"20", b"100|errors": b"5",
           b"100|r:http/503": b"5", b"94|errors": b"7", b"93|errors": b"1000",
           b"101|errors": b"0", b"99999999999|errors": b"5000"}  # a bucket ahead of now is garbage
    t = window_totals(raw, now=1005)  # the window starts at 945: bucket 94 (940..950) overlaps it
    assert (t["attempts"], t["errors"], t["error_rate"]) == (20, 12, 0.6)
    assert t["reasons"] == {"http/503": 5}
    assert window_totals({}, now=1)["error_rate"] is None


def test_leases_by_worker() -> None:
    tagged = [lease_key(b"\0\0\0\0\0\1\1a", "w1", "-1"), lease_key(b"m", "h:1:x"), b"untagged",
              b"\0\xff\0\0"]
    assert leases_by_worker(tagged, [b"-1 w1", "3 h:1:x"]) == {"w1": 2, "h:1:x": 2}


def test_read_status(crawl_state: redis.Redis) -> None:
    s = read_status(crawl_state, KEYS)
    assert s["state"] == "running"
    assert s["frontier"] == {"queued": 3, "inflight": 3, "delayed": 1}
    assert s["deadletter"] == 2
    assert s["seeds"]["waiting"] == 4 and s["seeds"]["type"] == "list"
    assert s["rejected"] == {"seeds": 1, "queue": 2}
    f = s["filter"]
    assert f["kind"] == "bloom" and f["items"] == 100 and f["fill"] == 0.1 and 0 < f["fpr_estimate"] < 0.001
    assert s["errors"]["errors"] == 5 and s["errors"]["attempts"] == 50 and s["rates"]["error_rate"] == 0.1
    assert s["errors"]["reasons"] == {"http/500": 4, "spider/KeyError": 1}
    assert s["rates"]["pages_per_min"] == 120.0  # running workers only
    assert s["workers_summary"] == {"running": 1, "lost": 1, "closed": 1, "total": 3}
    by_id = {w["id"]: w for w in s["workers"]}
    assert [w["id"] for w in s["workers"]] == [RUNNING, LOST, CLOSED]
    assert by_id[RUNNING]["leases"] == 2 and by_id[LOST]["leases"] == 1 and by_id[CLOSED]["leases"] == 0
    assert by_id[LOST]["state"] == "lost" and by_id[LOST]["seen_ago"] >= 99
    assert by_id[CLOSED]["finish_reason"] == "shutdown"
    assert s["stats"] == {"item_scraped_count": 40, "response_received_count": 50,
                          "start_time": "2024-01-01T00:00:00.000000+00:00"}


def test_status_json_and_table(crawl_state: redis.Redis, redis_url: str) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["--redis-url", redis_url, "status", "books", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["stats"]["response_received_count"] == 50 and data["frontier"]["queued"] == 3
    result = runner.invoke(main, ["status", "books", "--redis-url", redis_url], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    out = result.output
    assert "Workers: 1 running, 1 lost, 1 closed" in out
    assert RUNNING in out and "lost" in out and "closed (shutdown)" in out
    assert "120.0 pages/min" in out and "error rate 10.0%" in out
    assert "http/500 4" in out


def test_status_watch_refuses_an_interval_below_a_tenth_of_a_second(redis_url: str) -> None:
    # --interval -1 was a ValueError traceback from time.sleep() after the first refresh
    for interval in ("-1", "0"):
        result = CliRunner().invoke(main, ["--redis-url", redis_url, "status", "books", "--watch",
                                           "--interval", interval])
        assert result.exit_code == 2 and "--interval" in result.output, result.output


def test_pause_and_resume_commands(redis_client: redis.Redis, redis_url: str) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["--redis-url", redis_url, "pause", "books"])
    assert result.exit_code == 0 and "Paused 'books'" in result.output
    assert redis_client.hget(KEYS.control, "paused") == b"1"
    assert read_status(redis_client, KEYS)["state"] == "paused"
    redis_client.hset(KEYS.errors, "1|errors", 9)
    result = runner.invoke(main, ["--redis-url", redis_url, "resume", "books"])
    assert result.exit_code == 0 and "Resumed 'books'" in result.output
    assert redis_client.hget(KEYS.control, "paused") == b"0"
    assert not redis_client.exists(KEYS.errors)


def test_close_command_closes_the_workers_running_now(redis_client: redis.Redis, redis_url: str) -> None:
    started = float(redis_client.time()[0]) - 1
    result = CliRunner().invoke(main, ["--redis-url", redis_url, "close", "books"])
    assert result.exit_code == 0 and "Closing 'books'" in result.output, result.output
    control = ControlState.from_hash(redis_client.hgetall(KEYS.control))
    now = float(redis_client.time()[0]) + 1
    assert control.close_reason(started, now) == "shutdown"  # a worker running now closes
    assert control.close_reason(now, now) == ""  # one started afterwards does not
    assert read_status(redis_client, KEYS)["control"]["close"] == "shutdown"
    result = CliRunner().invoke(main, ["--redis-url", redis_url, "close", "books", "--reason", "maintenance"])
    assert ControlState.from_hash(redis_client.hgetall(KEYS.control)).close == "maintenance"
    CliRunner().invoke(main, ["--redis-url", redis_url, "resume", "books"])
    assert not redis_client.hexists(KEYS.control, "close")


def test_close_command_refuses_a_bad_reason_in_one_line(redis_client: redis.Redis, redis_url: str) -> None:
    result = CliRunner().invoke(main, ["--redis-url", redis_url, "close", "books", "--reason", "a b"])
    assert result.exit_code == 2 and "--reason" in result.output and "Traceback" not in result.output
    assert not redis_client.exists(KEYS.control)


@pytest.mark.parametrize("command", ["pause", "resume"])
def test_pause_and_resume_move_a_control_key_of_another_type_aside(
    redis_client: redis.Redis, redis_url: str, command: str
) -> None:
    redis_client.rpush(KEYS.control, "someone else's")
    result = CliRunner().invoke(main, ["--redis-url", redis_url, command, "books"])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    assert redis_client.hget(KEYS.control, "paused") == (b"1" if command == "pause" else b"0")
    assert redis_client.lrange(f"{KEYS.control}:garbage", 0, -1) == [b"someone else's"]


def test_status_says_so_when_redis_is_unreachable() -> None:
    result = CliRunner().invoke(main, ["--redis-url", "redis://127.0.0.1:1/0", "status", "books"])
    assert result.exit_code == 1
    assert "Traceback" not in result.output and "127.0.0.1:1" in result.output


@pytest.mark.slow
def _drain(fd: int, seconds: float = 20.0) -> bytes:
    """What the child still writes after Ctrl-C: read, so that it never blocks on a full terminal."""
    out, deadline = b"", time.monotonic() + seconds
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 0.2)[0]:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    return out


def _reaped(pid: int, seconds: float = 10.0) -> int:
    """The child's wait status (SIGKILLed, and so failing the test, if it has not exited by then)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1]


def test_status_watch_renders_live_in_a_terminal(crawl_state: redis.Redis, redis_url: str) -> None:
    pid, fd = pty.fork()
    if pid == 0:  # the child: the CLI on a pseudo-terminal
        os.environ.update({"COLUMNS": "140", "LINES": "50", "TERM": "xterm"})
        os.environ.pop("SCRAPY_SETTINGS_MODULE", None)
        # a test worker may ignore SIGINT, and an ignored SIGINT survives exec: Ctrl-C would do nothing
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execv(sys.executable, [
            sys.executable, "-c", "from scrapy_dist.cli import main; main()",
            "--redis-url", redis_url, "status", "books", "--watch", "--interval", "0.3",
        ])
    out = b""
    deadline = time.monotonic() + 20
    changed = False
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                try:
                    out += os.read(fd, 65536)
                except OSError:
                    break
            text = out.decode(errors="replace")
            if not changed and "Workers: 1 running" in text:
                crawl_state.zadd(KEYS.queue, {b"q4": 0, b"q5": 0})  # the next refresh shows 5 queued
                changed = True
            if changed and text.count("Workers: 1 running") >= 3:
                break
    finally:
        os.kill(pid, signal.SIGINT)
        out, status = out + _drain(fd), _reaped(pid)
        os.close(fd)
    text = out.decode(errors="replace")
    assert "\x1b[" in text  # drawn with terminal control sequences (a live display)
    assert text.count("Workers: 1 running, 1 lost, 1 closed") >= 3  # refreshed
    assert RUNNING in text and "Queued" in text
    lines = [line for line in text.splitlines() if "Queued" in line]
    assert any(" 3 " in line for line in lines) and any(" 5 " in line for line in lines)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0  # Ctrl-C ends it cleanly


def test_status_subprocess_entry_point(crawl_state: redis.Redis, redis_url: str) -> None:
    out = subprocess.run(
        [*CLI, "--redis-url", redis_url,
         "status", "books", "--json"], capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if k != "SCRAPY_SETTINGS_MODULE"},
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["workers_summary"]["lost"] == 1


@pytest.mark.parametrize(
    "write",
    [
        lambda c: c.hset(KEYS.queue_tails, "count", b"\xcd\x18\x1c\x8bKJ"),  # seen in a chaos run
        lambda c: c.hset(KEYS.queue_tails, "count", "-5"),
        lambda c: c.hset(KEYS.bloom, "n", "1e30"),
        lambda c: c.hset(KEYS.bloom, "capacity", "x"),
        lambda c: c.hset(KEYS.control, "paused", b"\xff"),
        lambda c: c.zadd(KEYS.workers, {b"\xff\xfe junk": 1e18}),
        lambda c: c.hset(KEYS.stats, b"\xff", b"\xfe"),
        lambda c: c.hset(KEYS.errors, "1|attempts", "nan"),
        lambda c: c.hset(KEYS.delayed_meta, "revisits", "abc"),
        lambda c: c.hset(KEYS.lease_meta, b"l1", b"\xff"),
    ],
    ids=["tails-binary", "tails-negative", "bloom-n", "bloom-capacity", "control", "workers", "stats",
         "errors", "revisits", "lease-meta"],
)
def test_status_reads_garbage_written_by_others_without_a_traceback(
    crawl_state: redis.Redis, redis_url: str, write: Any
) -> None:
    write(crawl_state)
    s = read_status(crawl_state, KEYS)
    assert s["frontier"]["queued"] >= 3 and s["frontier"]["inflight"] == 3
    result = CliRunner().invoke(main, ["--redis-url", redis_url, "status", "books", "--json"])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    assert json.loads(result.output)["frontier"]["queued"] >= 3


def test_status_watch_json_rides_out_a_redis_outage(redis_servers: Any, tmp_path: Any) -> None:
    (server,) = redis_servers(1)
    env = {k: v for k, v in os.environ.items() if k != "SCRAPY_SETTINGS_MODULE"}
    proc = Zygote.popen_cli(
        [*CLI, "--redis-url", server.url, "status", "books", "--watch", "--json", "--interval", "0.2"],
        cwd=tmp_path, env=env,
    )
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline())["spider"] == "books"
        server.kill()
        lines = [json.loads(proc.stdout.readline()) for _ in range(6)]
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        errors = [line for line in lines if "error" in line]
        assert errors and errors[-1]["error"].startswith("Redis unavailable (ConnectionError")
    finally:
        proc.kill()
        _, err = proc.communicate()
    assert "Traceback" not in err


def test_status_after_a_kill_says_when_the_lost_workers_leases_come_back(
    redis_client: redis.Redis, redis_url: str
) -> None:
    now = time.time()
    redis_client.zadd(KEYS.workers, {LOST: now - 100})
    redis_client.hset(KEYS.worker(LOST), mapping={"interval": "5.0", "state": "running", "inflight": "31"})
    redis_client.zadd(KEYS.leases, {lease_key(f"m{i}".encode(), LOST): now + 42 + i / 2 for i in range(31)})
    s = read_status(redis_client, KEYS)
    assert s["state"] == "stopped" and s["leases"]["other"] == 31
    assert 40 <= s["leases"]["first_in"] <= 42 and 55 <= s["leases"]["last_in"] <= 57
    out = CliRunner().invoke(main, ["--redis-url", redis_url, "status", "books"]).output
    headline = out.splitlines()[0]
    assert "stopped" in headline and "31 leased requests held by lost workers" in headline, out
    assert "back in the queue in 4" in headline and ", the last in 5" in headline, out
    redis_client.zadd(KEYS.leases, {lease_key(f"m{i}".encode(), LOST): now - 1 for i in range(31)})
    out = CliRunner().invoke(main, ["--redis-url", redis_url, "status", "books"]).output
    assert "leases have run out: back in the queue at the next sync of any worker" in out.splitlines()[0]
