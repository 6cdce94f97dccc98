"""The scheduler's I/O-free parts: the ledger of what a worker holds and owes, the shard router, and the
sync loop's timing -- no Redis, no Scrapy engine, time passed in."""

from __future__ import annotations

import json

import pytest
from scrapy import Request

from scrapy_dist.exceptions import RejectedEntry
from scrapy_dist.frontier.engine import Engine
from scrapy_dist.frontier.layout import ShardRouter
from scrapy_dist.frontier.ledger import Delay, Ledger, Outgoing
from scrapy_dist.frontier.shard import (
    CALL_RECORDS,
    CALLS_PER_ROUND,
    SETTLE_MIN_RECORDS,
    SETTLE_PER_RECORD,
    SyncResult,
)
from scrapy_dist.frontier.syncloop import SyncLoop
from scrapy_dist.settings import SchedulerSettings


def _out(url: str, shard: int = 0, payload: bytes = b"\x01p", t1: str = "t") -> Outgoing:
    return Outgoing(Request(url), t1, "", 0.0, payload, shard=shard)


def _result(
    new: str = "", leased: list[tuple[bytes, float]] | None = None, work_repaired: bool = False,
    **counts: int,
) -> SyncResult:
    return SyncResult(
        [c == "1" for c in new], leased or [], counts.get("requeued", 0), 0, counts.get("queued", 0),
        counts.get("inflight", 0), counts.get("delayed", 0), 0, bool(counts.get("paused", 0)),
        counts.get("seq", 0), work_repaired=work_repaired,
    )


def _decode(shard: int, member: bytes) -> Request:
    return Request(f"http://site.test/{member.decode()}")


# -- batches ---------------------------------------------------------------------------------------


def test_a_round_takes_everything_to_the_right_shard_and_empties_the_buffers() -> None:
    ledger = Ledger(shards=3, worker_id="w")
    ledger.add(_out("http://a/1", shard=2), now=1.0)
    ledger.add(_out("http://a/2", shard=0), now=2.0)
    ledger.delay(Delay(-1.0, b"\x01d", 99.0, shard=1), now=3.0)
    ledger.dead_letter('{"reason": "500"}', now=3.0)
    ledger.penalize("a", 5.0, now=3.0)
    ledger.releases.append((1, b"r"))
    ledger.acks.append((2, b"old"))
    assert ledger.first_pending == 1.0
    batches = ledger.take_batches([0, 5, 0], renew=False)
    assert [len(b.enqueue) for b in batches] == [1, 0, 1]
    assert batches[1].delay == [(-1.0, b"\x01d", 99.0, "", "")]
    assert batches[0].dead == ['{"reason": "500"}'] and batches[0].penalize == [("a", 5.0)]
    assert batches[1].release == [b"r"] and batches[2].ack == [b"old"]
    assert [b.lease for b in batches] == [0, 5, 0]
    assert not ledger.owes() and ledger.first_pending is None


def test_an_ack_travels_with_its_output_only_when_all_of_it_goes_to_its_shard() -> None:
    ledger = Ledger(shards=3)
    ledger.acks_new = [(1, b"same"), (2, b"other")]
    ledger.add(_out("http://a/child", shard=1), now=0.0)
    batches = ledger.take_batches([0, 0, 0], renew=False)
    assert batches[1].ack == [b"same"]  # one atomic call carries the child and the ack
    assert batches[2].ack == [] and ledger.acks_waiting == [(2, b"other")]
    ledger.finish_round(landed=True, now=1.0)
    assert ledger.acks == [(2, b"other")] and ledger.first_pending == 1.0
    assert ledger.take_batches([0, 0, 0], renew=False)[2].ack == [b"other"]


