"""Items out of the cluster: a Redis item pipeline, LIST (scrapy-redis compatible) or STREAM.

Every worker appends its items to one Redis key (``REDIS_ITEMS_KEY``, default ``"%(spider)s:items"``) where
downstream consumers pick them up. With the scrapy-dist scheduler (and ``REDIS_ITEMS_EXACTLY_ONCE``, the
default), a page's items ride the ``sync`` call that acknowledges the page and are appended only if that
ack is accepted (:mod:`scrapy_dist.frontier.engine`): exactly once per acknowledged fetch, whatever happens
to the workers. Otherwise items are buffered and written in batches of their own, and an item is reported
scraped only once its batch is in Redis: at least once (a page crawled again writes its items again).

``ITEM_PIPELINES = {"scrapy_dist.pipelines.RedisPipeline": 300}``.
May import: ``settings``, ``redis``, ``wire``, ``frontier``, ``utils`` and the root's exceptions.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from itemadapter import ItemAdapter, is_item
from scrapy.exceptions import DropItem
from scrapy.utils.misc import load_object
from scrapy.utils.serialize import ScrapyJSONEncoder

from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.frontier import engine as _outbox
from scrapy_dist.frontier.scheduler import get_scheduler
from scrapy_dist.frontier.shard import ItemRoute
from scrapy_dist.redis import scripts
from scrapy_dist.redis.connection import ClientPool, is_cluster
from scrapy_dist.redis.keys import crawler_keys
from scrapy_dist.redis.outage import Backoff, BatchWriter, Outage
from scrapy_dist.settings import DistSettings, defaults
from scrapy_dist.settings.reader import refuse_start, refusing

if TYPE_CHECKING:
    import redis.asyncio
    from scrapy.crawler import Crawler
    from scrapy.statscollectors import StatsCollector

    # typing.Self requires Python 3.11
    from typing_extensions import Self

__all__ = ["RedisPipeline"]

logger = logging.getLogger(__name__)

#: Field of each stream entry that holds the JSON item (``XADD <key> * item <json>``).
STREAM_FIELD = "item"

# A flush writes at most this many batches in one round trip, so a backlog built up during a Redis
# outage drains in bounded transactions instead of one huge one.
_MAX_BATCHES_PER_FLUSH = 16
# Backoff between attempts to write a batch while Redis fails (seconds); capped so recovery is noticed fast.
_RETRY_FIRST = 0.1
_RETRY_MAX = 5.0
# Items encoded by process_item kept for their item_scraped signal; past this, the oldest are re-encoded then.
_MAX_PENDING = 10_000
# What an encoder raises on a value it cannot represent.
_ENCODE_ERRORS = (TypeError, ValueError, OverflowError, RecursionError, UnicodeError)

_default_encoder = ScrapyJSONEncoder()

#: scrapy-redis RedisPipeline methods a subclass may override which scrapy-dist's never calls, and what to
#: do instead (one WARNING per overridden method when the pipeline is built).
SCRAPY_REDIS_PIPELINE_HOOKS: dict[str, str] = {
    "_process_item": "items are written in batches by process_item(); route them with item_key(item,"
                     " spider), change them in `async def process_item(self, item)` before `return await"
                     " super().process_item(item)`, or write them with a client of your own"
                     " (scrapy_dist.connection.get_redis(settings))",
    "from_settings": "the pipeline is built by from_crawler(crawler); override that instead",
}


def default_serialize(item: Any) -> str:
    """JSON with Scrapy's encoder (items, dates, decimals, sets), as scrapy-redis does."""
    return _default_encoder.encode(item)


