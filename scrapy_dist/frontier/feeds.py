"""Feed exports (``-o``, ``FEEDS``) that lose nothing when a worker is killed.

Scrapy's feed exporter writes an item to its file when the ``item_scraped`` signal fires, which is before
the engine finishes the item's request -- but into a buffer of this process. The frontier acknowledges a
request in the next round, so a worker killed after that round and before the buffer reached the disk
lost those items for good (no other worker fetches an acknowledged page). :class:`FeedBarrier` is awaited
by the sync loop before every round that acknowledges newly finished requests: it flushes every local feed
file and fsyncs it, so an acknowledged page's items are on disk.

Storages that store only at close or per batch (S3, GCS, FTP, post-processed files such as gzip) cannot be
made durable before an ack: one WARNING at start names each such feed, the risk, and the exact way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

    from scrapy_dist.frontier.syncloop import SyncLoop

logger = logging.getLogger(__name__)

#: URI schemes whose file this barrier can flush and fsync (a Windows drive letter parses as a scheme)
LOCAL_SCHEMES = frozenset(("", "file"))


def feed_exporter(crawler: Crawler) -> Any:
    """Scrapy's running FeedExporter extension, or None."""
    from scrapy.extensions.feedexport import FeedExporter

    manager = getattr(crawler, "extensions", None)
    for ext in getattr(manager, "middlewares", ()):
        if isinstance(ext, FeedExporter):
            return ext
    return None


def at_risk(feeds: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    """(uri, why) of each feed whose items cannot be on disk before their pages are acknowledged."""
    out = []
    for uri, options in feeds.items():
        scheme = urlparse(uri).scheme
        if options.get("postprocessing"):
            out.append((uri, "post-processed (compressed) as it is written, complete only at close"))
        elif scheme not in LOCAL_SCHEMES and len(scheme) != 1 and scheme != "stdout":
            out.append((uri, f"a {scheme}:// storage, which stores the file only at close or per batch"))
    return out


def _fsync_all(fds: list[int]) -> None:
    for fd in fds:
        # a file closed meanwhile (a batch rotated) was flushed by its close
        with contextlib.suppress(OSError):
            os.fsync(fd)


class FeedBarrier:
    """Flush and fsync the crawl's local feed files before each acknowledging round."""

    def __init__(self, crawler: Crawler) -> None:
        self.crawler = crawler
        self.stats = crawler.stats

    @classmethod
    def install(cls, crawler: Crawler, loop: SyncLoop) -> FeedBarrier | None:
        """Put a barrier on ``loop`` when the crawl exports feeds; warn about those at risk."""
        exporter = feed_exporter(crawler)
        if exporter is None or not getattr(exporter, "feeds", None):
            return None
        for uri, why in at_risk(exporter.feeds):
            logger.warning(
                "FEEDS %s is %s: a worker killed before the close loses the items of pages already"
                " acknowledged (no other worker fetches them again). For output that survives any kill, use"
                " ITEM_PIPELINES = {'scrapy_dist.pipelines.RedisPipeline': 300} and export with"
                " `scrapy-dist items %s --export FILE` (docs/items.md)",
                uri, why, getattr(crawler.spider, "name", "SPIDER"),
            )
        barrier = cls(crawler)
        loop.ack_barriers.append(barrier)
        return barrier

    async def __call__(self) -> None:
        exporter = feed_exporter(self.crawler)
        fds = []
        for slot in getattr(exporter, "slots", ()):
            file = slot.file
            if file is None or getattr(file, "closed", False):
                continue
            file.flush()
            if slot.feed_options.get("postprocessing"):
                continue
            with contextlib.suppress(AttributeError, OSError, ValueError):
                fds.append(file.fileno())
        if fds:
            await asyncio.to_thread(_fsync_all, fds)
            if self.stats is not None:
                self.stats.inc_value("feeds/fsyncs")