def test_a_round_that_skips_shards_keeps_their_requests_and_acks_until_every_shard_has_landed() -> None:
    ledger = Ledger(shards=3)
    ledger.acks = [(2, b"landed")]
    ledger.add(_out("http://a/0", shard=0), now=0.0)
    ledger.add(_out("http://a/2", shard=2), now=0.0)
    ledger.acks_new = [(0, b"parent")]  # its output went to shards 0 and 2
    first = ledger.take_batches([4, 0, 0], renew=False, skip={1, 2})
    assert [len(b.enqueue) for b in first] == [1, 0, 0] and not first[2].ack and first[0].lease == 4
    # what waits for shard 2's turn does not make a round due by itself (SyncLoop.due)
    assert ledger.acks == [(2, b"landed")] and len(ledger.out) == 1 and ledger.first_pending is None
    assert ledger.acks_cycle == [(0, b"parent")] and not first[0].ack  # a/2 is not in Redis yet
    ledger.finish_round(landed=True, now=1.0)
    assert ledger.acks_cycle == [(0, b"parent")] and ledger.first_pending is None
    second = ledger.take_batches([0, 0, 0], renew=False, skip={0, 1})
    assert second[2].enqueue and second[2].ack == [b"landed"] and not ledger.out
    ledger.restore(2, second[2], now=2.0)  # shard 2's call failed
    ledger.finish_round(landed=False, now=2.0)
    assert ledger.acks_cycle == [(0, b"parent")]
    third = ledger.take_batches([0, 0, 0], renew=False, skip={0, 1})
    assert third[2].enqueue and ledger.first_pending is None
    ledger.finish_round(landed=True, now=3.0)
    assert ledger.acks == [(0, b"parent")] and not ledger.acks_cycle  # every shard has landed a/2's round


def test_a_busy_sharded_round_calls_one_shard_in_turn_and_leases_from_one_known_to_hold_requests() -> None:
    ledger, router = Ledger(shards=3), ShardRouter(3)
    loop = SyncLoop(ledger, router, [], Engine(), SchedulerSettings(), decode=_decode,
                    on_applied=lambda a, r: None)
    assert loop.plan(8) == ([3, 3, 2], set())  # nothing known queued anywhere: every shard
    for shard, queued in enumerate([5, 0, 7]):
        router.observe(shard, _result(queued=queued))
    assert loop.plan(8) == ([8, 0, 0], {1, 2})
    assert loop.plan(8) == ([0, 0, 8], {0})  # shard 1's turn, leased from the next holding requests
    assert loop.plan(0) == ([0, 0, 0], {0, 1})
    ledger.add(_out("http://a/x", shard=1), now=0.0)
    ledger.left_behind = 1  # a backlog goes to every shard at once
    assert loop.plan(8)[1] == set()


def test_a_backlog_goes_in_short_calls_in_order_and_acks_wait_for_the_last() -> None:
    """After an outage thousands of requests wait: a round carries at most CALL_RECORDS of them per shard
    (short script calls), the rest stays in order for the next round, and the acks of just-finished
    requests (whose output may be in the rest) go with the round that takes the last of it."""
    ledger = Ledger(shards=1)
    for i in range(300):
        ledger.add(_out(f"http://a/{i}"), now=float(i))
    ledger.acks_new = [(0, b"parent")]
    ledger.acks = [(0, b"older")]
    first = ledger.take_batches([0], renew=False, max_records=128)[0]
    assert len(first.enqueue) == 128 and ledger.left_behind == 172
    assert first.ack == [b"older"] and ledger.acks_new == [(0, b"parent")]
    assert ledger.first_pending == 0.0  # the oldest write still waits
    ledger.restore(0, first, now=400.0)  # the call failed: back in front, order kept
    assert [e.request.url for e in ledger.out[:2]] == ["http://a/0", "http://a/1"]
    assert len(ledger.out) == 300
    ledger.finish_round(landed=False, now=400.0)
    sizes = []
    while True:
        batch = ledger.take_batches([0], renew=False, max_records=128)[0]
        sizes.append(len(batch.enqueue))
        if not ledger.left_behind:
            break
        assert batch.ack == [] or batch.ack == [b"older"]
    assert sizes == [128, 128, 44] and batch.ack == [b"parent"]
    assert ledger.first_pending is None