def find_unencodable(value: Any, serialize: Callable[[Any], Any], path: str = "") -> tuple[str, Exception]:
    """Return ``(path, error)`` for the innermost part of ``value`` that ``serialize`` rejects.

    ``path`` is dotted for mapping keys and fields (``price.amount``) and indexed for sequences
    (``tags[2]``); ``""`` means ``value`` itself. Called only after ``serialize(value)`` failed, so its
    cost (one encode per field, recursively along the failing branch) is paid for broken items only.
    """
    try:
        serialize(value)
    except _ENCODE_ERRORS as exc:
        error: Exception = exc
    else:  # pragma: no cover - the caller saw it fail; a non-deterministic encoder is all that is left
        return path, ValueError("encodes on its own")
    children: list[tuple[str, Any]] = []
    if is_item(value) or isinstance(value, Mapping):
        try:
            pairs = list(ItemAdapter(value).items() if is_item(value) else value.items())
        except Exception:  # a mapping that cannot even be iterated is itself the offender
            pairs = []
        children = [(f"{path}.{k}" if path else str(k), v) for k, v in pairs]
    elif isinstance(value, (list, tuple, set, frozenset)):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    for child_path, child in children:
        try:
            serialize(child)
        except _ENCODE_ERRORS:
            return find_unencodable(child, serialize, child_path)
    # Every part encodes on its own: the value itself is the problem (e.g. a non-string mapping key).
    return path, error


