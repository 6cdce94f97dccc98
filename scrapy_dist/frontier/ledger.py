"""What one worker holds and owes the shared frontier (an I/O-free :class:`Ledger`, methods take ``now``),
and the :class:`RequestEncoder` that turns a request into ledger entries."""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any

from scrapy.utils.httpobj import urlparse_cached

from scrapy_dist.dupefilter import RecentFingerprints
from scrapy_dist.exceptions import RejectedEntry, UnserializableRequest
from scrapy_dist.frontier.orders import START_NOW, Lease, LeasedBuffer
from scrapy_dist.frontier.shard import CALL_RECORDS, SyncBatch, split_calls
from scrapy_dist.wire.codec import encode_request, rejection_record

if TYPE_CHECKING:
    from scrapy import Request, Spider

    from scrapy_dist.frontier import orders
    from scrapy_dist.frontier.layout import ShardRouter
    from scrapy_dist.frontier.scheduler import FrontierReport
    from scrapy_dist.frontier.shard import SyncResult
    from scrapy_dist.wire.codec import EntryPolicy

@dataclass(frozen=True, kw_only=True)
class Routed:
    """Where an outgoing entry goes: its shard and, with crawl-wide politeness, its domain and limits."""

    domain: str = ""
    limits: str = ""
    shard: int = 0


@dataclass(frozen=True)
class Outgoing(Routed):
    """A discovered request waiting to be sent to the frontier."""

    request: Request
    t1: Any  # the dupefilter's fingerprint tokens; t1 == "" skips dedupe (dont_filter)
    t2: Any
    score: float
    payload: bytes  # b"" when it could not be encoded: deduped only, then crawled locally
    record_only: bool = False  # only record the fingerprint (the request travels in another entry)


@dataclass(frozen=True)
class Delay(Routed):
    """A request to put in the crawl's delayed set until ``not_before`` (unix time)."""

    score: float
    payload: bytes
    not_before: float


@dataclass
class Applied:
    """What one shard's answer changed, for stats and logs."""

    enqueued: int = 0  # discovered requests found new and stored
    duplicates: list[Request] = field(default_factory=list)  # found already seen (logged as filtered)
    leased: int = 0  # decodable or not
    rejected: list[tuple[Lease, RejectedEntry]] = field(default_factory=list)  # leased, not a request
    acked: int = 0  # acks the call carried (plain and revisits)


@dataclass(eq=False)
class AckRiders:
    """What rides a finished request's ack in the same atomic call: its revisit (the ack also files the
    request again) and the items its page produced (appended only if the ack is accepted)."""

    revisits: dict[Lease, tuple[float, bytes]] = field(default_factory=dict)  # (delay, new member or b"")
    revisit_of: Callable[[Request, Lease], tuple[float, bytes] | None] | None = None
    items: dict[Lease, list[bytes | str]] = field(default_factory=dict)
    items_of: Callable[[Request], list[bytes | str]] | None = None

    def collect(self, request: Request, lease: Lease) -> None:
        if self.items_of is not None and (items := self.items_of(request)):
            self.items.setdefault(lease, []).extend(items)
        if self.revisit_of is not None and (revisit := self.revisit_of(request, lease)) is not None:
            self.revisits[lease] = revisit

    def ack(self, batch: SyncBatch, lease: Lease) -> None:
        if (revisit := self.revisits.pop(lease, None)) is None:
            batch.ack.append(lease[1])
        else:
            batch.revisit.append((lease[1], revisit[0], revisit[1]))
        batch.items += [(lease[1], data) for data in self.items.pop(lease, ())]

    def restore(self, shard: int, batch: SyncBatch) -> None:
        for member, delay, new in batch.revisit:
            self.revisits[(shard, member)] = (delay, new)
        for member, data in batch.items:
            self.items.setdefault((shard, member), []).append(data)