def test_a_round_sends_a_shards_many_requests_in_several_short_calls_and_acks_wait_for_it_to_land() -> None:
    """More requests than CALL_RECORDS between two rounds (a busy reactor) go in up to ``max_calls`` calls
    per shard in the same round; leases, renewals and older acks ride in the shard's first call (which
    carries a sixth of a request less for each: 10 here, so 47); the acks of just-finished requests wait
    until the whole round has landed (their output spans several calls)."""
    ledger = Ledger(shards=2)
    for i in range(10):
        ledger.add(_out(f"http://a/s0-{i}", shard=0), now=0.0)
    for i in range(130):
        ledger.add(_out(f"http://a/s1-{i}", shard=1), now=0.0)
    ledger.acks_new = [(1, b"parent")]
    ledger.acks = [(1, b"older")]
    ledger.held = {(1, b"kept")}
    batches = ledger.take_batches([5, 7], renew=True, max_records=48, max_calls=3)
    assert ledger.call_shards == [0, 1, 1, 1]
    assert [len(b.enqueue) for b in batches] == [10, 47, 48, 35] and ledger.left_behind == 0
    assert [b.lease for b in batches] == [5, 7, 0, 0]
    assert batches[1].ack == [b"older"] and batches[1].renew == [b"kept"]
    assert not any(b.ack or b.renew for b in batches[2:])
    assert ledger.acks_waiting == [(1, b"parent")]
    # the third call failed: its requests go back in front, the held ack waits for another round
    ledger.restore(3, batches[3], now=1.0)
    ledger.finish_round(landed=False, now=1.0)
    assert [e.request.url for e in ledger.out] == [f"http://a/s1-{i}" for i in range(95, 130)]
    assert ledger.acks_new == [(1, b"parent")]
    again = ledger.take_batches([0, 0], renew=False, max_records=48, max_calls=3)
    assert ledger.call_shards == [0, 1] and len(again[1].enqueue) == 35
    assert again[1].ack == [b"parent"]  # now all its possible output travels in this one call


