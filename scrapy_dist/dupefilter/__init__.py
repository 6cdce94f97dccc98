"""Crawl-wide request deduplication in Redis: :class:`BloomDupeFilter` (a scalable bloom filter, sized by
:mod:`.bloom`) and :class:`SetDupeFilter` (exact: a SET of fingerprints), both run by :class:`DupeScript`.

May import: ``settings``, ``redis``, ``wire``, ``utils`` and the root's exceptions."""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
import warnings
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pybloom_live import ScalableBloomFilter
from redis.exceptions import NoScriptError
from scrapy.dupefilters import BaseDupeFilter
from scrapy.exceptions import ScrapyDeprecationWarning
from scrapy.utils.request import referer_str

from scrapy_dist.dupefilter import bloom
from scrapy_dist.dupefilter.bloom import RECENT_MAX_AGE, BloomParameterError, BloomPlan, RecentFingerprints
from scrapy_dist.exceptions import FrontierScriptError, FrontierStateError, ScrapyDistError
from scrapy_dist.redis import connection, scripts
from scrapy_dist.redis.keys import CrawlKeys, crawler_keys
from scrapy_dist.redis.scripts import text
from scrapy_dist.settings import DistSettings, defaults
from scrapy_dist.settings.reader import refuse_start, start_error
from scrapy_dist.utils import RateLimitedLog, inc_stat

if TYPE_CHECKING:
    from scrapy import Request, Spider
    from scrapy.crawler import Crawler
    from scrapy.statscollectors import StatsCollector
    from typing_extensions import Self

__all__ = ["CALL_TOKENS", "RECENT_MAX_AGE", "BloomDupeFilter", "DupeScript", "RFPDupeFilter",
           "RecentFingerprints", "RedisDupeFilter", "SetDupeFilter"]

logger = logging.getLogger(__name__)
#: duplicate lines go where Scrapy's RFPDupeFilter logs them, so log filters written for Scrapy still apply
dupes_logger = logging.getLogger("scrapy.dupefilters")

CALL_TOKENS = 48  #: fingerprints per script call (others' commands run between; a batch's are pipelined)


def refusal(reason: Any, detail: Any) -> ScrapyDistError:
    """The error for a script's ``{-2, reason, detail}`` answer (nothing was written), in one line."""
    reason, detail = text(reason), text(detail)
    if reason == "bloom_clock":
        return ScrapyDistError(
            f"{detail}: this machine's clock is more than DUPEFILTER_TTL/(BLOOMFILTER_GENERATIONS-1)"
            " seconds off the Redis server's; set it right (NTP)")
    if reason.startswith("bloom"):
        return BloomParameterError(
            f"{detail} field n: refused by the filter ({reason}): not a count within the filter's bound"
            f" ({'the bound' if reason == 'bloom_bound' else 'garbage'})")
    return FrontierStateError(reason, detail)