class Ledger:
    """One worker's account with the frontier. Reactor thread only."""

    def __init__(self, shards: int = 1, worker_id: str = "") -> None:
        self.shards, self.worker_id = shards, worker_id
        self.ready = LeasedBuffer()
        self.local: deque[Request] = deque()  # could not be encoded: crawled by this worker only
        self.out: list[Outgoing] = []
        self.handed: dict[Request, Lease] = {}
        self.held: set[Lease] = set()  # every lease held in Redis (renewed each renewal round)
        #: acks by how far their requests' output is in Redis (:meth:`take_batches`)
        self.acks: list[Lease] = []
        self.acks_new: list[Lease] = []
        self.acks_waiting: list[Lease] = []
        self.acks_cycle: list[Lease] = []
        self.unflushed: set[int] = set()
        self.flushing: set[int] = set()
        self.delays: list[Delay] = []
        self.dead: list[str] = []
        self.forgets: list[tuple[int, tuple[Any, Any]]] = []  # (shard, tokens), DEADLETTER_FORGET
        self.rejects: list[tuple[Lease, str]] = []
        self.releases: list[Lease] = []
        self.penalties: list[tuple[int, tuple[str, float]]] = []
        self.first_pending: float | None = None  # when the oldest unsent write was buffered
        self.left_behind = 0  # discovered requests the last round left for the next one
        self.best_out = math.inf  # the best (lowest) score among ``out``
        self._sent: list[list[Outgoing]] = []  # what the current round took, per call
        self.call_shards: list[int] = list(range(shards))  # each call's shard (first ones: the index)
        self.riders = AckRiders()

    def add(self, entry: Outgoing, now: float) -> None:
        self.out.append(entry)
        self.best_out = min(self.best_out, entry.score)
        self._mark(now)

    def delay(self, entry: Delay, now: float) -> None:
        self.delays.append(entry)
        self._mark(now)

    def dead_letter(self, record: str, now: float, forget: tuple[int, tuple[Any, Any]] | None = None) -> None:
        self.dead.append(record)
        if forget is not None:
            self.forgets.append(forget)
        self._mark(now)

    def penalize(self, domain: str, seconds: float, now: float, shard: int = 0) -> None:
        self.penalties.append((shard, (domain, seconds)))
        self._mark(now)

    def reject(self, lease: Lease, exc: RejectedEntry, now: float) -> None:
        """Park a leased entry that is not a valid request with a JSON record."""
        self.rejects.append((lease, rejection_record(exc.reason, lease[1], self.worker_id, exc.detail)))
        self._mark(now)

    def _mark(self, now: float) -> None:
        if self.first_pending is None:
            self.first_pending = now

    def hand_out(self, load: Callable[[Request], int] | None = None) -> Request | None:
        """A local request first, else the best leased one (with ``load``: of the least loaded slot)."""
        if self.local:
            return self.local.popleft()
        if not self.ready:
            return None
        request, lease = self.ready.pop() if load is None else self.ready.pop_least_loaded(load)
        self.handed[request] = lease
        return request

    def collect_finished(self, busy: Collection[Request], now: float) -> int:
        """Requests the engine no longer works on are to be acknowledged."""
        done = [r for r in self.handed if r not in busy]
        for r in done:
            self.acks_new.append(lease := self.handed.pop(r))
            self.riders.collect(r, lease)
        if done:
            self._mark(now)
        return len(done)

    def release(self, requests: list[Request], now: float) -> int:
        """Give back the leases of handed ``requests`` the engine will not start; how many."""
        given = [self.handed.pop(r) for r in requests if r in self.handed]
        self.releases += given
        if given:
            self._mark(now)
        return len(given)

    def give_back(self, leases: list[Lease], now: float) -> None:
        """Release leases this worker holds in Redis without holding their requests."""
        self.releases += leases
        self._mark(now)

    def release_all(self, now: float) -> None:
        """At close: unstarted and unfinished work goes straight back to the queue."""
        self.releases += self.ready.leases() + list(self.handed.values())
        self.ready.clear()
        self.handed.clear()
        if self.releases:
            self._mark(now)

    def outranked(self) -> int:
        """How many unsent requests outrank every leased one (the engine waits for them, not a worse one)."""
        # nothing leased: nothing worse to hold back (the usual prefetch applies)
        if not self.ready or self.best_out >= (best := self.ready.best_score()):
            return 0
        return sum(1 for e in self.out if e.score < best)

    def starts_now(self, concurrency: int) -> bool:
        """Whether the engine (``concurrency`` downloads) would send a start request enqueued now at once."""
        if self.ready or self.local or (room := concurrency - len(self.handed)) <= 0:
            return False
        for e in itertools.chain(self.out, *self._sent):  # stops once the engine would be full
            if e.score <= START_NOW and not e.record_only:
                room -= 1
                if room <= 0:
                    return False
        return True

    def owes(self) -> bool:
        return bool(self.out or self.delays or self.dead or self.rejects or self.penalties or self.forgets
                    or self.releases or self.acks or self.acks_new or self.acks_waiting or self.acks_cycle)

    def busy(self) -> bool:
        """Whether this worker has work of its own: buffered, in the engine, or to send."""
        return bool(self.ready or self.local or self.handed) or self.owes()

    def take_batches(self, lease_counts: list[int], renew: bool, max_records: int = CALL_RECORDS,
                     max_calls: int = 1, skip: Collection[int] = ()) -> list[SyncBatch]:
        """The calls of one round (:func:`split_calls`); the discovered requests and acks of the shards in
        ``skip`` stay for a later round. An ack travels with its request's output only in one atomic call:
        when every write of this round is in the call that carries it; else it waits in ``acks_waiting``
        until :meth:`finish_round`, in ``acks_new`` while requests are left behind, or, once requests are
        kept, in ``acks_cycle`` until every shard has had a round that landed all it was owed."""
        n = self.shards
        settle = list(lease_counts)  # what each shard's first call settles besides its discovered requests
        for shard, _ in itertools.chain(self.acks, self.acks_new, self.held if renew else ()):
            settle[shard] += 1
        out, kept = self.out, []  # no copy of the backlog unless a shard is skipped
        if skip:
            out, kept = [e for e in self.out if e.shard not in skip], [e for e in self.out if e.shard in skip]
        sent, shard_of, left = split_calls(out, n, settle, max_records, max_calls)
        batches = [SyncBatch([(e.t1, e.t2, e.score, e.payload, e.domain, e.limits) for e in call],
                             lease=lease_counts[i] if i < n else 0) for i, call in enumerate(sent)]
        self.left_behind, self.call_shards = len(left), shard_of
        for d in self.delays:
            batches[d.shard].delay.append((d.score, d.payload, d.not_before, d.domain, d.limits))
        for (shard, member), record in self.rejects:
            batches[shard].reject.append((member, record))
        batches[0].dead = self.dead
        for name, due in (("release", self.releases), ("penalize", self.penalties), ("forget", self.forgets)):
            for shard, value in due:
                getattr(batches[shard], name).append(value)
        acks = [lease for lease in self.acks if lease[0] in skip]
        for shard, member in self.acks:
            if shard not in skip:
                self.riders.ack(batches[shard], (shard, member))
        writes = {i for i, b in enumerate(batches) if b.enqueue or b.delay or b.dead or b.forget}
        if self.acks_new and kept and not self.unflushed:
            self.acks_cycle, self.acks_new, self.unflushed = self.acks_new, [], set(range(n))
        # the shards this round owes nothing more once it lands
        self.flushing = set(range(n)).difference(e.shard for e in itertools.chain(left, kept))
        held_new, self.acks_waiting = [], []
        for shard, member in self.acks_new:
            if left or kept:
                held_new.append((shard, member))
            elif writes <= {shard}:
                self.riders.ack(batches[shard], (shard, member))
            else:
                self.acks_waiting.append((shard, member))
        if renew:
            for shard, member in self.held:
                batches[shard].renew.append(member)
        self.out, self.acks, self.acks_new, self.delays, self._sent = left + kept, acks, held_new, [], sent
        self.best_out = min((e.score for e in self.out), default=math.inf)
        self.rejects, self.dead, self.penalties, self.releases, self.forgets = [], [], [], [], []
        if not left:  # requests kept for the shards not called wait for their turn, not a round of their own
            self.first_pending = None
        return batches

    def restore(self, call: int, batch: SyncBatch, now: float) -> None:
        """A call's batch that could not be sent goes back in front of what came since."""
        shard = self.call_shards[call]
        self.out = self._sent[call] + self.out
        self.best_out = min((e.score for e in self.out), default=math.inf)
        self.riders.restore(shard, batch)
        self.acks = [(shard, m) for m in batch.ack] + [(shard, m) for m, _, _ in batch.revisit] + self.acks
        delays = [Delay(*d[:3], domain=d[3], limits=d[4], shard=shard) for d in batch.delay]
        self.delays = delays + self.delays
        self.rejects = [((shard, m), record) for m, record in batch.reject] + self.rejects
        self.dead = batch.dead + self.dead
        self.releases = [(shard, m) for m in batch.release] + self.releases
        self.forgets = [(shard, t) for t in batch.forget] + self.forgets
        self.penalties = [(shard, p) for p in batch.penalize] + self.penalties
        self._mark(now)

    def apply(self, call: int, batch: SyncBatch, result: SyncResult, decode: Callable[[int, bytes], Request],
              now: float) -> Applied:
        """Take in one call's answer; whatever ``decode`` raises rejects the entry, never the worker."""
        applied = Applied(leased=len(result.leased), acked=len(batch.ack) + len(batch.revisit))
        shard = self.call_shards[call]
        for entry, new in zip(self._sent[call], result.new, strict=True):
            if entry.record_only:
                continue
            if new:
                if entry.payload:
                    applied.enqueued += 1
                else:
                    self.local.append(entry.request)  # unserializable but new: this worker crawls it
            elif entry.t1 != "":
                applied.duplicates.append(entry.request)
        settled = (*batch.ack, *batch.release, *(r[0] for r in batch.reject), *(r[0] for r in batch.revisit))
        self.held.difference_update((shard, member) for member in settled)
        for member, score in result.leased:
            if (lease := (shard, member)) in self.held:
                # its own lease, swept while it was stopped or cut off and leased to it again (same key):
                # the copy it holds answers for it (a second copy's items would ride the first one's ack)
                continue
            self.held.add(lease)
            try:
                request = decode(shard, member)
            except RejectedEntry as exc:
                applied.rejected.append((lease, exc))
            except Exception as exc:  # defence in depth: no entry may stop the worker
                applied.rejected.append((lease, RejectedEntry("bad_entry", f"{type(exc).__name__}: {exc}")))
            else:
                self.ready.push(score, request, lease)
        for lease, why in applied.rejected:
            self.reject(lease, why, now)
        return applied

    def finish_round(self, landed: bool, now: float) -> None:
        """Acks held back may go once the round landed on every shard; else they wait again. (Acks kept for
        the shards not called wait for their turn, like requests: they do not make a round due.)"""
        freed, self.acks_waiting, self._sent = self.acks_waiting, [], []
        if not landed:
            self.acks_new = freed + self.acks_new
            return
        self.unflushed -= self.flushing
        if not self.unflushed:
            freed, self.acks_cycle = freed + self.acks_cycle, []
        self.acks = self.acks + freed
        if freed:
            self._mark(now)


