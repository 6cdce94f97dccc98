"""The scheduler's background task: rounds of ``sync`` calls between the worker's ledger and Redis; a failed
call's batch goes back in the ledger and the loop backs off (ended by accident: ``scheduler_failed``)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from scrapy_dist.frontier.shard import CALLS_PER_ROUND
from scrapy_dist.redis.outage import BackgroundTask, Backoff, Outage, is_outage
from scrapy_dist.utils import RateLimitedLog

if TYPE_CHECKING:
    from scrapy import Request

    from scrapy_dist.frontier.engine import Engine
    from scrapy_dist.frontier.layout import FrontierState, ShardRouter
    from scrapy_dist.frontier.ledger import Applied, Ledger
    from scrapy_dist.frontier.shard import Frontier, SyncResult
    from scrapy_dist.settings import SchedulerSettings

logger = logging.getLogger(__name__)

FAILED_REASON = "scheduler_failed"  #: close reason when the loop ends by accident


class SyncLoop(BackgroundTask):
    """The asyncio task that exchanges a worker's :class:`Ledger` with its shards' frontiers."""

    def __init__(
        self, ledger: Ledger, router: ShardRouter, frontiers: list[Frontier], engine: Engine,
        config: SchedulerSettings, *, decode: Callable[[int, bytes], Request], outage: Outage | None = None,
        on_applied: Callable[[Applied, SyncResult], None], on_forget: Callable[[], None] = lambda: None,
        backoff: Backoff | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.outage = outage or Outage()
        super().__init__(self.outage.guard("frontier", backoff, logger), clock)
        self.ledger, self.router, self.frontiers, self.engine = ledger, router, frontiers, engine
        self.decode, self.on_applied, self.config = decode, on_applied, config
        self.prefetch = max(1, config.prefetch)
        #: doubled per empty round up to the max when the worker never closes on its own
        self.poll_interval = self.idle_poll_max = config.idle_poll
        if math.isinf(config.idle_before_close):
            self.idle_poll_max = max(config.idle_poll, config.idle_poll_max)
        self.on_forget = on_forget  # sent URLs may be new again (Redis away or back in time, a forget)
        self._forgets: str | None = None
        self.released_at_close = 0  # leases given back while the engine closed
        self.state: FrontierState | None = None  #: crawl-wide, after the last round reaching every shard
        self.paused = False  # the crawl-wide pause flag (``scrapy-dist pause``), as shard 0 last reported it
        self.backlog = 0  # queued, leased or delayed crawl-wide when the worker joined (until ``state``)
        self.in_sync = False  # a round is under way: its requests are neither in the ledger nor sure in Redis
        self.failing = False  # the last round failed: buffered requests cannot reach Redis now
        self.unanswered: Counter[int] = Counter()  # shard -> leases asked by calls whose answer never came
        self.last_sync, self.rotation = 0.0, 0  # when the last round started; rounds of one shard in turn
        self.flushed_at = [0.0] * router.shards  # per shard: start of the last round sending all it owed
        self.backlog_since: float | None = None  # when the rounds started leaving a backlog behind
        self.next_fetch = self.next_renew = 0.0
        #: (leased, asked for, queued crawl-wide) of the last round; queued: None unless it called every shard
        self.lease_result: tuple[int, int, int | None] = (0, 0, 0)
        self._once = RateLimitedLog.once(logger)
        self._seq_seen: dict[int, int] = {}  # the largest sequence number each shard has reported
        #: awaited before a round acking newly finished requests (feeds made durable); if it raises, acks wait
        self.ack_barrier: Callable[[], Awaitable[None]] | None = None

    async def step(self) -> bool:
        """Rest until woken or ``flush_interval`` (not with a backlog), then one turn; raises its error."""
        await self.rest(0.0 if self.ledger.left_behind else self.config.flush_interval)
        if self.closing:
            return False
        await self._turn()
        return True

    def failed(self, exc: BaseException, now: float | None = None, detail: str = "") -> float:
        if is_outage(exc):  # Redis may come back with acknowledged writes rolled back (failover, lost AOF)
            self.on_forget()
        held = f"{len(self.ledger.out)} discovered requests and {len(self.ledger.held)} leases kept in memory"
        return super().failed(exc, now, detail or held)

    def crashed(self, exc: BaseException | None) -> None:
        logger.critical(
            "The scheduler's frontier loop stopped unexpectedly (%s): closing this worker (reason %s); its"
            " leases return to the queue when they expire",
            f"{type(exc).__name__}: {exc}" if exc else "returned", FAILED_REASON, exc_info=exc)
        self.engine.close(FAILED_REASON)

    async def _turn(self) -> None:
        now = self.clock()
        # closing: what waits in the downloader is given back now, not fetched one per download delay
        taken = self.engine.take_unstarted(self.ledger.handed.__contains__)
        self.released_at_close += self.ledger.release(taken, now)
        self.collect_finished(now)
        due, lease = self.due(now)
        if not due:
            return
        renew = now >= self.next_renew
        if (error := await self.round(lease, renew, partial=not renew)) is not None:
            raise error
        self.succeeded()
        if renew:
            self.next_renew = now + self.config.lease_seconds / 3
        self.last_sync = now
        got, asked, queued = self.lease_result
        starved = asked and got < asked and queued == 0  # nothing to lease: poll gently
        self.poll_interval = (min(self.idle_poll_max, self.poll_interval * 2)  # nothing at all: poll less
                              if starved and got == 0 and not self.ledger.busy() else self.config.idle_poll)
        self.next_fetch = now + self.poll_interval if starved else now

    def collect_finished(self, now: float) -> None:
        """Acknowledge requests the engine has finished (download, callback and pipelines)."""
        if not self.ledger.handed:
            return
        if (busy := self.engine.inprogress()) is None:
            self._once.log(logging.WARNING, "Cannot see the engine's requests in progress: acknowledging on"
                           " hand-out", key="inprogress")
            busy = ()
        self.ledger.collect_finished(busy, now)

    def due(self, now: float) -> tuple[bool, int]:
        """Whether a round is due now, and how many requests it should lease."""
        ledger, cfg = self.ledger, self.config
        want = outranked = 0
        if not self.paused:
            if len(ledger.ready) < max(1, self.prefetch // 2):
                want = self.prefetch - len(ledger.ready)
            outranked = ledger.outranked()  # better than anything leased: store them now, lease them back
            want = max(want, min(outranked, self.prefetch))
        fetch = want > 0 and now >= self.next_fetch
        # a share kept for a shard not called has no ``first_pending``: it goes in its turn, with the rounds
        # of new writes or the stale ones; a full batch, an outranking request or a backlog go at once
        flush = (ledger.first_pending is not None and now - ledger.first_pending >= cfg.flush_interval
                 or len(ledger.out) >= cfg.flush_batch or outranked > 0 or ledger.left_behind > 0)
        stale = now - self.last_sync >= self.poll_interval
        return (fetch or flush or stale or now >= self.next_renew), (want if fetch or flush or stale else 0)

    def calls_per_round(self, now: float) -> int:
        """Most sync calls per shard this round: eight times as many once draining a backlog has taken a
        quarter of a lease, so that the acks it holds back go before their leases run out."""
        late = self.backlog_since is not None and now - self.backlog_since >= self.config.lease_seconds / 4
        return CALLS_PER_ROUND * 8 if late else CALLS_PER_ROUND

    def plan(self, lease: int) -> tuple[list[int], set[int]]:
        """The round's lease per shard and the shards it does not call: with shards and nothing urgent, one
        shard in turn with what it is owed, and the whole lease from the next one known to hold requests."""
        ledger, router, n = self.ledger, self.router, self.router.shards
        if n == 1 or ledger.left_behind or len(ledger.out) >= self.config.flush_batch or ledger.outranked():
            return router.lease_split(lease), set()
        turn = lender = self.rotation % n
        counts = [0] * n
        if lease > 0:
            known = [i % n for i in range(turn, turn + n) if (st := router.states[i % n]) and st[0] > 0]
            if not known:  # nothing known queued anywhere: ask every shard (and see the crawl-wide state)
                return router.lease_split(lease), set()
            lender = known[0]
            counts[lender] = lease
        self.rotation += 1
        return counts, set(range(n)).difference((turn, lender))

    async def round(self, lease: int, renew: bool, partial: bool = False) -> BaseException | None:
        """One exchange with every shard at once (``partial``: those :meth:`plan` picks and those owed
        something urgent); a failed call's batch is put back. The first error, or ``None``."""
        ledger, router = self.ledger, self.router
        try:
            if self.ack_barrier is not None and ledger.acks_new:
                await self.ack_barrier()
            if self.unanswered:
                await self.give_back_unanswered()
        except Exception as exc:  # nothing taken yet: every ack stays owed, lost leases are tried next round
            return exc
        started = self.clock()
        counts, skip = self.plan(lease) if partial else (router.lease_split(lease), set())
        batches = ledger.take_batches(counts, renew, max_calls=self.calls_per_round(started), skip=skip)
        shard_of = ledger.call_shards
        sending = [i for i, b in enumerate(batches) if b or shard_of[i] not in skip]
        if not ledger.left_behind:
            self.backlog_since = None
        elif self.backlog_since is None:
            self.backlog_since = started
        self.in_sync = True
        try:
            if len(sending) == 1:
                results: dict[int, Any] = {}
                try:
                    results[sending[0]] = await self.frontiers[shard_of[sending[0]]].sync(batches[sending[0]])
                except Exception as exc:
                    results[sending[0]] = exc
            else:  # one call per shard, and more for a backlog: all sent at once, each short on the server
                answers = await asyncio.gather(
                    *(self.frontiers[shard_of[i]].sync(batches[i]) for i in sending), return_exceptions=True)
                results = dict(zip(sending, answers, strict=True))
        finally:
            self.in_sync = False
        now = self.clock()
        error: BaseException | None = None
        # failed calls go back in front of what came since, in their order; the first one's error is told
        for call in reversed(sending):
            if isinstance(results[call], BaseException):
                ledger.restore(call, batches[call], now)
                error = results[call]
                if batches[call].lease:  # Redis may have run the call and granted leases nobody heard of
                    self.unanswered[shard_of[call]] += batches[call].lease
        answered = [(call, r) for call, r in results.items() if not isinstance(r, BaseException)]
        seqs: dict[int, int] = {}  # a shard's state is its last-run call's (the largest seq: it only grows)
        for call, result in sorted(answered, key=lambda cr: cr[1].seq):
            router.observe(shard_of[call], result)
            seqs[shard_of[call]] = result.seq
        self._check_seq(seqs)
        got = 0
        for call, result in answered:
            applied = ledger.apply(call, batches[call], result, self.decode, now)
            got += applied.leased
            if call == 0:  # the crawl-wide pause flag lives with shard 0
                was_paused, self.paused = self.paused, result.paused
                if was_paused != self.paused:
                    self.engine.wake()
                if self._forgets is not None and result.forgets != self._forgets:
                    self.on_forget()
                self._forgets = result.forgets
            self.on_applied(applied, result)
        ledger.finish_round(error is None, now)
        self.failing = error is not None
        if error is None:
            for shard in ledger.flushing:
                self.flushed_at[shard] = started
            queued: int | None = None  # the crawl-wide state needs every shard's answer
            if not skip:
                self.state = state = router.settle()
                queued = state.queued
            if ledger.ready or not (skip or state.queued or state.inflight):
                self.engine.wake()
            self.lease_result = (got, lease, queued)
        else:
            router.forget_snapshot()
        return error

    async def give_back_unanswered(self) -> None:
        """Give back the leases of this worker that its ledger does not know: a call whose answer was lost
        (Redis stopped or the connection broke after it ran) granted them, and they would otherwise wait
        for their lease to run out. At most as many per shard as those calls asked for."""
        held = self.ledger.held
        for shard, asked in list(self.unanswered.items()):
            keys = await self.frontiers[shard].own_leases(asked + len(held))
            del self.unanswered[shard]
            if lost := [(shard, key) for key in keys if (shard, key) not in held][:asked]:
                self.ledger.give_back(lost, self.clock())
                logger.info("Giving back %d leases granted by a call whose answer was lost", len(lost))

    def _check_seq(self, seqs: dict[int, int]) -> None:
        """One WARNING each time a shard's sequence number goes down: Redis lost the crawl's data."""
        for shard, seq in seqs.items():
            before = self._seq_seen.get(shard, 0)
            self._seq_seen[shard] = seq
            if seq < before:
                self.on_forget()
                logger.warning(
                    "The frontier in Redis went back in time (shard %d's sequence number fell from %d to %d):"
                    " Redis lost crawl data (restarted without persistence, a failover that lost writes, or"
                    " deleted keys). Queued requests may be gone (this worker re-sends what it holds) and"
                    " forgotten pages are crawled again; see docs/operations.md#outages", shard, before, seq)

    async def drain(self, timeout: float) -> None:
        """At close: rounds until nothing is owed, for at most ``timeout`` seconds of Redis being away."""
        deadline, ledger = self.clock() + timeout, self.ledger
        while self.frontiers and ledger.owes():
            if (error := await self.round(lease=0, renew=False)) is None:
                continue
            if not is_outage(error) or self.clock() > deadline:
                logger.error(
                    "%s at close (%s): %d leased requests will be requeued when their leases expire; %d"
                    " discovered requests were not saved",
                    "Redis unreachable" if is_outage(error) else "The frontier's last writes failed",
                    error, len(ledger.held), len(ledger.out))
                return
            await self.back_off(1.0)