class DupeScript:
    """``dupe_batch.lua`` (test-and-set, test or forget a batch of fingerprints) on one client."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self._repaired = RateLimitedLog(logger)
        self.script = scripts.register(redis, "dupe_batch")
        redis.script_load(self.script.script)  # the pipelined calls below are plain EVALSHA

    def run(self, df: Any, op: str, tokens: list[tuple[Any, Any]], now: float | None = None) -> list[bool]:
        """``op`` ("add", "check" or "forget") over ``tokens`` for ``df``; True where already seen. Calls of
        :data:`CALL_TOKENS` at most, pipelined, run in order: a fingerprint twice is new the first time."""
        chunks = [[x if isinstance(x, bytes) else str(x) for kv in tokens[i : i + CALL_TOKENS] for x in kv]
                  for i in range(0, len(tokens), CALL_TOKENS)]
        flags: list[str | None] = [None] * len(chunks)
        for _ in range(64):
            if not (todo := [i for i, f in enumerate(flags) if f is None]):
                return [f == "0" for chunk in flags for f in chunk or ""]
            pending = sum(len(chunks[i]) // 2 for i in todo) if op == "add" else 0
            mode, keys, params = df.script_args(pending, now)
            head = [op, mode, "" if now is None else repr(now), len(params), *params]
            answers = self.calls(keys, [[*head, *chunks[i]] for i in todo])
            for i, answer in zip(todo, answers, strict=True):
                if answer is None:  # Redis had lost the script: loaded again, run again
                    continue
                if answer[0] == -2:  # refused, nothing written
                    raise refusal(answer[1], answer[2])
                for raw in answer[2] if len(answer) > 2 and isinstance(answer[2], list) else ():
                    self._repaired.log(logging.WARNING, "Repaired garbage in %s (written by someone else?)"
                                       " before writing", text(raw), key=text(raw))
                df.observe(int(answer[1]))
                if answer[0] != -1:  # -1: the chain grew past the keys passed (another worker): again, more
                    flags[i] = text(answer[0])
        raise FrontierScriptError("bloom filter chain did not settle")  # pragma: no cover

    def calls(self, keys: list[str], argvs: list[list[Any]]) -> list[Any]:
        """One script call per ``argvs`` entry, pipelined (one after the other on Redis Cluster, whose
        pipelines refuse EVALSHA); None for a call refused with NOSCRIPT, once the script is loaded again."""
        if len(argvs) == 1 or connection.is_cluster(self.redis):
            return [self.script(keys=keys, args=args) for args in argvs]
        pipe = self.redis.pipeline(transaction=False)
        for args in argvs:
            pipe.evalsha(self.script.sha, len(keys), *keys, *args)
        answers = pipe.execute(raise_on_error=False)
        for answer in answers:
            if isinstance(answer, Exception) and not isinstance(answer, NoScriptError):
                raise answer
        if any(isinstance(a, NoScriptError) for a in answers):
            self.redis.script_load(self.script.script)
        return [None if isinstance(a, NoScriptError) else a for a in answers]


@dataclass(eq=False)  # compared and hashed by identity
class RedisDupeFilter(BaseDupeFilter):
    """Shared base: fingerprints, logging and stats; subclasses choose how Redis stores them."""

    mode: ClassVar[str] = "none"  #: ``mode`` argument of ``dupe.lua``
    #: the class overrides ``request_fingerprint()`` (decided once per class, not per request)
    legacy_fingerprint: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.legacy_fingerprint = cls.request_fingerprint is not RedisDupeFilter.request_fingerprint

    redis: Any
    keys: CrawlKeys
    fingerprinter: Any
    stats: StatsCollector | None = None
    debug: bool = False
    ttl: float | None = None  #: DUPEFILTER_TTL: seconds a fingerprint is remembered (None: forever)
    _logged_dupes: bool = field(default=False, init=False, repr=False)
    _script: Any = field(default=None, init=False, repr=False)

    settings_fields: ClassVar[tuple[str, ...]] = ("debug", "ttl")  #: fields of ``DistSettings.dupefilter``

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        if cls.legacy_fingerprint:
            warnings.warn(f"Overriding RFPDupeFilter.request_fingerprint() is deprecated (in {cls.__name__}),"
                          " set the REQUEST_FINGERPRINTER_CLASS setting instead; scrapy-dist still uses the"
                          " override meanwhile", ScrapyDeprecationWarning, stacklevel=2)
        # a refused setting refuses the crawl's start: the scheduler gets a filter that is never used
        if start_error(crawler) is None:
            try:
                f = DistSettings.for_crawler(crawler).dupefilter
                return cls(connection.ClientPool.of(crawler).sync_client(), crawler_keys(crawler),
                           crawler.request_fingerprinter, stats=crawler.stats,
                           **{k: getattr(f, k) for k in cls.settings_fields})
            except ScrapyDistError as exc:
                refuse_start(crawler, exc)
        return BaseDupeFilter()  # type: ignore[return-value]

    def request_seen(self, request: Request) -> bool:
        """Test-and-set ``request``'s fingerprint (one atomic Redis call)."""
        return self.seen_tokens([self.tokens(request)])[0]

    def log(self, request: Request, spider: Spider) -> None:
        """Log (all with DUPEFILTER_DEBUG, else only the first) and count a filtered request."""
        if self.debug:
            dupes_logger.debug("Filtered duplicate request: %(request)s (referer: %(referer)s)",
                               {"request": request, "referer": referer_str(request)},
                               extra={"spider": spider})
        elif not self._logged_dupes:
            dupes_logger.debug("Filtered duplicate request: %(request)s - no more duplicates will be shown"
                               " (see DUPEFILTER_DEBUG to show all duplicates)", {"request": request},
                               extra={"spider": spider})
            self._logged_dupes = True
        inc_stat(self.stats, "dupefilter/filtered")

    def fingerprint(self, request: Request) -> bytes:
        return (bytes.fromhex(self.request_fingerprint(request)) if self.legacy_fingerprint
                else bytes(self.fingerprinter.fingerprint(request)))

    def request_fingerprint(self, request: Request) -> str:
        """The request's fingerprint as hex. Overriding it is deprecated, as in Scrapy's RFPDupeFilter."""
        return bytes(self.fingerprinter.fingerprint(request)).hex()

    def tokens(self, request: Request) -> tuple[Any, Any]:
        return self.fingerprint_tokens(self.fingerprint(request))

    def fingerprint_tokens(self, fingerprint: bytes) -> tuple[Any, Any]:
        """The two values ``dupe.lua`` needs for a request of this fingerprint (see its header)."""
        raise NotImplementedError

    def script_args(self, pending: int, now: float | None = None) -> tuple[str, list[str], list[Any]]:
        """``dupe.lua``'s mode, KEYS and params for a call at ``now`` inserting up to ``pending``."""
        return self.mode, [self.keys.forgotten, self.keys.fingerprints], []

    def recent_max_age(self) -> float:
        """Seconds a worker may skip a fingerprint it sent itself; none with an exact TTL."""
        return RECENT_MAX_AGE if self.ttl is None else 0.0

    def observe(self, bloom_n: int) -> None:
        """Take note of the filter's size as reported by a script call."""

    def seen_tokens(self, tokens: list[tuple[Any, Any]], add: bool = True) -> list[bool]:
        """Test-and-set (``add=False``: only test) fingerprints in one round trip; True where seen."""
        return self.run_batch("add" if add else "check", tokens)

    def run_batch(self, op: str, tokens: list[tuple[Any, Any]], now: float | None = None) -> list[bool]:
        """:meth:`DupeScript.run` of ``op`` ("add", "check" or "forget") over ``tokens``."""
        if self._script is None:
            self._script = DupeScript(self.redis)
        return self._script.run(self, op, tokens, now)

    def key_names(self) -> list[str]:
        """Every key of this filter beyond ``redis.keys.FRONTIER_KEY_NAMES`` (bloom blocks, generations)."""
        return []

    def stats_snapshot(self) -> dict[str, float]:
        """Filter figures for the crawl's stats (``dupefilter/...``)."""
        return {}

    def for_shard(self, keys: CrawlKeys, shards: int) -> Self:
        """This filter on the keys of one shard (``SCHEDULER_SHARDS``): each deduplicates its own requests."""
        clone = copy.copy(self)
        clone.keys = keys
        return clone