@dataclass(eq=False)
class RequestEncoder:
    """A request filtered, encoded under the crawl's entry policy, scored and routed to its shard. No I/O."""

    df: Any
    order: orders.QueueOrder
    router: ShardRouter
    report: FrontierReport
    policy: EntryPolicy
    domain_limits: orders.DomainLimits | None = None
    _: KW_ONLY
    batched: bool = False  # a scrapy-dist dupefilter: fingerprints are checked in the sync call
    polite: bool = False
    spider: Spider | None = None
    recent: RecentFingerprints = field(default_factory=RecentFingerprints)  #: sent lately: seen crawl-wide
    record_start: bool = False  # SEEDS_RECORD_FINGERPRINT
    forget_dead: bool = False  # DEADLETTER_FORGET

    def forgotten(self, request: Request, shard_dfs: list[Any]) -> tuple[int, tuple[Any, Any]]:
        shard = self.router.shard(request)
        tokens = shard_dfs[shard].tokens(request)
        self.recent.discard(tokens[0])  # a link to it found by this worker is new again too
        return shard, tokens

    def filtered(self, request: Request) -> None:
        self.df.log(request, self.spider)

    def handed_out(self, request: Request, now: float) -> None:
        """A leased request goes to the engine: its fingerprint passed the crawl's filter when it was
        queued, so a link to it that this worker finds is dropped here, not checked in Redis again."""
        if self.batched and not request.dont_filter and self.recent.max_age > 0:
            self.recent.add(self.df.fingerprint_tokens(self.df.fingerprint(request))[0], now)

    def encode(self, request: Request) -> bytes | None:
        try:
            return encode_request(request, self.spider, self.policy)
        except UnserializableRequest as exc:
            self.report.unserializable(request, exc)
            return None

    def outgoing(self, request: Request, now: float, starts_now: Callable[[Request], bool]) -> list[Outgoing]:
        """The ledger entries of a discovered request; ``[]`` when it is filtered here."""
        if not self.batched and not request.dont_filter and self.df.request_seen(request):
            self.filtered(request)
            return []
        t1 = t2 = ""
        fp: bytes | None = None
        if self.batched and not request.dont_filter:
            fp = self.df.fingerprint(request)
            t1, t2 = self.df.fingerprint_tokens(fp)
            if self.recent.seen(t1, now):  # this process sent it lately: seen crawl-wide
                self.filtered(request)
                return []
        payload = self.encode(request) or b""  # b"": deduped only, then crawled by this worker
        domain, limits = self.domain(request)
        score = self.order.score(request)
        # with crawl-wide politeness a domain's requests are ordered by its own schedule, not Scrapy's
        if not self.polite and starts_now(request):
            score = START_NOW
        entries = []
        if self.record_start and request.dont_filter and request.meta.get("is_start_request"):
            # a dedupe-only entry travels with the start request: a page linking back to it is not fetched
            fp = self.df.fingerprint(request)
            r1, r2 = self.df.fingerprint_tokens(fp)
            self.recent.add(r1, now)
            shard = self.router.shard(request, fp)
            entries.append(Outgoing(request, r1, r2, score, b"", shard=shard, record_only=True))
        shard = self.router.shard(request, fp)
        entries.append(Outgoing(request, t1, t2, score, payload, domain=domain, limits=limits, shard=shard))
        return entries

    def delayed(self, request: Request, not_before: float) -> Delay | None:
        if (payload := self.encode(request)) is None:
            return None
        domain, limits = self.domain(request)
        return Delay(self.order.score(request), payload, not_before, domain=domain, limits=limits,
                     shard=self.router.shard(request))

    def domain(self, request: Request) -> tuple[str, str]:
        if not self.polite or self.domain_limits is None:
            return "", ""
        domain = (urlparse_cached(request).hostname or "").lower()
        return domain, self.domain_limits.for_domain(domain).encode()
