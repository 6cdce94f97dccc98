"""What the scheduler tells the crawl's stats and log: each shard's answer, requests that cannot be encoded,
and the backlog a worker finds when it joins. Stats are Scrapy's slash paths (docs/settings.md lists them);
repetitive lines are logged a few times and then only counted."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from scrapy_dist.utils.ratelimit import RateLimitedLog

if TYPE_CHECKING:
    from scrapy import Request

    from scrapy_dist.exceptions import UnserializableRequest
    from scrapy_dist.frontier.ledger import Applied
    from scrapy_dist.frontier.shard import SyncResult
    from scrapy_dist.redis.keys import CrawlKeys

logger = logging.getLogger("scrapy_dist.frontier.scheduler")


class NoStats:
    """Stats sink of a scheduler built without a stats collector."""

    def inc_value(self, key: str, count: int = 1, start: int = 0) -> None:
        pass

    def set_value(self, key: str, value: Any) -> None:
        pass


class FrontierReport:
    """Stats and log lines of one worker's frontier (``shard_keys``: every shard's keys, for messages)."""

    def __init__(self, stats: Any, shard_keys: list[CrawlKeys], log_duplicate: Any) -> None:
        self.stats = stats
        self.shard_keys = shard_keys
        #: ``log_duplicate(request)``: the dupefilter's log of a filtered request
        self.log_duplicate = log_duplicate
        self._log = RateLimitedLog(logger)
        self._unserializable_log = RateLimitedLog.once(logger)
        #: acks and items refused since this worker's acks were last accepted (told once, see refusals_done)
        self._refused = [0, 0]
        #: the crawl exports feeds: a refused ack is a page whose items another fetch writes there again
        self.feeds = False

    def applied(self, applied: Applied, result: SyncResult) -> None:
        """Stats and logs of one shard's answer."""
        stats = self.stats
        for request in applied.duplicates:
            self.log_duplicate(request)
        if applied.enqueued:
            stats.inc_value("scheduler/enqueued/redis", applied.enqueued)
            stats.inc_value("scheduler/enqueued", applied.enqueued)
        if result.requeued:
            stats.inc_value("scheduler/requeued/lease_expired", result.requeued)
        if result.moved:
            stats.inc_value("scheduler/delayed/moved", result.moved)
        if result.rejected:  # malformed members, and copies of entries handed out, the script parked itself
            stats.inc_value("scheduler/rejected", result.rejected)
            if result.rejected > result.replayed:
                stats.inc_value("scheduler/rejected/bad_member", result.rejected - result.replayed)
            if result.replayed:
                stats.inc_value("scheduler/rejected/replayed", result.replayed)
        if result.items:
            stats.inc_value("redis_items/written", result.items)
        if result.acks_refused:
            stats.inc_value("scheduler/acks_refused", result.acks_refused)
            if result.items_refused:
                stats.inc_value("redis_items/refused", result.items_refused)
            if self.feeds:
                stats.inc_value("feeds/duplicate_pages", result.acks_refused)
            self._refused[0] += result.acks_refused
            self._refused[1] += result.items_refused
        if applied.acked > result.acks_refused:  # this worker's acks count again: the episode is over
            self.refusals_done()
        for key in result.repaired:
            self._log.log(
                logging.WARNING, "Repaired garbage in %s (written by someone else?) before writing", key,
                key=f"repaired:{key}",
            )
        for (shard, _), exc in applied.rejected:
            stats.inc_value("scheduler/rejected")
            stats.inc_value(f"scheduler/rejected/{exc.reason}")
            keys = self.shard_keys[shard]
            self._log.log(
                logging.ERROR, "Rejected a queue entry of %r (%s); moved it to %s",
                keys.queue, exc, keys.queue_rejected, key="rejected",
            )

    def refusals_done(self) -> None:
        """One WARNING for a run of refused acks (a worker stopped past its leases refuses them over a few
        rounds, until an ack of a lease it took since is accepted; also called at close)."""
        acks, items = self._refused
        if not acks:
            return
        self._refused = [0, 0]
        logger.warning(
            "The frontier refused %d acknowledgements and their %d items: those leases were no longer this"
            " worker's (it was stopped or cut off longer than SCHEDULER_LEASE_SECONDS and another worker"
            " took them, or an earlier call had already acknowledged them). Their items come from the other"
            " fetch, once; feed exports may hold these pages' items twice", acks, items,
        )

    def unserializable(self, request: Request, exc: UnserializableRequest) -> None:
        """A request that cannot go to Redis (crawled by this worker only): counted, logged once per key."""
        self.stats.inc_value("scheduler/unserializable")
        self._unserializable_log.log(
            logging.ERROR,
            "Unable to put %(request)s in the shared frontier: %(reason)s. It is crawled by this worker"
            " only and is lost if it dies. Make %(key)s encodable (str, bytes, numbers, bools, None,"
            " lists, dicts) or pass a spider method name. Further requests failing on %(key)s are only"
            " counted in scheduler/unserializable.",
            {"request": request, "reason": exc, "key": exc.key}, key=exc.key,
        )

    @staticmethod
    def backlog(spider: str, pending: int, remembered: int, persist: bool) -> None:
        """The line scrapy-redis users look for, and a warning when joining a crawl that has finished."""
        if pending:
            logger.info("Resuming crawl (%d requests scheduled)", pending)
        elif remembered and persist:
            logger.warning(
                "The crawl %r has run before and finished: %d fingerprints are remembered"
                " (SCHEDULER_PERSIST=True), so requests already seen then are skipped now. To start"
                " afresh: -s SCHEDULER_FLUSH_ON_START=True for this run, or SCHEDULER_PERSIST=False so"
                " that a finished crawl removes its keys.",
                spider, remembered,
            )