class RedisPipeline:
    """Append every item, JSON-encoded, to a Redis LIST (``RPUSH``) or STREAM (``XADD``).

    With the scrapy-dist scheduler (:attr:`outbox` set at open), ``process_item`` encodes the item and the
    ``item_scraped`` signal stages it under its response's request; it rides that request's ack and is
    appended only if the ack is accepted (exactly once). Otherwise ``process_item`` returns once the item
    is in Redis, written in batches: a batch is written when it holds ``batch_size``
    items or ``flush_interval`` seconds after its first item, whichever comes first (taking along what
    else is buffered by then, up to 16 batches); the rest is written on close. A write is one round trip:
    one ``RPUSH`` with all its items, or one call of the ``items_xadd`` script running their ``XADD``
    commands inside Redis -- never one per item (:class:`~scrapy_dist.redis.outage.BatchWriter`).
    Redis errors are retried with capped backoff, forever (:mod:`scrapy_dist.redis.outage`: an outage is one
    warning per worker): nothing buffered is dropped, and the items' requests stay unacknowledged meanwhile.

    An item the serializer cannot encode is dropped (``DropItem``, logged at ERROR with the offending
    field) and counted in ``redis_items/unserializable``; the crawl goes on.

    Stats: ``redis_items/written``, ``redis_items/batches``, ``redis_items/unserializable``,
    ``redis_items/redis_errors``.
    """

    def __init__(
        self,
        server: redis.asyncio.Redis,
        key: str,
        *,
        stream: bool = defaults.REDIS_ITEMS_STREAM,
        maxlen: int | None = defaults.REDIS_ITEMS_MAXLEN,
        batch_size: int = defaults.REDIS_ITEMS_BATCH_SIZE,
        flush_interval: float = defaults.REDIS_ITEMS_FLUSH_INTERVAL,
        serialize: Callable[[Any], str | bytes] = default_serialize,
        stats: StatsCollector | None = None,
        outage: Outage | None = None,
        exactly_once: bool = True,
        max_bytes: int = 8 * 1024 * 1024,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"REDIS_ITEMS_BATCH_SIZE must be at least 1, got {batch_size}")
        self.server = server
        self.key = key
        self.stream = stream
        self.maxlen = maxlen
        self.batch_size = batch_size
        self.flush_interval = flush_interval
        self.serialize = serialize
        self.stats = stats
        self.outage = outage or Outage()
        self.writer: BatchWriter[tuple[str, str | bytes]] = BatchWriter(
            self._write,
            guard=self.outage.guard("item pipeline", Backoff(_RETRY_FIRST, _RETRY_MAX), logger),
            batch_size=batch_size,
            flush_interval=flush_interval,
            max_batches=_MAX_BATCHES_PER_FLUSH,
            on_failure=lambda exc: self._inc("redis_items/redis_errors"),
        )
        self._xadd: Any = None  # the items_xadd script, registered on first use
        #: scrapy-redis's ``item_key(self, item, spider)`` overrides get the spider (see :meth:`item_key`)
        self._key_wants_spider = _wants_spider(self.item_key)
        self._crawler: Crawler | None = None
        self.exactly_once = exactly_once
        self.max_bytes = max_bytes
        #: items staged by the page they came from, riding its ack (None: written in batches of their own)
        self.outbox: _outbox.ItemOutbox | None = None
        #: id(item) -> (item, encoded) between process_item and the item_scraped signal
        self._pending: dict[int, tuple[Any, str | bytes]] = {}

    @classmethod
    @refusing
    def from_crawler(cls, crawler: Crawler) -> Self:
        """Build from ``REDIS_ITEMS_*`` settings and the connection settings (``REDIS_URL``, ...)."""
        ds = DistSettings.for_crawler(crawler)
        items = ds.items
        key = crawler_keys(crawler).items
        options: dict[str, Any] = {
            "stream": items.stream,
            "maxlen": items.maxlen,
            "batch_size": items.batch_size,
            "flush_interval": items.flush_interval,
            "serialize": load_object(items.serializer) if items.serializer else default_serialize,
            "stats": crawler.stats,
            "outage": Outage.for_crawler(crawler),
        }
        _check_subclass(cls, key, options)
        pipe = cls(ClientPool.of(crawler).async_client(), key, **options)
        pipe._crawler = crawler
        pipe.exactly_once = items.exactly_once
        pipe.max_bytes = items.max_bytes
        from scrapy import signals

        crawler.signals.connect(pipe.item_scraped, signal=signals.item_scraped)
        crawler.signals.connect(pipe.item_left, signal=signals.item_dropped)
        crawler.signals.connect(pipe.item_left, signal=signals.item_error)
        return pipe

    # -- Scrapy hooks ---------------------------------------------------------------------------
    async def open_spider(self) -> None:
        """Check the items key holds the expected type (1 round trip) and start the writer task."""
        expected = "stream" if self.stream else "list"
        try:
            found = await self.server.type(self.key)
        except Exception as exc:
            # Not fatal: the writer waits for Redis like it does for any outage.
            self.writer.guard.failed(exc, time.monotonic())
        else:
            found = found.decode() if isinstance(found, bytes) else found
            if found not in ("none", expected):
                error = ScrapyDistError(
                    f"REDIS_ITEMS_KEY {self.key!r} holds a Redis {found}, but the pipeline writes a "
                    f"{expected} (REDIS_ITEMS_STREAM={self.stream}); delete the key or change the setting"
                )
                if self._crawler is None:
                    raise error
                refuse_start(self._crawler, error)
                return
        self.outbox = self._ride_acks()
        self.writer.start()

    def _ride_acks(self) -> _outbox.ItemOutbox | None:
        """The outbox of the running scrapy-dist scheduler, when items can ride its acks: exactly once is
        on, ``item_key`` is not overridden (one key per call) and, on a Redis Cluster, the items key shares
        the frontier's hash slot."""
        sched = get_scheduler(self._crawler) if self._crawler is not None else None
        if not self.exactly_once or sched is None:
            return None
        if type(self).item_key is not RedisPipeline.item_key:
            logger.warning("%s overrides item_key(): items are written at least once, in batches of"
                           " their own", type(self).__name__)
            return None
        found = _outbox.attach(sched, ItemRoute(self.key, "stream" if self.stream else "list", self.maxlen))
        if found is None:
            logger.warning("REDIS_ITEMS_EXACTLY_ONCE: on a Redis Cluster the items key %s is in another hash"
                           " slot than the frontier's keys: items are written at least once, in batches of"
                           " their own. For exactly once, give it the crawl's hash tag"
                           " (REDIS_ITEMS_KEY = \"{%%(spider)s}:items\") and keep SCHEDULER_SHARDS = 1",
                           self.key)
        return found

    async def process_item(self, item: Any, spider: Any = None) -> Any:
        """Buffer ``item`` and return it once the batch holding it is written to Redis.

        ``spider`` is accepted (and unused) for scrapy-redis subclasses calling ``super().process_item(item,
        spider)``; Scrapy passes only the item."""
        try:
            data = self.serialize(item)
        except _ENCODE_ERRORS as exc:
            self._inc("redis_items/unserializable")
            path, error = find_unencodable(item, self.serialize)
            where = f"field {path!r}" if path else "the item itself"
            raise DropItem(
                f"RedisPipeline cannot encode {where}: {error.__class__.__name__}: {error}",
                log_level="ERROR",
            ) from exc
        if len(data) > self.max_bytes:
            self._inc("redis_items/too_large")
            raise DropItem(
                f"RedisPipeline: the item encodes to {len(data)} bytes, more than REDIS_ITEMS_MAX_BYTES"
                f" ({self.max_bytes})", log_level="ERROR",
            )
        if self.writer.closing:
            raise RuntimeError("RedisPipeline.process_item() called after close_spider()")
        if self.outbox is not None:
            # staged by its page when the item_scraped signal names the response (item_scraped)
            if len(self._pending) >= _MAX_PENDING:
                self._pending.clear()
            self._pending[id(item)] = (item, data)
            return item
        if self._key_wants_spider:
            key = self.item_key(item, getattr(self._crawler, "spider", None))  # type: ignore[call-arg]
        else:
            key = self.item_key(item)
        await asyncio.shield(self.writer.add((key, data)))
        return item

    def item_scraped(self, item: Any, response: Any = None, spider: Any = None) -> None:
        """Signal handler: stage the item under the request of its response, to ride that request's ack
        (the engine finishes a request only after this). An item of no leased request (``start()``, a
        request crawled by this worker only) is written on its own, at least once."""
        if self.outbox is None:
            return
        entry = self._pending.pop(id(item), None)
        if entry is not None and entry[0] is item:
            data = entry[1]
        else:  # a later pipeline returned another object: write what came out of the chain
            try:
                data = self.serialize(item)
            except _ENCODE_ERRORS as exc:
                self._inc("redis_items/unserializable")
                logger.error("RedisPipeline cannot encode an item a later pipeline returned: %s", exc)
                return
        request = getattr(response, "request", None)
        if request is None or not self.outbox.stage(request, data):
            self._inc("redis_items/unbound")
            self.writer.add((self.key, data))

    def item_left(self, item: Any, **kwargs: Any) -> None:
        """Signal handler (item dropped, or a pipeline raised): forget what process_item encoded."""
        self._pending.pop(id(item), None)

    async def close_spider(self) -> None:
        """Write everything still buffered (waiting for Redis if it is down), then close the client."""
        await self.writer.close()
        await self.server.aclose()

    # -- extension points -----------------------------------------------------------------------
    def item_key(self, item: Any) -> str:
        """Redis key for ``item`` (override to route items to several keys, as in scrapy-redis).

        An override with scrapy-redis's signature, ``item_key(self, item, spider)``, keeps working: it is
        called with the crawler's spider (and with ``%(spider)s`` formatting left to it, as there)."""
        return self.key

    # -- writing --------------------------------------------------------------------------------
    async def _write(self, entries: list[tuple[str, str | bytes]]) -> None:
        """Write ``entries`` in one round trip (the writer retries a failure).

        Per key, one ``RPUSH`` (LIST) or one ``items_xadd`` script call (STREAM: the ``XADD`` commands
        run inside Redis). Several keys (an ``item_key`` override) go in one ``MULTI``/``EXEC`` (on a Redis
        Cluster: one call per key, sent together, since their slots differ).
        """
        by_key: dict[str, list[str | bytes]] = {}
        for key, data in entries:
            by_key.setdefault(key, []).append(data)
        if len(by_key) == 1:
            ((key, values),) = by_key.items()
            await self._append(key, values, self.server)
        elif is_cluster(self.server):
            # Keys of several slots cannot share a MULTI (nor a pipelined script) on a cluster: one call
            # per key, all at once. A retry after a partial failure writes some again.
            await asyncio.gather(*(self._append(k, v, self.server) for k, v in by_key.items()))
        else:
            async with self.server.pipeline(transaction=True) as pipe:
                for key, values in by_key.items():
                    await self._append(key, values, pipe)
                await pipe.execute()
        self._inc("redis_items/written", len(entries))
        self._inc("redis_items/batches")

    async def _append(self, key: str, values: list[str | bytes], client: Any) -> None:
        """Queue (on a pipeline) or send (on the client) the command appending ``values`` to ``key``."""
        if not self.stream:
            result = client.rpush(key, *values)
        else:
            if self._xadd is None:
                self._xadd = scripts.register(self.server, "items_xadd")
            maxlen = "" if self.maxlen is None else str(self.maxlen)
            result = self._xadd(keys=[key], args=[maxlen, STREAM_FIELD, *values], client=client)
        # A command queued on a pipeline returns the pipeline: never await that (awaiting a redis.asyncio
        # cluster pipeline re-initializes it, dropping the commands queued so far).
        if inspect.iscoroutine(result):
            await result

    # -- helpers --------------------------------------------------------------------------------
    def _inc(self, name: str, count: int = 1) -> None:
        if self.stats is not None:
            self.stats.inc_value(name, count)


