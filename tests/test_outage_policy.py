"""The outage policy (scrapy_dist.redis.outage), the rate-limited log and the batched writer: unit tests with
time injected -- no Redis, no sleeps (but a few milliseconds in the test of stopping a task)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import pytest
import redis.exceptions as rex

from scrapy_dist.extensions.clusterstats import PeriodicTask
from scrapy_dist.redis.outage import BackgroundTask, Backoff, BatchWriter, Outage, is_outage
from scrapy_dist.utils import RateLimitedLog

DOWN = rex.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")


def records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


# -- which errors are an outage ------------------------------------------------------------------
@pytest.mark.parametrize(
    "exc",
    [
        DOWN,
        rex.TimeoutError("Timeout reading from socket"),
        rex.BusyLoadingError("Redis is loading the dataset in memory"),
        rex.ReadOnlyError("You can't write against a read only replica."),
        rex.ClusterDownError("The cluster is down"),
        rex.MasterDownError("Link with MASTER is down"),
        rex.TryAgainError("Multiple keys request during rehashing of slot"),
        rex.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
        rex.RedisClusterException("Redis Cluster cannot be connected."),
        ConnectionResetError(104, "Connection reset by peer"),
        asyncio.TimeoutError(),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_that_heal_by_waiting_are_an_outage(exc: BaseException) -> None:
    assert is_outage(exc)


@pytest.mark.parametrize(
    "exc",
    [
        rex.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
        rex.ResponseError("Error running script: user_script:12: attempt to compare nil with number"),
        rex.NoScriptError("No matching script."),
        rex.DataError("Invalid input of type: 'dict'."),
        TypeError("unsupported operand"),
        KeyError("x"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_error_replies_and_bugs_are_not_an_outage(exc: BaseException) -> None:
    assert not is_outage(exc)


def test_a_connection_torn_down_under_a_command_is_an_outage_not_a_bug(redis_url: str) -> None:
    """redis-py's asyncio client raises AttributeError from its own connection code when the transport is
    closed under a command (redis/redis-py#4287; seen when a cluster restarts mid-crawl): an outage. The
    same exception type raised by our own code is still a bug."""
    import redis.asyncio

    async def torn() -> BaseException:
        conn = redis.asyncio.Redis.from_url(redis_url).connection_pool.make_connection()
        await conn.connect()
        writer = conn._writer
        conn._writer = None  # what a concurrent disconnect leaves behind
        try:
            await conn._send_packed_command([b"*1\r\n$4\r\nPING\r\n"])
        except AttributeError as exc:
            return exc
        finally:
            conn._writer = writer
            await conn.disconnect()
        raise AssertionError("no error")

    exc = asyncio.run(torn())
    assert "writelines" in str(exc)
    assert is_outage(exc)
    writer: Any = None
    try:
        writer.writelines([])
    except AttributeError as ours:
        assert not is_outage(ours)


# -- backoff -------------------------------------------------------------------------------------
def test_backoff_doubles_up_to_its_cap_and_starts_over_after_a_success() -> None:
    b = Backoff(first=0.1, cap=1.0)
    assert [b.failed() for _ in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    b.reset()
    assert b.failed() == pytest.approx(0.1)
    many = Backoff(first=0.5, cap=10.0)
    assert [many.failed() for _ in range(1000)][-1] == 10.0  # no overflow after a long outage


def test_backoff_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        Backoff(first=0)
    with pytest.raises(ValueError):
        Backoff(first=2, cap=1)


# -- one warning per worker --------------------------------------------------------------------
def test_an_outage_seen_by_every_component_is_one_warning_and_one_info(
    caplog: pytest.LogCaptureFixture,
) -> None:
    outage = Outage()
    components = ["frontier", "seed reader", "idle monitor", "item pipeline", "crawl-wide stats"]
    guards = [outage.guard(name) for name in components]
    with caplog.at_level(logging.DEBUG, logger="scrapy_dist.redis.outage"):
        for t in range(10):  # ten seconds down: every component fails, again and again
            for guard in guards:
                guard.failed(DOWN, now=100.0 + t)
        for guard in guards:
            guard.succeeded(now=112.5)
    warnings = records(caplog, logging.WARNING)
    infos = records(caplog, logging.INFO)
    assert len(warnings) == 1, warnings
    assert "Redis is unreachable (ConnectionError: Error 111" in warnings[0]
    assert "noticed by the frontier" in warnings[0]
    assert infos == [
        "Redis is reachable again after 12.5s (50 failed calls of the frontier, seed reader, idle monitor,"
        " item pipeline, crawl-wide stats); the crawl continues"
    ]
    assert not outage.down and outage.count == 1


def test_the_outage_is_over_only_once_every_failing_component_got_through(
    caplog: pytest.LogCaptureFixture,
) -> None:
    outage = Outage(stale=30.0)
    seeds, items = outage.guard("seed reader"), outage.guard("item pipeline")
    with caplog.at_level(logging.INFO, logger="scrapy_dist.redis.outage"):
        seeds.failed(DOWN, now=0.0)
        items.failed(rex.ClusterDownError("The cluster is down"), now=1.0)
        # a cluster coming back node by node: the seeds' node answers, the items' node does not yet
        seeds.succeeded(now=5.0)
        assert outage.down
        items.failed(rex.ClusterDownError("The cluster is down"), now=6.0)
        seeds.succeeded(now=7.0)
        assert outage.down
        items.succeeded(now=8.0)
    assert not outage.down
    assert len(records(caplog, logging.WARNING)) == 1
    assert records(caplog, logging.INFO) == [
        "Redis is reachable again after 8.0s (3 failed calls of the seed reader, item pipeline); the crawl"
        " continues"
    ]


def test_a_component_that_stopped_trying_does_not_keep_the_outage_open() -> None:
    outage = Outage(stale=30.0)
    once, loop = outage.guard("item pipeline"), outage.guard("frontier")
    once.failed(DOWN, now=0.0)  # a one-off call (opening the pipeline) that is never repeated
    loop.failed(DOWN, now=1.0)
    assert not outage.succeeded(now=2.0, component="frontier")  # the pipeline failed 2 s ago
    assert outage.down
    assert outage.succeeded(now=31.0, component="frontier")
    assert not outage.down


def test_a_second_outage_is_reported_again(caplog: pytest.LogCaptureFixture) -> None:
    outage = Outage()
    guard = outage.guard("frontier")
    with caplog.at_level(logging.INFO, logger="scrapy_dist.redis.outage"):
        for start in (0.0, 100.0):
            guard.failed(DOWN, now=start)
            guard.failed(DOWN, now=start + 1)
            guard.succeeded(now=start + 2)
            guard.succeeded(now=start + 3)
    assert len(records(caplog, logging.WARNING)) == 2
    assert len(records(caplog, logging.INFO)) == 2
    assert outage.count == 2


def test_for_crawler_gives_one_outage_per_crawler() -> None:
    class Crawler:
        pass

    a, b = Crawler(), Crawler()
    assert Outage.for_crawler(a) is Outage.for_crawler(a)
    assert Outage.for_crawler(a) is not Outage.for_crawler(b)
    assert Outage.for_crawler(None) is not Outage.for_crawler(None)


def test_errors_that_are_not_an_outage_are_the_components_own_and_rate_limited(
    caplog: pytest.LogCaptureFixture,
) -> None:
    outage = Outage()
    guard = outage.guard("error monitor", Backoff(1.0, 4.0), log=logging.getLogger("test.errors"))
    wrongtype = rex.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")
    with caplog.at_level(logging.INFO):
        delays = [guard.failed(wrongtype, now=float(t)) for t in range(30)]
        guard.failed(TypeError("bug"), now=30.0)
        guard.failed(wrongtype, now=61.0)  # a minute later: said again, with the count of the rest
    assert delays[:4] == [1.0, 2.0, 4.0, 4.0]
    assert not outage.down, "an error reply is not an outage"
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    messages = [r.getMessage() for r in errors]
    assert messages[0] == (
        "The error monitor got an error from Redis (ResponseError: WRONGTYPE Operation against a key holding"
        " the wrong kind of value); retrying"
    )
    assert errors[0].exc_info is None  # one line for an error reply
    assert messages[1] == "The error monitor failed (TypeError: bug)"
    assert errors[1].exc_info is not None  # a bug comes with its traceback
    assert messages[2] == "29 similar messages were suppressed in the last 61s"
    assert len(messages) == 4
    assert records(caplog, logging.WARNING) == []


def test_monitors_share_the_workers_outage(caplog: pytest.LogCaptureFixture) -> None:
    outage = Outage()

    async def down() -> None:
        raise DOWN

    async def up() -> None:
        return None

    stats = PeriodicTask(down, 1.0, "crawl-wide stats", logging.getLogger("test"), outage)
    idle = PeriodicTask(down, 0.5, "idle monitor", logging.getLogger("test"), outage)

    async def scenario() -> None:
        for t in range(5):
            assert not await stats.run_once(now=float(t))
            assert not await idle.run_once(now=float(t))
        stats.func = idle.func = up
        assert await stats.run_once(now=6.0)
        assert await idle.run_once(now=6.0)

    with caplog.at_level(logging.INFO, logger="scrapy_dist.redis.outage"):
        asyncio.run(scenario())
    assert len(records(caplog, logging.WARNING)) == 1
    assert len(records(caplog, logging.INFO)) == 1


class Flaky(BackgroundTask):
    """A loop whose step fails while ``fail`` says so; counts its steps."""

    def __init__(self, outage: Outage, fail: int) -> None:
        super().__init__(outage.guard("seed reader", Backoff(3600.0, 3600.0)), clock=lambda: 0.0)
        self.steps, self.fail = 0, fail

    async def step(self) -> bool:
        self.steps += 1
        if self.steps <= self.fail:
            raise DOWN
        self.succeeded()
        return False


def test_a_loop_backing_off_tries_again_once_a_component_that_had_failed_gets_an_answer() -> None:
    outage = Outage()
    other = outage.guard("item pipeline")

    async def scenario() -> None:
        loop = Flaky(outage, fail=2).start()
        await settle()
        assert loop.steps == 1 and loop.guard.backoff.failures == 1  # backing off an hour
        other.succeeded(now=1.0)  # had not failed: proves nothing new, wakes no one
        await settle()
        assert loop.steps == 1
        other.failed(DOWN, now=2.0)
        other.succeeded(now=3.0)  # Redis answers a component that had failed
        await settle()
        assert loop.steps == 2 and loop.guard.backoff.failures == 2  # failed again: backs off further
        other.failed(DOWN, now=4.0)
        other.succeeded(now=5.0)
        await settle()
        assert loop.steps == 3 and loop.guard.backoff.failures == 0 and not outage.down
        await asyncio.wait_for(loop.stop(), 5)

    asyncio.run(scenario())


# -- the rate-limited log ------------------------------------------------------------------------
def test_rate_limited_log_says_burst_messages_per_period_and_counts_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = RateLimitedLog(logging.getLogger("test.rl"), period=60.0, burst=2)
    with caplog.at_level(logging.WARNING, logger="test.rl"):
        said = [log.log(logging.WARNING, "rejected %d", i, now=float(i)) for i in range(5)]
        other = log.log(logging.WARNING, "another kind", key="other", now=4.0)
        assert log.suppressed() == 3
        log.log(logging.WARNING, "rejected %d", 99, now=70.0)
    assert said == [True, True, False, False, False] and other
    assert [r.getMessage() for r in caplog.records] == [
        "rejected 0", "rejected 1", "another kind",
        "3 similar messages were suppressed in the last 70s", "rejected 99",
    ]


def test_once_log_says_a_key_once_until_reset(caplog: pytest.LogCaptureFixture) -> None:
    log = RateLimitedLog.once(logging.getLogger("test.once"))
    with caplog.at_level(logging.WARNING, logger="test.once"):
        for t in range(3):
            log.log(logging.WARNING, "capacity exceeded", now=1e9 * t)
        assert log.seen() and log.suppressed() == 2
        log.reset()
        log.log(logging.WARNING, "capacity exceeded", now=0.0)
    assert [r.getMessage() for r in caplog.records] == ["capacity exceeded", "capacity exceeded"]


# -- the batched writer -------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Sink:
    """A write function: records what it got, or raises what it is told to."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []
        self.fail: BaseException | None = None

    async def __call__(self, entries: list[Any]) -> None:
        if self.fail is not None:
            raise self.fail
        self.batches.append(list(entries))


async def settle() -> None:
    """Let the writer task run until it waits again (no I/O: a few loop iterations)."""
    for _ in range(10):
        await asyncio.sleep(0)


def test_writer_writes_a_partial_batch_only_after_the_flush_interval() -> None:
    clock, sink = Clock(), Sink()

    async def scenario() -> None:
        w: BatchWriter[int] = BatchWriter(sink, batch_size=100, flush_interval=2.0, clock=clock)
        done = [w.add(i) for i in range(5)]
        await settle()
        assert sink.batches == [] and not any(d.done() for d in done)
        assert w.due_in(clock()) == 2.0
        clock.t += 1.9
        w.wake()
        await settle()
        assert sink.batches == [] and w.buffered == 5
        clock.t += 0.1
        w.wake()
        await settle()
        assert sink.batches == [[0, 1, 2, 3, 4]] and all(d.done() for d in done)
        await w.close()

    asyncio.run(scenario())


def test_writer_writes_a_full_batch_at_once_taking_along_what_else_is_buffered() -> None:
    clock, sink = Clock(), Sink()

    async def scenario() -> None:
        w: BatchWriter[int] = BatchWriter(
            sink, batch_size=10, flush_interval=3600, max_batches=2, clock=clock
        )
        for i in range(25):
            w.add(i)
        await settle()
        # two full batches in one write; the third, partial one waits for its interval
        assert sink.batches == [list(range(20))]
        assert list(w.pending()) == list(range(20, 25))
        await w.close()
        assert sink.batches[-1] == list(range(20, 25))

    asyncio.run(scenario())


def test_writer_keeps_everything_through_an_outage_and_retries_after_the_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, sink = Clock(), Sink()
    outage = Outage()
    failures: list[BaseException] = []

    async def scenario() -> None:
        w: BatchWriter[str] = BatchWriter(
            sink, guard=outage.guard("item pipeline", Backoff(0.5, 4.0)), batch_size=2, flush_interval=0,
            clock=clock, on_failure=failures.append,
        )
        sink.fail = DOWN
        first = w.add("a")
        w.add("b")
        await settle()
        assert outage.down and len(failures) == 1
        assert w.due_in(clock()) == 0.5  # waits the backoff, not a busy loop
        later = w.add("c")  # joins a new batch: the failed one is sealed
        clock.t += 0.5
        w.wake()
        await settle()
        assert len(failures) == 2 and w.due_in(clock()) == 1.0
        assert list(w.pending()) == ["a", "b", "c"] and not first.done()
        sink.fail = None
        clock.t += 1.0
        w.wake()
        await settle()
        assert sink.batches == [["a", "b", "c"]] and first.done() and later.done()
        assert not outage.down
        await w.close()

    with caplog.at_level(logging.INFO, logger="scrapy_dist.redis.outage"):
        asyncio.run(scenario())
    assert len(records(caplog, logging.WARNING)) == 1
    assert len(records(caplog, logging.INFO)) == 1


def test_writer_fails_the_entries_of_a_buggy_write_and_goes_on() -> None:
    clock, sink = Clock(), Sink()

    async def scenario() -> None:
        w: BatchWriter[int] = BatchWriter(sink, batch_size=1, flush_interval=0, clock=clock)
        sink.fail = TypeError("cannot encode")
        bad = w.add(1)
        await settle()
        with pytest.raises(TypeError):
            bad.result()
        sink.fail = None
        await w.add(2)
        assert sink.batches == [[2]]
        await w.close()
        with pytest.raises(RuntimeError):
            w.add(3)

    asyncio.run(scenario())


def test_writer_close_waits_until_redis_takes_everything() -> None:
    clock, sink = Clock(), Sink()

    async def scenario() -> None:
        w: BatchWriter[int] = BatchWriter(
            sink, guard=Outage().guard("x", Backoff(5.0, 5.0)), batch_size=100, flush_interval=3600,
            clock=clock,
        )
        sink.fail = rex.ReadOnlyError("You can't write against a read only replica.")
        w.add(1)
        closing = asyncio.ensure_future(w.close())
        await settle()
        assert not closing.done() and sink.batches == [] and w.due_in(clock()) == 5.0
        sink.fail = None
        clock.t += 5.0
        w.wake()
        await asyncio.wait_for(closing, 5)
        assert sink.batches == [[1]]

    asyncio.run(scenario())


def test_a_periodic_task_stops_even_when_its_call_swallows_the_cancellation() -> None:
    """On Python < 3.12 asyncio.wait_for (redis-py wraps every socket write in it) swallows a cancellation
    that arrives as the write completes. A task stopped by one cancellation then ran on for ever, and the
    spider's close waited for it: a worker that never exited (seen in CI)."""
    calls = 0

    async def swallows() -> None:
        nonlocal calls
        calls += 1
        # what wait_for does in that race: return as if not cancelled
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(5)

    async def scenario() -> float:
        task = PeriodicTask(swallows, 0.01, "test", logging.getLogger("test")).start()
        while calls == 0:
            await asyncio.sleep(0.01)
        started = time.monotonic()
        await asyncio.wait_for(task.stop(), 10)
        return time.monotonic() - started

    assert asyncio.run(scenario()) < 5
    assert calls == 1  # stopped after the call it was in, no further call
