"""Crawl-wide request deduplication in Redis.

* :class:`BloomDupeFilter` -- a scalable bloom filter in Redis bitmaps (see :mod:`scrapy_dist.bloom`):
  about 1.92 bytes of Redis memory per URL at a 0.1% false-positive rate, versus ~85 for a fingerprint SET.
* :class:`SetDupeFilter` -- exact: a SET of raw 20-byte fingerprints, for crawls that cannot accept false
  positives.

Both work in two places:

* with :class:`scrapy_dist.scheduler.Scheduler`, which does not call :meth:`request_seen` but sends the
  fingerprint *tokens* of a whole batch of discovered requests to its ``sync`` Lua script, where the
  dedupe and the enqueue happen in one atomic call (the same ``dupe.lua`` code as here);
* as the ``DUPEFILTER_CLASS`` of Scrapy's own scheduler, through the synchronous :meth:`request_seen`:
  one atomic test-and-set per new fingerprint. That is a blocking round trip, so a per-process
  first-level filter answers for fingerprints this process has already seen: a ``pybloom_live``
  ScalableBloomFilter (error rate 1e-7, memory-bounded, ~15 us per check -- far cheaper than the round
  trip it saves, and too slow for the scheduler's batched path, which does not use it).
"""

from __future__ import annotations

import copy
import logging
import warnings
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pybloom_live import ScalableBloomFilter
from redis.exceptions import NoScriptError
from scrapy.exceptions import ScrapyDeprecationWarning

from scrapy_dist import connection, defaults, scripts
from scrapy_dist.bloom import HASHING, BloomParameterError, BloomPlan, fingerprint_hashes, parse_bloom_record
from scrapy_dist.exceptions import FrontierScriptError, ScrapyDistError
from scrapy_dist.keys import CrawlKeys, crawler_keys
from scrapy_dist.ratelimit import RateLimitedLog
from scrapy_dist.settings import DistSettings

if TYPE_CHECKING:
    from scrapy import Request, Spider
    from scrapy.crawler import Crawler
    from scrapy.statscollectors import StatsCollector
    from typing_extensions import Self

logger = logging.getLogger(__name__)
#: duplicate lines go where Scrapy's RFPDupeFilter logs them, so log filters written for Scrapy still apply
dupes_logger = logging.getLogger("scrapy.dupefilters")

#: fingerprints per script call of :meth:`BloomDupeFilter.seen_tokens`: about 2 ms of Redis time each
CALL_TOKENS = 128


