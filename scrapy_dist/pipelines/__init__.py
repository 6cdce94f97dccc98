"""Items out of the cluster: ``RedisPipeline`` appends them to a Redis LIST (scrapy-redis compatible) or
STREAM at ``REDIS_ITEMS_KEY``; with the scrapy-dist scheduler a page's items ride its ack (exactly once),
otherwise they are written in batches of their own (at least once)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from itemadapter import ItemAdapter, is_item
from scrapy import signals
from scrapy.exceptions import DropItem
from scrapy.utils.misc import load_object
from scrapy.utils.serialize import ScrapyJSONEncoder

from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.frontier import engine as _outbox
from scrapy_dist.frontier.scheduler import get_scheduler
from scrapy_dist.frontier.shard import ItemRoute
from scrapy_dist.redis import scripts
from scrapy_dist.redis.connection import ClientPool, send_calls
from scrapy_dist.redis.keys import crawler_keys
from scrapy_dist.redis.outage import BatchWriter, Outage
from scrapy_dist.redis.scripts import text
from scrapy_dist.settings import DistSettings, defaults
from scrapy_dist.settings.reader import refuse_start, refusing
from scrapy_dist.utils import inc_stat

if TYPE_CHECKING:
    import redis.asyncio
    from scrapy.crawler import Crawler
    from scrapy.statscollectors import StatsCollector
    from typing_extensions import Self

logger = logging.getLogger(__name__)

STREAM_FIELD = "item"  #: Field of each stream entry that holds the JSON item (``XADD <key> * item <json>``).

_MAX_BATCHES_PER_FLUSH = 16  # so a backlog built up during an outage drains in bounded transactions
_MAX_PENDING = 10_000  # items encoded by process_item kept for their item_scraped signal
_ENCODE_ERRORS = (TypeError, ValueError, OverflowError, RecursionError, UnicodeError)
#: JSON with Scrapy's encoder (items, dates, decimals, sets), as scrapy-redis does
default_serialize: Callable[[Any], str] = ScrapyJSONEncoder().encode

#: scrapy-redis RedisPipeline methods scrapy-dist's never calls and what to do instead (WARNING if overridden)
SCRAPY_REDIS_PIPELINE_HOOKS: dict[str, str] = {
    "_process_item": "items are written in batches by process_item(); route them with item_key(item,"
                     " spider), change them in `async def process_item(self, item)` before `return await"
                     " super().process_item(item)`, or write them with a client of your own"
                     " (scrapy_dist.connection.get_redis(settings))",
    "from_settings": "the pipeline is built by from_crawler(crawler); override that instead",
}


def find_unencodable(value: Any, serialize: Callable[[Any], Any], path: str = "") -> tuple[str, Exception]:
    """``(path, error)``: the innermost part of ``value`` ``serialize`` rejects (``tags[2]``, ``""``: all)."""
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
    """Append every item, JSON-encoded, to a Redis LIST (``RPUSH``) or STREAM (``XADD``): riding its page's
    ack (:attr:`outbox`), or in batches retried with backoff. An item that cannot be encoded is dropped."""

    def __init__(
        self, server: redis.asyncio.Redis, key: str, *, stream: bool = defaults.REDIS_ITEMS_STREAM,
        maxlen: int | None = defaults.REDIS_ITEMS_MAXLEN, batch_size: int = defaults.REDIS_ITEMS_BATCH_SIZE,
        flush_interval: float = defaults.REDIS_ITEMS_FLUSH_INTERVAL,
        serialize: Callable[[Any], str | bytes] = default_serialize, stats: StatsCollector | None = None,
        outage: Outage | None = None, exactly_once: bool = True, max_bytes: int = 8 * 1024 * 1024,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"REDIS_ITEMS_BATCH_SIZE must be at least 1, got {batch_size}")
        self.server, self.key, self.stream, self.maxlen = server, key, stream, maxlen
        self.batch_size, self.flush_interval = batch_size, flush_interval
        self.serialize, self.stats = serialize, stats
        self.outage = outage or Outage()
        self.writer: BatchWriter[tuple[str, str | bytes]] = BatchWriter(
            self._write, guard=self.outage.guard("item pipeline", log=logger),
            batch_size=batch_size, flush_interval=flush_interval, max_batches=_MAX_BATCHES_PER_FLUSH,
            on_failure=lambda exc: inc_stat(self.stats, "redis_items/redis_errors"))
        self._xadd: Any = None  # the items_xadd script, registered on first use
        #: scrapy-redis's ``item_key(self, item, spider)`` overrides get the spider (see :meth:`item_key`)
        self._key_wants_spider = _wants_spider(self.item_key)
        self._crawler: Crawler | None = None
        self.exactly_once, self.max_bytes = exactly_once, max_bytes
        #: items staged by the page they came from, riding its ack (None: written in batches of their own)
        self.outbox: _outbox.ItemOutbox | None = None
        self._pending: dict[int, tuple[Any, str | bytes]] = {}  #: id(item) -> (item, data) till item_scraped

    @classmethod
    @refusing
    def from_crawler(cls, crawler: Crawler) -> Self:
        items, key = DistSettings.for_crawler(crawler).items, crawler_keys(crawler).items
        options: dict[str, Any] = {
            "stream": items.stream, "maxlen": items.maxlen, "batch_size": items.batch_size,
            "flush_interval": items.flush_interval,
            "serialize": load_object(items.serializer) if items.serializer else default_serialize,
            "stats": crawler.stats, "outage": Outage.for_crawler(crawler)}
        _check_subclass(cls, key, options)
        pipe = cls(ClientPool.of(crawler).async_client(), key, **options)
        pipe._crawler, pipe.exactly_once, pipe.max_bytes = crawler, items.exactly_once, items.max_bytes
        crawler.signals.connect(pipe.item_scraped, signal=signals.item_scraped)
        crawler.signals.connect(pipe.item_left, signal=signals.item_dropped)
        crawler.signals.connect(pipe.item_left, signal=signals.item_error)
        return pipe

    async def open_spider(self) -> None:
        """Check the items key holds the expected type (1 round trip) and start the writer task."""
        expected = "stream" if self.stream else "list"
        try:
            found = text(await self.server.type(self.key))
        except Exception as exc:  # not fatal: the writer waits for Redis as in any outage
            self.writer.guard.failed(exc, time.monotonic())
        else:
            if found not in ("none", expected):
                error = ScrapyDistError(
                    f"REDIS_ITEMS_KEY {self.key!r} holds a Redis {found}, but the pipeline writes a "
                    f"{expected} (REDIS_ITEMS_STREAM={self.stream}); delete the key or change the setting")
                if self._crawler is None:
                    raise error
                refuse_start(self._crawler, error)
                return
        self.outbox = self._ride_acks()
        self.writer.start()

    def _ride_acks(self) -> _outbox.ItemOutbox | None:
        """The scheduler's outbox, if items can ride its acks (exactly once, ``item_key`` not overridden)."""
        sched = get_scheduler(self._crawler) if self._crawler is not None else None
        if not self.exactly_once or sched is None:
            return None
        if type(self).item_key is not RedisPipeline.item_key:
            logger.warning("%s overrides item_key(): items are written at least once, in batches of"
                           " their own", type(self).__name__)
            return None
        found = _outbox.attach(sched, ItemRoute(self.key, "stream" if self.stream else "list", self.maxlen))
        if found is None:
            logger.warning("REDIS_ITEMS_EXACTLY_ONCE: the items key %s is in another Redis Cluster hash slot"
                           " than the frontier's keys: items are written at least once; for exactly once, set"
                           " REDIS_ITEMS_KEY = \"{%%(spider)s}:items\" and SCHEDULER_SHARDS = 1", self.key)
        return found

    async def process_item(self, item: Any, spider: Any = None) -> Any:
        """Buffer ``item`` and return it once it is written (``spider``: for scrapy-redis subclasses)."""
        try:
            data = self.serialize(item)
        except _ENCODE_ERRORS as exc:
            inc_stat(self.stats, "redis_items/unserializable")
            path, error = find_unencodable(item, self.serialize)
            where = f"field {path!r}" if path else "the item itself"
            raise DropItem(f"RedisPipeline cannot encode {where}: {error.__class__.__name__}: {error}",
                           log_level="ERROR") from exc
        if len(data) > self.max_bytes:
            inc_stat(self.stats, "redis_items/too_large")
            raise DropItem(f"RedisPipeline: the item encodes to {len(data)} bytes, more than"
                           f" REDIS_ITEMS_MAX_BYTES ({self.max_bytes})", log_level="ERROR")
        if self.writer.closing:
            raise RuntimeError("RedisPipeline.process_item() called after close_spider()")
        if self.outbox is not None:  # staged by its page in item_scraped
            if len(self._pending) >= _MAX_PENDING:
                self._pending.clear()
            self._pending[id(item)] = (item, data)
            return item
        spider = (getattr(self._crawler, "spider", None),) if self._key_wants_spider else ()
        await asyncio.shield(self.writer.add((self.item_key(item, *spider), data)))
        return item

    def item_scraped(self, item: Any, response: Any = None, spider: Any = None) -> None:
        """Signal handler: stage the item to ride its response's ack (no leased request: written alone)."""
        if self.outbox is None:
            return
        if (entry := self._pending.pop(id(item), None)) is not None and entry[0] is item:
            data = entry[1]
        else:  # a later pipeline returned another object: write what came out of the chain
            try:
                data = self.serialize(item)
            except _ENCODE_ERRORS as exc:
                inc_stat(self.stats, "redis_items/unserializable")
                logger.error("RedisPipeline cannot encode an item a later pipeline returned: %s", exc)
                return
        if (request := getattr(response, "request", None)) is None or not self.outbox.stage(request, data):
            inc_stat(self.stats, "redis_items/unbound")
            self.writer.add((self.key, data))

    def item_left(self, item: Any, **kwargs: Any) -> None:
        """Signal handler (item dropped, or a pipeline raised): forget what process_item encoded."""
        self._pending.pop(id(item), None)

    async def close_spider(self) -> None:
        await self.writer.close()
        await self.server.aclose()

    def item_key(self, item: Any) -> str:
        """Redis key for ``item``; an override may take scrapy-redis's ``(self, item, spider)``."""
        return self.key

    async def _write(self, entries: list[tuple[str, str | bytes]]) -> None:
        """Write ``entries``: one ``RPUSH``/``items_xadd`` per key, in one ``MULTI`` (cluster: each apart)."""
        by_key: dict[str, list[str | bytes]] = defaultdict(list)
        for key, data in entries:
            by_key[key].append(data)
        # a retry after a partial failure on a cluster (no MULTI across slots) writes some again
        await send_calls(self.server, [functools.partial(self._append, k, v) for k, v in by_key.items()],
                         transaction=True)
        inc_stat(self.stats, "redis_items/written", len(entries))
        inc_stat(self.stats, "redis_items/batches")

    def _append(self, key: str, values: list[str | bytes], client: Any) -> Any:
        if not self.stream:
            return client.rpush(key, *values)
        self._xadd = self._xadd or scripts.register(self.server, "items_xadd")
        maxlen = "" if self.maxlen is None else str(self.maxlen)
        return self._xadd(keys=[key], args=[maxlen, STREAM_FIELD, *values], client=client)