class SetDupeFilter(RedisDupeFilter):
    """Exact crawl-wide dupefilter: a Redis SET of raw 20-byte fingerprints (``{spider}:fingerprints``).
    With ``DUPEFILTER_TTL``, a ZSET fingerprint -> expiry time (``{spider}:fingerprints:ttl``): exactly TTL
    seconds after it was seen, a URL is new again; expired entries are removed a bounded number per call."""

    mode = "set"

    def fingerprint_tokens(self, fingerprint: bytes) -> tuple[Any, Any]:
        return fingerprint, ""

    def script_args(self, pending: int, now: float | None = None) -> tuple[str, list[str], list[Any]]:
        if self.ttl is None:
            return super().script_args(pending, now)
        return "setttl", [self.keys.forgotten, self.keys.fingerprints_ttl], [repr(float(self.ttl))]

    def seen_tokens(self, tokens: list[tuple[Any, Any]], add: bool = True) -> list[bool]:
        if self.ttl is not None:
            return super().seen_tokens(tokens, add)
        if not add:
            return [bool(x) for x in self.redis.smismember(self.keys.fingerprints, [t for t, _ in tokens])]
        pipe = self.redis.pipeline(transaction=False)
        for t1, _ in tokens:
            pipe.sadd(self.keys.fingerprints, t1)
        return [added == 0 for added in pipe.execute()]


RFPDupeFilter = SetDupeFilter  #: scrapy-redis's name for its exact, set-based filter


