"""The leased requests a worker holds before handing them to the engine (:class:`LeasedBuffer`), and
what a lease is (:data:`Lease`); used by :class:`scrapy_dist.frontier.ledger.Ledger`."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scrapy import Request

#: A leased member and the shard it was leased from (always 0 with one shard).
Lease = tuple[int, bytes]


class LeasedBuffer:
    """Leased requests waiting to be handed to the engine: a heap on the queue score (``-priority``),
    ties in the order leased (which is the queue's own order within a score). Whatever round or shard a
    request came from, the worker starts the best one it holds first."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Request, Lease]] = []
        self._count = itertools.count()

    def push(self, score: float, request: Request, lease: Lease) -> None:
        heapq.heappush(self._heap, (score, next(self._count), request, lease))

    def pop(self) -> tuple[Request, Lease]:
        _, _, request, lease = heapq.heappop(self._heap)
        return request, lease

    def pop_least_loaded(self, load: Callable[[Request], int]) -> tuple[Request, Lease]:
        """The best request of the download slot with the fewest active downloads (Scrapy's
        ``DownloaderAwarePriorityQueue``): a scan of the buffer, which holds at most a prefetch."""
        heap = self._heap
        best = min(range(len(heap)), key=lambda i: (load(heap[i][2]), heap[i][0], heap[i][1]))
        entry = heap[best]
        heap[best] = heap[-1]
        heap.pop()
        heapq.heapify(heap)
        return entry[2], entry[3]

    def best_score(self) -> float:
        """The score of the request :meth:`pop` returns next (``inf`` when empty)."""
        return self._heap[0][0] if self._heap else math.inf

    def leases(self) -> list[Lease]:
        """Every lease in the buffer (for releasing them at close)."""
        return [e[-1] for e in self._heap]

    def clear(self) -> None:
        self._heap.clear()

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)