@dataclass(eq=False)  # compared and hashed by identity, as before
class RedisDupeFilter:
    """Shared base: fingerprints, logging and stats; subclasses choose how Redis stores them."""

    #: ``mode`` argument of ``dupe.lua``
    mode: ClassVar[str] = "none"
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
    _logged_dupes: bool = field(default=False, init=False, repr=False)

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        if cls.legacy_fingerprint:
            warnings.warn(
                f"Overriding RFPDupeFilter.request_fingerprint() is deprecated (in {cls.__name__}), set the"
                " REQUEST_FINGERPRINTER_CLASS setting instead; scrapy-dist still uses the override meanwhile",
                ScrapyDeprecationWarning, stacklevel=2,
            )
        ds = DistSettings.for_crawler(crawler)
        try:
            return cls(
                connection.get_redis(ds),
                crawler_keys(crawler),
                crawler.request_fingerprinter,
                stats=crawler.stats,
                debug=ds.dupefilter.debug,
                **cls._extra_kwargs(ds),
            )
        except BloomParameterError as exc:  # e.g. BLOOMFILTER_CAPACITY = 10**400: one line, no traceback
            connection.abort_crawl(exc)

    @classmethod
    def _extra_kwargs(cls, ds: DistSettings) -> dict[str, Any]:
        return {}

    # -- Scrapy's BaseDupeFilter interface --------------------------------------------------------
    def open(self) -> None:
        """Called by the scheduler when the spider opens."""

    def close(self, reason: str) -> None:
        """Called by the scheduler when the spider closes; the filter itself stays in Redis."""

    def request_seen(self, request: Request) -> bool:
        """Test-and-set ``request``'s fingerprint (one atomic Redis call when not seen locally)."""
        t1, t2 = self.tokens(request)
        return self.seen_tokens([(t1, t2)])[0]

    def log(self, request: Request, spider: Spider) -> None:
        """Log (all with DUPEFILTER_DEBUG, else only the first) and count a filtered request."""
        if self.debug:
            referer = request.headers.get("Referer")
            dupes_logger.debug(
                "Filtered duplicate request: %(request)s (referer: %(referer)s)",
                {"request": request, "referer": referer.decode(errors="replace") if referer else None},
                extra={"spider": spider},
            )
        elif not self._logged_dupes:
            dupes_logger.debug(
                "Filtered duplicate request: %(request)s - no more duplicates will be shown"
                " (see DUPEFILTER_DEBUG to show all duplicates)",
                {"request": request},
                extra={"spider": spider},
            )
            self._logged_dupes = True
        if self.stats is not None:
            self.stats.inc_value("dupefilter/filtered")

    # -- the batched interface the scheduler uses -------------------------------------------------
    def fingerprint(self, request: Request) -> bytes:
        if self.legacy_fingerprint:
            return bytes.fromhex(self.request_fingerprint(request))
        return bytes(self.fingerprinter.fingerprint(request))

    def request_fingerprint(self, request: Request) -> str:
        """The request's fingerprint as hex. Overriding it is deprecated, as in Scrapy's RFPDupeFilter (set
        ``REQUEST_FINGERPRINTER_CLASS``); an override is used, with a warning when the filter is built."""
        return bytes(self.fingerprinter.fingerprint(request)).hex()


    def tokens(self, request: Request) -> tuple[Any, Any]:
        """The two values ``dupe.lua`` needs for ``request`` (see its header)."""
        return self.fingerprint_tokens(self.fingerprint(request))

    def fingerprint_tokens(self, fingerprint: bytes) -> tuple[Any, Any]:
        """The two values ``dupe.lua`` needs for a request of this fingerprint."""
        raise NotImplementedError

    def script_keys_params(self, pending: int) -> tuple[list[str], list[Any]]:
        """KEYS (starting with the filter's own key) and params for a batch of up to ``pending`` inserts."""
        return [self.keys.fingerprints], []

    def observe(self, bloom_n: int) -> None:
        """Take note of the filter's size as reported by a script call."""

    def seen_tokens(self, tokens: list[tuple[Any, Any]], add: bool = True) -> list[bool]:
        """Test-and-set (or with ``add=False`` only test) a batch of fingerprints in one round trip, each
        fingerprint atomically; True where already seen."""
        raise NotImplementedError

    def stats_snapshot(self) -> dict[str, float]:
        """Filter figures for the crawl's stats (``dupefilter/...``)."""
        return {}

    def for_shard(self, keys: CrawlKeys, shards: int) -> Self:
        """This filter on the keys of one shard of a sharded frontier (``SCHEDULER_SHARDS``): each shard
        deduplicates exactly the requests routed to it (by fingerprint), so it has a filter of its own."""
        clone = copy.copy(self)
        clone.keys = keys
        return clone


class SetDupeFilter(RedisDupeFilter):
    """Exact crawl-wide dupefilter: a Redis SET of raw 20-byte fingerprints (``{spider}:fingerprints``)."""

    mode = "set"

    def fingerprint_tokens(self, fingerprint: bytes) -> tuple[Any, Any]:
        return fingerprint, ""

    def seen_tokens(self, tokens: list[tuple[Any, Any]], add: bool = True) -> list[bool]:
        if not add:
            return [bool(x) for x in self.redis.smismember(self.keys.fingerprints, [t for t, _ in tokens])]
        if len(tokens) == 1:
            return [self.redis.sadd(self.keys.fingerprints, tokens[0][0]) == 0]
        pipe = self.redis.pipeline(transaction=False)
        for t1, _ in tokens:
            pipe.sadd(self.keys.fingerprints, t1)
        return [added == 0 for added in pipe.execute()]


#: scrapy-redis's name for its exact, set-based filter: ``DUPEFILTER_CLASS =
#: "scrapy_dist.dupefilter.RFPDupeFilter"`` (scrapy-redis's setting with the package name swapped) works.
RFPDupeFilter = SetDupeFilter