@dataclass(eq=False)
class BloomDupeFilter(RedisDupeFilter):
    """Crawl-wide scalable bloom filter in Redis bitmaps (``BLOOMFILTER_*`` settings, ``DUPEFILTER_TTL``).
    The first worker to open a crawl records its parameters in ``{spider}:bloom``; later workers use them."""

    mode: ClassVar[str] = "bloom"
    settings_fields = ("debug", "ttl", "capacity", "error_rate", "block_bits", "generations")

    # the requested sizes: the crawl's own (recorded by its first worker) may differ, see open()
    capacity: InitVar[int] = defaults.BLOOMFILTER_CAPACITY
    error_rate: InitVar[float] = defaults.BLOOMFILTER_ERROR_RATE
    block_bits: InitVar[int] = defaults.BLOOMFILTER_BLOCK_BITS
    generations: InitVar[int] = 4

    def __post_init__(self, capacity: int, error_rate: float, block_bits: int, generations: int) -> None:
        self.gens = None if self.ttl is None else bloom.Generations(self.ttl, generations)
        self._size(BloomPlan(capacity, error_rate, block_bits))

    def _size(self, base: BloomPlan) -> None:
        """Size the filter for ``base`` (with a TTL: one generation's chain), counting from 0."""
        self.base = base
        self.plan = base if self.gens is None else self.gens.plan(base.capacity, base.error_rate,
                                                                  base.block_bits, base.scheme)
        self.n = 0  # items in the filter (its fullest live generation), as last reported by Redis
        self._capacity_log = RateLimitedLog.once(logger)
        self._local: ScalableBloomFilter | None = None

    def open(self) -> None:
        """Record (or adopt) the crawl's bloom parameters: one pipelined round trip."""
        pipe = self.redis.pipeline(transaction=False)
        b = self.base
        mine: dict[str, Any] = {"capacity": b.capacity, "error_rate": repr(b.error_rate),
                                "hashing": bloom.HASHING, "block_bits": b.block_bits,
                                "ttl": repr(float(self.ttl or 0)),
                                "generations": self.gens.count if self.gens else 4}
        for name, value in mine.items():
            pipe.hsetnx(self.keys.bloom, name, value)
        names = [*mine, "n"]
        values = pipe.hmget(self.keys.bloom, names).execute()[-1]
        fix = "clear it (SCHEDULER_FLUSH_ON_START) or use another REDIS_KEY_PREFIX"
        try:
            rec = bloom.parse_bloom_record(
                {k: v for k, v in zip(names, values, strict=True) if v is not None}, self.keys.bloom)
        except BloomParameterError as exc:
            raise BloomParameterError(f"The bloom filter holds invalid parameters: {exc}; {fix}") from None
        if rec.n_garbage is not None:
            logger.warning("%s field n=%s is not an item count of this filter (written by someone else?): the"
                           " frontier recounts it at its next write", self.keys.bloom, rec.n_garbage)
        if rec.schedule_garbage is not None:  # record this worker's schedule over one no worker wrote
            self.redis.hset(self.keys.bloom, mapping={"ttl": mine["ttl"], "generations": mine["generations"]})
            logger.warning("%s field %s is not a schedule any worker could have recorded (written by someone"
                           " else?): replaced by this worker's DUPEFILTER_TTL=%s BLOOMFILTER_GENERATIONS=%s",
                           self.keys.bloom, rec.schedule_garbage, self.ttl, mine["generations"])
            rec = dataclasses.replace(rec, ttl=float(self.ttl or 0), generations=int(mine["generations"]),
                                      schedule_garbage=None)
        if rec.hashing not in bloom.SCHEMES:
            raise ScrapyDistError(f"The bloom filter {self.keys.bloom!r} was written with layout"
                                  f" {rec.hashing}, this scrapy-dist reads {bloom.SCHEMES}: {fix}")
        self.adopt(rec)

    def adopt(self, rec: bloom.BloomRecord) -> None:
        """Use the parameters recorded for the crawl, warning when they differ from this worker's."""
        b = self.base
        ttl = rec.ttl or None
        mine = (b.capacity, b.error_rate, b.block_bits, self.ttl, self.gens.count if self.gens else None)
        theirs = (rec.capacity, rec.error_rate, rec.block_bits, ttl, rec.generations if ttl else None)
        if mine != theirs or rec.hashing != b.scheme:
            if mine != theirs:
                logger.warning(
                    "The bloom filter of this crawl was created with capacity=%d error_rate=%g ttl=%s"
                    " generations=%s; using those, not this worker's BLOOMFILTER_CAPACITY=%d"
                    " BLOOMFILTER_ERROR_RATE=%g DUPEFILTER_TTL=%s BLOOMFILTER_GENERATIONS=%s", rec.capacity,
                    rec.error_rate, ttl, theirs[4], b.capacity, b.error_rate, self.ttl, mine[4])
            # a crawl keeps the layout it was created with
            self.ttl = ttl
            self.gens = None if ttl is None else bloom.Generations(ttl, rec.generations)
            self._size(BloomPlan(rec.capacity, rec.error_rate, rec.block_bits, scheme=rec.hashing))
        self.observe(0 if self.gens else rec.n)

    def recent_max_age(self) -> float:
        # with a TTL: a quarter of a generation's span at most, well within the generations' imprecision
        return RECENT_MAX_AGE if self.gens is None else min(RECENT_MAX_AGE, self.gens.span / 4)

    def fingerprint_tokens(self, fingerprint: bytes) -> tuple[Any, Any]:
        return bloom.fingerprint_hashes(fingerprint)

    def for_shard(self, keys: CrawlKeys, shards: int) -> Self:
        """A shard's filter holds about 1/shards of the crawl's URLs: its chain is sized for that."""
        clone = super().for_shard(keys, shards)
        b = self.base
        clone._size(BloomPlan(max(1, b.capacity // shards), b.error_rate, b.block_bits, scheme=b.scheme))
        clone._script = None
        return clone

    def script_args(self, pending: int, now: float | None = None) -> tuple[str, list[str], list[Any]]:
        """Keys and params for ``pending`` more inserts, up to the filter's bound (``bloom.MAX_OVERSHOOT``);
        :class:`BloomParameterError` (before a key name is built) when this worker's count is past it."""
        self.plan.check_items(self.n, self.keys.bloom)
        horizon = min(self.n + pending, self.plan.max_items)
        now = time.time() if now is None else now
        keys = [self.keys.forgotten, self.keys.bloom, *self._chain_keys(horizon, now)]
        params = self.plan.script_params(horizon)
        if self.gens is None:
            return "bloom", keys, params
        gens = self.gens.passed(now)
        return "bloomgen", keys, [repr(self.gens.span), self.gens.count, gens.start, len(gens), *params]

    def _chain_keys(self, horizon: int, now: float) -> list[str]:
        """The chain's keys up to ``horizon`` items (with a TTL: per generation, HASH then blocks)."""
        coords = self.plan.block_coords(horizon)
        if self.gens is None:
            return [self.keys.bloom_block(f, b) for f, b in coords]
        out = []
        for e in self.gens.passed(now):
            out.append(self.keys.bloom_generation(e))
            out += [self.keys.bloom_generation(e, f, b) for f, b in coords]
        return out

    def key_names(self) -> list[str]:
        return self._chain_keys(max(self.n, self.plan.capacity), time.time())

    def observe(self, bloom_n: int) -> None:
        self.n = max(self.n, int(bloom_n))
        if self.n > self.plan.capacity:
            self._capacity_log.log(
                logging.WARNING,
                "The bloom filter holds %d fingerprints%s, past its capacity %d (BLOOMFILTER_CAPACITY%s): it"
                " keeps growing within the error rate, but each further item costs more memory; raise the"
                " capacity for the next crawl", self.n, " in one generation" if self.gens else "",
                self.plan.capacity, "/(BLOOMFILTER_GENERATIONS-1)" if self.gens else "")

    def request_seen(self, request: Request) -> bool:
        """A per-process filter (not with a TTL: it never forgets), then one atomic test-and-set."""
        fp = self.fingerprint(request)
        if self.gens is not None:
            return self.seen_tokens([bloom.fingerprint_hashes(fp)])[0]
        if self._local is None:
            self._local = ScalableBloomFilter(initial_capacity=100_000, error_rate=1e-7,
                                              mode=ScalableBloomFilter.LARGE_SET_GROWTH)
        if fp in self._local:
            return True
        seen = self.seen_tokens([bloom.fingerprint_hashes(fp)])[0]
        self._local.add(fp)
        return seen

    def stats_snapshot(self) -> dict[str, float]:
        fpr = self.plan.false_positive_rate(self.n) * (self.gens.count if self.gens else 1)
        fill = round(self.n / self.plan.capacity, 6)
        return {"dupefilter/bloom/items": self.n, "dupefilter/bloom/fill_ratio": fill,
                "dupefilter/bloom/fpr_estimate": fpr}

    def close(self, reason: str) -> None:
        if self.stats is not None:
            for k, v in self.stats_snapshot().items():
                self.stats.set_value(k, v)
