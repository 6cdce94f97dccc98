"""Ending revisit chains from outside the workers: ``scrapy-dist close`` ends every chain of a crawl,
``scrapy-dist forget URL`` the chains of the URLs it names.

A chain lives as one scheduled revisit in a shard's delayed set (its delayed meta ``"<score> r"``, see
``lua/sync_settle.lua``) or as the request a worker is fetching. Removing the scheduled revisit ends the
first kind; a closing worker ends the second (:meth:`scrapy_dist.frontier.revisit.Revisits.stop`). A
revisit that came due a moment before (moved to the queue) is fetched once more and, if it still asks
for revisits, files its chain again: ``forget`` it then.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import redis

from scrapy_dist.exceptions import RejectedEntry
from scrapy_dist.frontier.revisit import member_prefix
from scrapy_dist.wire.codec import load_payload

if TYPE_CHECKING:
    from scrapy_dist.redis.keys import CrawlKeys

#: delayed meta fields read per HSCAN call
SCAN_COUNT = 1000


def entry_url(member: bytes, polite: bool) -> str | None:
    """The URL of a queue or delayed member (None if it does not decode: it names no URL)."""
    try:
        url = load_payload(member[len(member_prefix(member, polite)) :]).get("u")
    except (RejectedEntry, ValueError):
        return None
    return url if isinstance(url, str) else None


def end_chains(
    client: Any, shard_keys: list[CrawlKeys], polite: bool, urls: Collection[str] | None = None
) -> int:
    """Remove the scheduled revisits of ``urls`` (None: all of them) from every shard's delayed set;
    returns how many. Costs an HSCAN of each shard's delayed meta and one pipelined round trip per
    batch removed; a delayed meta of another Redis type holds no chain (the workers move it aside)."""
    ended = 0
    for keys in shard_keys:
        found: list[bytes] = []
        try:
            for member, meta in client.hscan_iter(keys.delayed_meta, count=SCAN_COUNT):
                if not (isinstance(meta, bytes) and meta.endswith(b" r")) or member == b"revisits":
                    continue
                if urls is None or entry_url(member, polite) in urls:
                    found.append(member)
        except redis.ResponseError:  # WRONGTYPE
            continue
        removed = 0
        for i in range(0, len(found), SCAN_COUNT):
            pipe = client.pipeline(transaction=False)
            for member in found[i : i + SCAN_COUNT]:
                pipe.zrem(keys.delayed, member)
                pipe.hdel(keys.delayed_meta, member)
            removed += sum(pipe.execute()[::2])
        if removed:
            _uncount(client, keys.delayed_meta, removed)
        ended += removed
    return ended


def _uncount(client: Any, key: str, n: int) -> None:
    """Take ``n`` off the scheduled revisit count (read as untrusted: garbage restarts at 0)."""
    raw = client.hget(key, "revisits")
    try:
        left = int(raw or 0)
    except ValueError:
        left = 0
    client.hset(key, "revisits", max(0, left - n))
