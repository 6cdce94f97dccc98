"""Items waiting for their page's ack: what makes ``RedisPipeline`` output exactly once.

An item pipeline stages each encoded item under the request whose response produced it
(:meth:`ItemOutbox.stage`); when the engine has finished that request, the ledger takes them
(:meth:`ItemOutbox.take`) and they travel with the request's ack in one ``sync`` call, which appends
them to the items key only if the ack is accepted (lua/sync_items.lua). Nothing here talks to Redis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from scrapy_dist.redis.connection import is_cluster

if TYPE_CHECKING:
    from scrapy import Request

    from scrapy_dist.frontier.scheduler import Scheduler
    from scrapy_dist.frontier.shard import ItemRoute


class ItemOutbox:
    """Encoded items by the request they came from (reactor thread only)."""

    def __init__(self, leased: Callable[[Request], bool] = lambda request: True) -> None:
        self._items: dict[Request, list[bytes | str]] = {}
        #: whether a request came from a lease (only those are acknowledged, so only their items can ride)
        self.leased = leased
        #: items staged since the start
        self.staged = 0

    def stage(self, request: Request, data: bytes | str) -> bool:
        """Keep ``data`` until ``request``'s ack takes it; False (nothing kept) for a request of no lease
        (one crawled by this worker only): its items must be written otherwise."""
        if not self.leased(request):
            return False
        self._items.setdefault(request, []).append(data)
        self.staged += 1
        return True

    def take(self, request: Request) -> list[bytes | str]:
        """The items ``request`` produced (once; ``[]`` for none)."""
        return self._items.pop(request, [])

    def clear(self) -> int:
        """Forget every staged item (their requests were not acknowledged: they are crawled again);
        returns how many."""
        n = sum(len(v) for v in self._items.values())
        self._items.clear()
        return n

    def __len__(self) -> int:
        return sum(len(v) for v in self._items.values())


def attach(scheduler: Scheduler, route: ItemRoute) -> ItemOutbox | None:
    """Make ``scheduler``'s acks carry the items of their pages to ``route``; the outbox to stage them in,
    or None when they cannot ride the acks: the frontier is not open, or Redis is a cluster (the items
    key lives in another hash slot than the crawl's keys, and a script touches one slot)."""
    if not scheduler.frontiers or is_cluster(scheduler.redis):
        return None
    ledger = scheduler.ledger
    outbox = ItemOutbox(lambda request: request in ledger.handed)
    for frontier in scheduler.frontiers:
        frontier.items = route
    scheduler.ledger.items_of = outbox.take
    return outbox
