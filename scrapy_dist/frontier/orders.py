"""Queue orders of the shared frontier, chosen with ``SCHEDULER_QUEUE_CLASS``.

Every queue is the same sorted set (``{spider}:queue``), and every member starts with a 6-byte big-endian
sequence number from ``{spider}:seq``; a queue class only decides the score and the order of that prefix:
:class:`PriorityQueue` (default; ``-priority``, FIFO within a priority, across all workers),
:class:`FifoQueue` (one score) and :class:`LifoQueue` (one score, inverted sequence numbers). Two identical
``dont_filter`` requests are two entries; all pop with ``ZPOPMIN`` inside the ``sync`` script.

Start requests follow Scrapy's order: after the other requests of their priority
(:data:`START_REQUEST_OFFSET`), except one enqueued while the worker has room for it and holds nothing
better, which Scrapy's engine would send at once: the scheduler scores it :data:`START_NOW`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from scrapy_dist.settings.reader import QUEUE_ALIASES

if TYPE_CHECKING:
    from scrapy import Request

    from scrapy_dist.frontier.ledger import Ledger
    from scrapy_dist.frontier.syncloop import SyncLoop


class QueueOrder(Protocol):
    """What the frontier asks of a queue class."""

    #: ``"asc"``: sequence numbers grow (FIFO within a score); ``"desc"``: they shrink (LIFO).
    sequence: str

    def score(self, request: Request) -> float: ...


def _start_offset(request: Request) -> float:
    """Start requests yield to callback requests of equal priority, as in Scrapy >= 2.13 (whose
    scheduler keeps them in separate start queues served after the others of the same priority):
    half a priority step later, still before any lower priority."""
    return START_REQUEST_OFFSET if request.meta.get("is_start_request") else 0.0


#: added to the score of a start request (``meta["is_start_request"]``, set by Scrapy)
START_REQUEST_OFFSET = 0.5
#: the score of a start request Scrapy's engine would send at once (the worker has room and holds nothing
#: better): ahead of every priority, as the engine takes it before any request enqueued after it
START_NOW = -1e15


def sends_now(request: Request, ledger: Ledger, loop: SyncLoop | None, concurrency: int) -> bool:
    """Whether ``request`` is a start request Scrapy's engine would send at once (score it
    :data:`START_NOW`): the crawl is not paused, nothing is queued crawl-wide as far as this worker knows,
    and the worker has room for it (:meth:`~scrapy_dist.frontier.ledger.Ledger.starts_now`)."""
    if not request.meta.get("is_start_request") or loop is None or loop.paused or loop.local_pause:
        return False
    queued = loop.state.queued if loop.state is not None else loop.backlog
    return not queued and ledger.starts_now(concurrency)


class PriorityQueue:
    """Higher ``request.priority`` first; FIFO within a priority; start requests after the others of
    their priority."""

    sequence = "asc"

    def score(self, request: Request) -> float:
        return -request.priority + _start_offset(request)


class FifoQueue:
    """First in, first out; priorities ignored; start requests after the others."""

    sequence = "asc"

    def score(self, request: Request) -> float:
        return _start_offset(request)


class LifoQueue:
    """Last in, first out; priorities ignored; start requests after the others."""

    sequence = "desc"

    def score(self, request: Request) -> float:
        return _start_offset(request)


#: scrapy-redis's other names of its three queues: a project switched by replacing ``scrapy_redis`` with
#: ``scrapy_dist`` (``scrapy_dist.queue.SpiderQueue``, as in scrapy-redis's example settings) keeps its order
SpiderQueue = FifoQueue
SpiderStack = LifoQueue
SpiderPriorityQueue = PriorityQueue

#: scrapy-redis names, for ``SCHEDULER_QUEUE_CLASS`` values copied from a scrapy-redis project
ALIASES = {alias: globals()[name] for alias, name in QUEUE_ALIASES.items()}