def _check_subclass(cls: type, key: str, options: dict[str, Any]) -> None:
    """What a subclass written for scrapy-redis's RedisPipeline gets wrong here, said at start: one WARNING
    per overridden scrapy-redis method nothing calls (:data:`SCRAPY_REDIS_PIPELINE_HOOKS`) and for a
    blocking ``process_item`` that uses ``self.server`` (a redis.asyncio client here: its commands, not
    awaited, would write nothing); one ERROR line and exit status 1 for a constructor that cannot be called
    the way :meth:`RedisPipeline.from_crawler` calls it (scrapy-redis's ``__init__(self, server)``)."""
    if cls is RedisPipeline:
        return
    name = cls.__name__
    for hook, instead in SCRAPY_REDIS_PIPELINE_HOOKS.items():
        if getattr(cls, hook, None) is not getattr(RedisPipeline, hook, None):
            logger.warning("scrapy-dist: %s.%s() is never called: %s", name, hook, instead)
    process_item = cls.process_item  # type: ignore[attr-defined]
    if (process_item is not RedisPipeline.process_item and not inspect.iscoroutinefunction(process_item)
            and "server" in getattr(getattr(process_item, "__code__", None), "co_names", ())):
        logger.warning(
            "scrapy-dist: %s.process_item() uses self.server without awaiting it: here it is a redis.asyncio"
            " client (scrapy-redis: a blocking one), and a command that is not awaited does nothing; make it"
            " `async def process_item(self, item)` and `await self.server.<command>(...)`", name,
        )
    try:
        inspect.signature(cls).bind(None, key, **options)
    except TypeError as exc:
        params = ", ".join(inspect.signature(cls).parameters)
        raise ScrapyDistError(
            f"scrapy-dist: {name}.__init__({params}) cannot be called as RedisPipeline's from_crawler calls"
            f" it ({exc}): cls(server, key, {', '.join(f'{k}=...' for k in options)});"
            " take `*args, **kwargs` and pass them on to super().__init__, or override from_crawler"
        ) from exc


def _wants_spider(method: Callable[..., Any]) -> bool:
    """Whether a bound ``item_key`` takes a second positional argument (scrapy-redis's ``spider``)."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return True
    return len(positional) >= 2 and (positional[1].default is inspect.Parameter.empty
                                     or positional[1].name == "spider")