def test_the_call_that_settles_a_whole_prefetch_carries_fewer_discovered_requests() -> None:
    """An ack, a lease or a renewal costs the script about a sixth of a discovered request: the call that
    carries them takes that many fewer requests (the round's other calls take the rest, in order), so a
    call leasing a whole prefetch is no longer than the others. It always takes a few."""
    ledger = Ledger()
    for i in range(60):
        ledger.add(_out(f"http://a/{i}", t1=str(i)), now=0.0)
    ledger.acks = [(0, f"done{i}".encode()) for i in range(32)]
    batches = ledger.take_batches([64], renew=False, max_records=48, max_calls=3)
    assert [len(b.enqueue) for b in batches] == [48 - (64 + 32) // SETTLE_PER_RECORD, 60 - 32]
    assert batches[0].lease == 64 and len(batches[0].ack) == 32 and batches[1].lease == 0
    assert [item[0] for b in batches for item in b.enqueue] == [str(i) for i in range(60)]  # in order
    for i in range(60):
        ledger.add(_out(f"http://b/{i}"), now=1.0)
    batches = ledger.take_batches([0], renew=False, max_records=48, max_calls=3)
    assert [len(b.enqueue) for b in batches] == [48, 12]  # nothing to settle: a full first call
    for i in range(60):
        ledger.add(_out(f"http://c/{i}"), now=2.0)
    ledger.acks = [(0, f"x{i}".encode()) for i in range(1000)]
    batches = ledger.take_batches([64], renew=False, max_records=48, max_calls=3)
    assert [len(b.enqueue) for b in batches] == [SETTLE_MIN_RECORDS, 48, 4]


def test_past_max_calls_a_shards_requests_wait_in_order_for_the_next_round() -> None:
    ledger = Ledger()
    for i in range(200):
        ledger.add(_out(f"http://a/{i}"), now=0.0)
    ledger.acks_new = [(0, b"parent")]
    batches = ledger.take_batches([0], renew=False, max_records=48, max_calls=3)
    assert [len(b.enqueue) for b in batches] == [48, 48, 48] and ledger.left_behind == 56
    assert ledger.out[0].request.url == "http://a/144"
    assert ledger.acks_new == [(0, b"parent")] and ledger.acks_waiting == []


def test_more_short_calls_per_round_once_draining_a_backlog_took_a_quarter_of_a_lease() -> None:
    ledger = Ledger()
    loop = _loop(ledger)  # lease_seconds 30
    for i in range(1000):
        ledger.add(_out(f"http://a/{i}"), now=0.0)  # waited since long ago (an outage)
    assert loop.calls_per_round(100.0) == CALLS_PER_ROUND
    loop.backlog_since = 100.0  # the first round that left part of it behind
    assert loop.calls_per_round(107.4) == CALLS_PER_ROUND
    # a Redis too far for the rounds to keep up: more calls at once, every one still short
    calls = loop.calls_per_round(107.5)
    batches = ledger.take_batches([0], renew=False, max_records=CALL_RECORDS, max_calls=calls)
    assert max(len(b.enqueue) for b in batches) == CALL_RECORDS
    assert sum(len(b.enqueue) for b in batches) == 1000 and ledger.left_behind == 0


def test_a_round_that_left_a_backlog_is_followed_by_the_next_at_once() -> None:
    ledger = Ledger()
    loop = _loop(ledger)
    loop.last_sync, loop.next_renew = 100.0, 110.0
    for i in range(6):
        ledger.ready.push(0.0, _decode(0, b"x"), (0, str(i).encode()))
    ledger.add(_out("http://a/1"), now=100.0)
    assert loop.due(100.01)[0] is False  # one request, young: it waits for more
    ledger.left_behind = 1
    assert loop.due(100.01)[0] is True


def test_held_back_acks_wait_again_when_a_shard_failed() -> None:
    ledger = Ledger(shards=2)
    ledger.acks_new = [(0, b"a")]
    ledger.add(_out("http://a/c", shard=1), now=0.0)
    batches = ledger.take_batches([0, 0], renew=False)
    ledger.restore(1, batches[1], now=2.0)
    ledger.finish_round(landed=False, now=2.0)
    assert ledger.acks_new == [(0, b"a")] and ledger.acks == []
    assert [e.request.url for e in ledger.out] == ["http://a/c"]


def test_a_failed_shard_gets_its_batch_back_in_front_of_newer_writes() -> None:
    ledger = Ledger(shards=1)
    ledger.add(_out("http://a/1"), now=0.0)
    ledger.delay(Delay(0.0, b"\x01x", 10.0), now=0.0)
    ledger.dead_letter("{}", now=0.0)
    ledger.acks.append((0, b"k"))
    [batch] = ledger.take_batches([3], renew=False)
    ledger.add(_out("http://a/2"), now=1.0)
    ledger.restore(0, batch, now=1.0)
    assert [e.request.url for e in ledger.out] == ["http://a/1", "http://a/2"]
    assert [d.payload for d in ledger.delays] == [b"\x01x"] and ledger.dead == ["{}"]
    assert ledger.acks == [(0, b"k")] and ledger.first_pending == 1.0


def test_renewal_rounds_renew_every_held_lease() -> None:
    ledger = Ledger(shards=2)
    ledger.held = {(0, b"a"), (1, b"b")}
    assert ledger.take_batches([0, 0], renew=False)[0].renew == []
    batches = ledger.take_batches([0, 0], renew=True)
    assert (batches[0].renew, batches[1].renew) == ([b"a"], [b"b"])


# -- answers ---------------------------------------------------------------------------------------


def test_an_answer_counts_new_requests_logs_duplicates_and_keeps_unencodable_ones_local() -> None:
    ledger = Ledger()
    ledger.add(_out("http://a/new"), now=0.0)
    ledger.add(_out("http://a/dup"), now=0.0)
    ledger.add(_out("http://a/local", payload=b""), now=0.0)
    ledger.add(_out("http://a/unfiltered", t1=""), now=0.0)
    [batch] = ledger.take_batches([0], renew=False)
    applied = ledger.apply(0, batch, _result("1010"), _decode, now=1.0)
    assert applied.enqueued == 1
    assert [r.url for r in applied.duplicates] == ["http://a/dup"]  # dont_filter ones are never logged
    assert [r.url for r in ledger.local] == ["http://a/local"]


def test_leased_entries_are_held_and_served_acks_release_them() -> None:
    ledger = Ledger()
    ledger.held = {(0, b"done")}
    ledger.acks.append((0, b"done"))
    [batch] = ledger.take_batches([2], renew=False)
    applied = ledger.apply(0, batch, _result(leased=[(b"x", 0.0), (b"y", 0.0)]), _decode, now=1.0)
    assert applied.leased == 2 and ledger.held == {(0, b"x"), (0, b"y")}
    first = ledger.hand_out()
    assert first is not None and first.url == "http://site.test/x"
    assert ledger.handed[first] == (0, b"x")
    ledger.collect_finished(busy={first}, now=2.0)
    assert ledger.acks_new == []  # still in the engine
    ledger.collect_finished(busy=set(), now=3.0)
    assert ledger.acks_new == [(0, b"x")] and ledger.first_pending == 3.0


def test_a_lease_swept_while_its_holder_was_stopped_and_leased_back_to_it_is_served_and_acked_once() -> None:
    # the sweep put the stopped worker's request back in the queue and a call of the same worker leased it
    # again under the same lease key: a second copy would ride that key, and its items the first's ack
    ledger = Ledger()
    [batch] = ledger.take_batches([1], renew=False)
    ledger.apply(0, batch, _result(leased=[(b"x", 0.0)]), _decode, now=1.0)
    first = ledger.hand_out()
    [batch] = ledger.take_batches([1], renew=False)
    applied = ledger.apply(0, batch, _result(leased=[(b"x", 0.0)]), _decode, now=2.0)
    assert applied.leased == 1 and ledger.hand_out() is None and ledger.held == {(0, b"x")}
    ledger.collect_finished(busy=set(), now=3.0)
    assert list(ledger.handed) == [] and ledger.acks_new == [(0, b"x")] and first is not None
    # an ack sent in the very call that leases its entry again settles first: that copy is served
    [batch] = ledger.take_batches([1], renew=False)
    assert batch.ack == [b"x"]
    ledger.apply(0, batch, _result(leased=[(b"x", 0.0)]), _decode, now=4.0)
    again = ledger.hand_out()
    assert again is not None and again.url == "http://site.test/x"


@pytest.mark.parametrize(
    "error", [RejectedEntry("bad_callback", "cb is a list"), TypeError("unhashable type: 'list'")]
)
def test_an_entry_that_cannot_become_a_request_is_rejected_and_the_rest_served(error: Exception) -> None:
    ledger = Ledger(worker_id="w1")

    def decode(shard: int, member: bytes) -> Request:
        if member == b"bad":
            raise error
        return _decode(shard, member)

    [batch] = ledger.take_batches([2], renew=False)
    applied = ledger.apply(0, batch, _result(leased=[(b"bad", 0.0), (b"ok", 0.0)]), decode, now=5.0)
    assert [lease for lease, _ in applied.rejected] == [(0, b"bad")]
    [(lease, record)] = ledger.rejects
    parsed = json.loads(record)
    assert lease == (0, b"bad") and parsed["raw"] == "bad" and parsed["worker"] == "w1"
    assert parsed["reason"] == ("bad_callback" if isinstance(error, RejectedEntry) else "bad_entry")
    assert len(ledger.ready) == 1 and ledger.first_pending == 5.0
    # the rejection goes out with the next round, which drops the lease
    [batch] = ledger.take_batches([0], renew=False)
    assert batch.reject == [(b"bad", record)]


def test_with_shards_the_best_leased_request_is_served_first() -> None:
    ledger = Ledger(shards=2)
    for shard, member, score in ((0, b"low", 0.0), (1, b"high", -5.0), (0, b"mid", -1.0)):
        ledger.ready.push(score, _decode(shard, member), (shard, member))
    order = [r.url.rsplit("/", 1)[1] for r in iter(ledger.hand_out, None)]
    assert order == ["high", "mid", "low"]


def test_at_close_everything_not_finished_is_released() -> None:
    ledger = Ledger()
    ledger.ready.push(0.0, _decode(0, b"a"), (0, b"a"))
    ledger.ready.push(0.0, _decode(0, b"b"), (0, b"b"))
    ledger.hand_out()
    ledger.release_all(now=1.0)
    assert sorted(ledger.releases) == [(0, b"a"), (0, b"b")]
    assert not ledger.ready and not ledger.handed and ledger.owes()


# -- router ----------------------------------------------------------------------------------------


def test_leases_are_split_by_queue_length_and_evenly_while_nothing_is_known() -> None:
    router = ShardRouter(3)
    assert ShardRouter(1).lease_split(10) == [10]
    assert router.lease_split(10) == [4, 3, 3]
    assert router.lease_split(2) == [1, 1, 1]  # new work anywhere is found in one round
    for shard, queued in enumerate((0, 30, 10)):
        router.observe(shard, _result(queued=queued))
    assert router.lease_split(8) == [0, 6, 2]
    assert router.lease_split(0) == [0, 0, 0]


def test_an_empty_sharded_frontier_needs_two_equal_readings() -> None:
    router = ShardRouter(2)
    for shard in (0, 1):
        router.observe(shard, _result(seq=7))
    assert not router.settle().empty_confirmed
    assert router.settle().empty_confirmed
    router.observe(1, _result(seq=8))  # an entry was created (and consumed) in between
    assert not router.settle().empty_confirmed
    router.forget_snapshot()
    assert not router.settle().empty_confirmed
    one = ShardRouter(1)
    one.observe(0, _result())
    assert one.settle().empty_confirmed
    one.observe(0, _result(delayed=1))
    state = one.settle()
    assert not state.empty_confirmed and state.as_dict() == {"queued": 0, "inflight": 0, "delayed": 1}


def test_an_empty_frontier_right_after_a_repair_is_not_drained_yet() -> None:
    """A sync call that moved a key of another type aside (the queue, say) sees that key empty; whoever
    swapped it in may put the crawl's own back a moment later. Empty counts again after REPAIR_GRACE."""
    from scrapy_dist.frontier.layout import REPAIR_GRACE

    router = ShardRouter(1)
    router.observe(0, _result(work_repaired=True), now=100.0)
    assert not router.settle(now=100.0).empty_confirmed
    router.observe(0, _result(), now=101.0)
    assert not router.settle(now=100.0 + REPAIR_GRACE - 0.1).empty_confirmed
    assert router.settle(now=100.0 + REPAIR_GRACE).empty_confirmed


# -- loop timing -----------------------------------------------------------------------------------


def _loop(ledger: Ledger, **kw: float) -> SyncLoop:
    return SyncLoop(
        ledger, ShardRouter(1), [], Engine(), decode=_decode, on_applied=lambda a, r: None,
        config=SchedulerSettings(prefetch=10, flush_interval=0.05, flush_batch=3, idle_poll=0.25,
                                 lease_seconds=30.0), **kw,
    )


def test_a_round_is_due_when_requests_run_low_writes_wait_or_leases_need_renewal() -> None:
    ledger = Ledger()
    loop = _loop(ledger)
    loop.last_sync, loop.next_renew = 100.0, 110.0
    assert loop.due(100.0) == (True, 10)  # nothing leased yet
    for i in range(6):
        ledger.ready.push(0.0, _decode(0, b"x"), (0, str(i).encode()))
    assert loop.due(100.1) == (False, 0)  # enough leased, nothing waits, view fresh
    ledger.add(_out("http://a/1"), now=100.1)
    assert loop.due(100.12) == (False, 0)
    assert loop.due(100.16) == (True, 0)  # the write has waited a flush interval
    ledger.add(_out("http://a/2"), now=100.16)
    ledger.add(_out("http://a/3"), now=100.16)
    assert loop.due(100.16)[0]  # a full batch goes at once
    ledger.take_batches([0], renew=False)
    assert loop.due(100.4) == (True, 0)  # the crawl-wide view is stale
    loop.last_sync = 109.9
    assert loop.due(110.0) == (True, 0)  # leases need renewal
    loop.paused = True
    ledger.ready.clear()
    assert loop.due(110.5) == (True, 0)  # paused: nothing is leased


def test_discovered_requests_that_outrank_every_leased_one_are_counted() -> None:
    ledger = Ledger()
    ledger.add(Outgoing(Request("http://a/first"), "t", "", -9.0, b"\x01"), now=0.0)
    assert ledger.outranked() == 0  # nothing leased: nothing to hold back, the usual prefetch applies
    ledger.take_batches([0], renew=False)
    ledger.ready.push(-1.0, _decode(0, b"a"), (0, b"a"))
    ledger.add(Outgoing(Request("http://a/same"), "t", "", -1.0, b"\x01"), now=0.0)
    assert ledger.outranked() == 0  # equal priority: the leased one was first
    for score in (-3.0, -2.0, 0.0):
        ledger.add(Outgoing(Request("http://a/x"), "t", "", score, b"\x01"), now=0.0)
    assert ledger.outranked() == 2
    loop = _loop(ledger)
    loop.last_sync, loop.next_renew = 0.0, 100.0
    assert loop.due(0.01) == (True, 9)  # flushed at once; prefetch minus the one leased
    for i in range(8):
        ledger.ready.push(-1.0, _decode(0, b"b"), (0, str(i).encode()))
    assert loop.due(0.01) == (True, 2)  # enough leased, but the two better ones are fetched back
    ledger.take_batches([2], renew=False)
    assert ledger.outranked() == 0 and ledger.best_out == float("inf")


def test_downloader_aware_hand_out_serves_the_least_loaded_slot_first() -> None:
    ledger = Ledger()
    for member, score in ((b"a/1", -5.0), (b"a/2", -4.0), (b"b/1", 0.0), (b"c/1", -1.0)):
        ledger.ready.push(score, _decode(0, member), (0, member))
    active = {"a": 3, "b": 0, "c": 0}

    def load(request: Request) -> int:
        return active[request.url.rsplit("/", 2)[1]]

    order = []
    while (r := ledger.hand_out(load)) is not None:
        slot = r.url.rsplit("/", 2)[1]
        order.append(r.url.split("site.test/")[1])
        active[slot] += 1
    # c and b are idle: c's request first (better priority), then b's; then a's in priority order
    assert order == ["c/1", "b/1", "a/1", "a/2"]


def test_a_record_only_entry_is_deduped_and_then_forgotten() -> None:
    seed = Request("http://a/seed", dont_filter=True)
    for flags in ("11", "01"):  # recorded now, or already known: never crawled locally nor logged
        ledger = Ledger()
        ledger.add(Outgoing(seed, "t", "u", 0.0, b"", record_only=True), now=0.0)
        ledger.add(Outgoing(seed, "", "", 0.0, b"\x01p"), now=0.0)
        [batch] = ledger.take_batches([0], renew=False)
        assert batch.enqueue == [("t", "u", 0.0, b"", "", ""), ("", "", 0.0, b"\x01p", "", "")]
        applied = ledger.apply(0, batch, _result(flags), _decode, now=1.0)
        assert applied.enqueued == 1 and not applied.duplicates and not ledger.local


def test_a_start_request_is_sent_now_only_while_the_engine_has_room() -> None:
    """As Scrapy's engine: a start request goes first while fewer requests than the engine downloads at a
    time are in it or on their way to it, and nothing leased waits."""
    from scrapy_dist.frontier.orders import START_NOW

    ledger = Ledger()
    assert ledger.starts_now(1) and ledger.starts_now(2)
    ledger.add(Outgoing(Request("http://a/1"), "", "", START_NOW, b"\x01p"), now=0.0)
    ledger.add(Outgoing(Request("http://a/1"), "t", "u", START_NOW, b"", record_only=True), now=0.0)
    ledger.add(Outgoing(Request("http://a/2"), "", "", 0.5, b"\x01p"), now=0.0)
    assert not ledger.starts_now(1) and ledger.starts_now(2)  # one on its way; the record is not a request
    [batch] = ledger.take_batches([1], renew=False)
    assert not ledger.starts_now(1) and ledger.starts_now(2)  # in a round still
    ledger.apply(0, batch, _result("111", leased=[(b"m1", START_NOW)]), _decode, now=1.0)
    ledger.finish_round(True, now=1.0)
    assert not ledger.starts_now(2)  # leased, waiting for the engine: the engine takes that first
    assert ledger.hand_out() is not None
    assert not ledger.starts_now(1) and ledger.starts_now(2)  # in the engine