def _check_subclass(cls: type, key: str, options: dict[str, Any]) -> None:
    """Warn about what a scrapy-redis subclass gets wrong here; refuse a constructor we cannot call."""
    if cls is RedisPipeline:
        return
    name = cls.__name__
    for hook, instead in SCRAPY_REDIS_PIPELINE_HOOKS.items():
        if getattr(cls, hook, None) is not getattr(RedisPipeline, hook, None):
            logger.warning("scrapy-dist: %s.%s() is never called: %s", name, hook, instead)
    process_item = cls.process_item  # type: ignore[attr-defined]
    if (process_item is not RedisPipeline.process_item and not inspect.iscoroutinefunction(process_item)
            and "server" in getattr(getattr(process_item, "__code__", None), "co_names", ())):
        logger.warning("scrapy-dist: %s.process_item() uses self.server without awaiting it: here a"
                       " redis.asyncio client, whose commands do nothing unless awaited; make it `async def"
                       " process_item(self, item)` and `await self.server.<command>(...)`", name)
    try:
        inspect.signature(cls).bind(None, key, **options)
    except TypeError as exc:
        params = ", ".join(inspect.signature(cls).parameters)
        raise ScrapyDistError(
            f"scrapy-dist: {name}.__init__({params}) cannot be called as RedisPipeline's from_crawler calls"
            f" it ({exc}): cls(server, key, {', '.join(f'{k}=...' for k in options)});"
            " take `*args, **kwargs` and pass them on to super().__init__, or override from_crawler") from exc


def _wants_spider(method: Callable[..., Any]) -> bool:
    """Whether a bound ``item_key`` takes a second positional argument (scrapy-redis's ``spider``)."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return any(p.kind is p.VAR_POSITIONAL for p in params) or (len(positional) >= 2 and (
        positional[1].default is inspect.Parameter.empty or positional[1].name == "spider"))