@dataclass(eq=False)
class BloomDupeFilter(RedisDupeFilter):
    """Crawl-wide scalable bloom filter in Redis bitmaps (see the module docstring).

    Settings: ``BLOOMFILTER_CAPACITY`` (default 100,000,000), ``BLOOMFILTER_ERROR_RATE`` (0.001),
    ``BLOOMFILTER_BLOCK_BITS``. The first worker to open a crawl records capacity and error rate in the
    ``{spider}:bloom`` hash; later workers use the recorded values, so the chain is the same everywhere.
    """

    mode: ClassVar[str] = "bloom"

    # the requested sizes: the crawl's own (recorded by its first worker) may differ, see open()
    capacity: InitVar[int] = defaults.BLOOMFILTER_CAPACITY
    error_rate: InitVar[float] = defaults.BLOOMFILTER_ERROR_RATE
    block_bits: InitVar[int] = defaults.BLOOMFILTER_BLOCK_BITS

    def __post_init__(self, capacity: int, error_rate: float, block_bits: int) -> None:
        self.plan = BloomPlan(capacity, error_rate, block_bits)
        self.n = 0  # items in the filter, as last reported by Redis
        self._capacity_log = RateLimitedLog.once(logger)
        self._local: ScalableBloomFilter | None = None
        self._script: Any = None

    @classmethod
    def _extra_kwargs(cls, ds: DistSettings) -> dict[str, Any]:
        f = ds.dupefilter
        return {"capacity": f.capacity, "error_rate": f.error_rate, "block_bits": f.block_bits}

    def open(self) -> None:
        """Record (or adopt) the crawl's bloom parameters: one pipelined round trip."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hsetnx(self.keys.bloom, "capacity", self.plan.capacity)
        pipe.hsetnx(self.keys.bloom, "error_rate", repr(self.plan.error_rate))
        pipe.hsetnx(self.keys.bloom, "block_bits", self.plan.block_bits)
        pipe.hsetnx(self.keys.bloom, "hashing", HASHING)
        names = ["capacity", "error_rate", "block_bits", "n", "hashing"]
        pipe.hmget(self.keys.bloom, names)
        values = pipe.execute()[-1]
        way_out = "clear it (SCHEDULER_FLUSH_ON_START) or use another REDIS_KEY_PREFIX"
        try:
            rec = parse_bloom_record(
                {k: v for k, v in zip(names, values, strict=True) if v is not None}, self.keys.bloom
            )
        except BloomParameterError as exc:
            raise BloomParameterError(
                f"The bloom filter holds invalid parameters: {exc}; {way_out}"
            ) from None
        if rec.hashing != HASHING:
            raise ScrapyDistError(
                f"The bloom filter {self.keys.bloom!r} was written with bit-position scheme {rec.hashing},"
                f" this scrapy-dist uses {HASHING}: {way_out}"
            )
        self.adopt(rec.capacity, rec.error_rate, rec.block_bits, rec.n)

    def adopt(self, capacity: int, error_rate: float, block_bits: int, n: int) -> None:
        """Use the parameters recorded for the crawl, warning when they differ from this worker's."""
        p = self.plan
        if (capacity, error_rate, block_bits) != (p.capacity, p.error_rate, p.block_bits):
            logger.warning(
                "The bloom filter of this crawl was created with capacity=%d error_rate=%g; using those,"
                " not this worker's BLOOMFILTER_CAPACITY=%d BLOOMFILTER_ERROR_RATE=%g",
                capacity, error_rate, p.capacity, p.error_rate,
            )
            self.plan = BloomPlan(capacity, error_rate, block_bits)
        self.observe(n)

    def fingerprint_tokens(self, fingerprint: bytes) -> tuple[Any, Any]:
        return fingerprint_hashes(fingerprint)

    def for_shard(self, keys: CrawlKeys, shards: int) -> Self:
        """A shard's filter holds about 1/shards of the crawl's URLs: its chain is sized for that."""
        clone = super().for_shard(keys, shards)
        p = self.plan
        clone.plan = BloomPlan(max(1, p.capacity // shards), p.error_rate, p.block_bits)
        clone.n, clone._local, clone._script = 0, None, None
        clone._capacity_log = RateLimitedLog.once(logger)
        return clone

    def script_keys_params(self, pending: int) -> tuple[list[str], list[Any]]:
        """Keys and params for ``pending`` more inserts; :class:`BloomParameterError` (before a key name is
        built) when that would pass the filter's bound (:data:`scrapy_dist.bloom.MAX_OVERSHOOT`)."""
        horizon = self.n + pending
        self.plan.check_items(horizon, self.keys.bloom)
        keys = [self.keys.bloom] + [self.keys.bloom_block(f, b) for f, b in self.plan.block_coords(horizon)]
        return keys, self.plan.script_params(horizon)

    def observe(self, bloom_n: int) -> None:
        self.n = max(self.n, int(bloom_n))
        if self.n > self.plan.capacity:
            self._capacity_log.log(
                logging.WARNING,
                "The bloom filter holds %d fingerprints, past BLOOMFILTER_CAPACITY=%d: it keeps growing"
                " within the error rate, but each further item costs more memory; raise the capacity for"
                " the next crawl",
                self.n, self.plan.capacity,
            )

    def seen_tokens(self, tokens: list[tuple[Any, Any]], add: bool = True) -> list[bool]:
        """Test-and-set (``add``) or only test a batch of fingerprints in one round trip (one per call on
        Redis Cluster): script calls of at most :data:`CALL_TOKENS` fingerprints each, pipelined. Each
        fingerprint's test-and-set is atomic, and the calls run in order, so a fingerprint twice in a
        batch is new only the first time.

        Why not one call for the whole batch: a script holds Redis for its whole run, so a batch of
        thousands would stall every other worker's calls for tens of milliseconds, and a call slower than
        ``slowlog-log-slower-than`` (10 ms by default) is copied into Redis's slow log, arguments and all
        -- up to a few hundred KB of Redis memory that the filter does not need.
        """
        if self._script is None:
            self._script = scripts.register(self.redis, "dupe_batch")
            self.redis.script_load(self._script.script)  # the pipelined calls below are plain EVALSHA
        op = "add" if add else "check"
        chunks = [
            [str(x) for pair in tokens[i : i + CALL_TOKENS] for x in pair]
            for i in range(0, len(tokens), CALL_TOKENS)
        ]
        flags: list[str | None] = [None] * len(chunks)
        for _ in range(64):
            todo = [i for i, f in enumerate(flags) if f is None]
            if not todo:
                return [f == "0" for chunk in flags for f in chunk or ""]
            keys, params = self.script_keys_params(sum(len(chunks[i]) // 2 for i in todo) if add else 0)
            head = [op, self.mode, len(params), *params]
            answers = self._run_calls(keys, [[*head, *chunks[i]] for i in todo])
            for i, answer in zip(todo, answers, strict=True):
                if answer is None:  # Redis had lost the script: loaded again, run again
                    continue
                if answer[0] == -2:  # refused, nothing written (dupe.lua: garbage or past the bound)
                    reason = answer[1].decode() if isinstance(answer[1], bytes) else str(answer[1])
                    raise BloomParameterError(
                        f"{self.keys.bloom} field n: refused by the filter ({reason}): not a count within"
                        f" {self.plan.max_items} ({'the bound' if reason == 'bloom_bound' else 'garbage'})"
                    )
                got, n = answer
                self.observe(int(n))
                if got != -1:  # -1: the chain grew past the keys passed (another worker): again with more
                    flags[i] = got.decode() if isinstance(got, bytes) else got
        raise FrontierScriptError("bloom filter chain did not settle")  # pragma: no cover

    def _run_calls(self, keys: list[str], argvs: list[list[Any]]) -> list[Any]:
        """Answers of one script call per ``argvs`` entry, in order: pipelined (not as a transaction) in
        one round trip, or on Redis Cluster one call after the other. None for a pipelined call Redis
        refused with NOSCRIPT (a restart or SCRIPT FLUSH), once the script is loaded again."""
        if len(argvs) == 1 or connection.is_cluster(self.redis):
            # redis-py reloads the script by itself; its cluster pipelines refuse EVALSHA, so a cluster
            # client makes one round trip per call (all the keys are on one node anyway)
            return [self._script(keys=keys, args=args) for args in argvs]
        pipe = self.redis.pipeline(transaction=False)
        for args in argvs:
            pipe.evalsha(self._script.sha, len(keys), *keys, *args)
        answers = pipe.execute(raise_on_error=False)
        for answer in answers:
            if isinstance(answer, Exception) and not isinstance(answer, NoScriptError):
                raise answer
        if any(isinstance(a, NoScriptError) for a in answers):
            self.redis.script_load(self._script.script)
        return [None if isinstance(a, NoScriptError) else a for a in answers]

    def request_seen(self, request: Request) -> bool:
        """Scrapy-scheduler path: local first-level filter, then one atomic Redis test-and-set."""
        fp = self.fingerprint(request)
        if self._local is None:
            self._local = ScalableBloomFilter(
                initial_capacity=100_000, error_rate=1e-7, mode=ScalableBloomFilter.LARGE_SET_GROWTH
            )
        if fp in self._local:
            return True
        seen = self.seen_tokens([fingerprint_hashes(fp)])[0]
        self._local.add(fp)
        return seen

    def stats_snapshot(self) -> dict[str, float]:
        return {
            "dupefilter/bloom/items": self.n,
            "dupefilter/bloom/fill_ratio": round(self.n / self.plan.capacity, 6),
            "dupefilter/bloom/fpr_estimate": self.plan.false_positive_rate(self.n),
        }

    def close(self, reason: str) -> None:
        if self.stats is not None:
            for k, v in self.stats_snapshot().items():
                self.stats.set_value(k, v)
