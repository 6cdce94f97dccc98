"""What the demo does in its Redis besides the crawl: wait for a server that is loading, look into the
crawl's bloom filter to explain a lost page, and clean up after the run (delete its keys, compact the
embedded server's append-only file, see whether anyone else still uses the server)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from scrapy_dist.redis.embedded import DEFAULT_DIRNAME, EmbeddedRedis
from scrapy_dist.redis.keys import CrawlKeys

__all__ = [
    "bloom_claims", "compact", "delete_keys", "open_redis", "others_connected", "release_run", "wait_loaded",
]


def open_redis(
    redis_url: str | None, project: Path, loading_timeout: float
) -> tuple[Any, str, EmbeddedRedis | None, bool]:
    """A client of ``redis_url``, or of the project's embedded Redis (started if needed): returns the
    client, the URL, the embedded server (or ``None``) and whether this call started it.

    Raises :class:`~scrapy_dist.exceptions.RedisUnavailable` (one line naming the URL) if it does not
    answer; a server started here is stopped again then."""
    from scrapy_dist.redis.connection import check_reachable, get_redis

    embedded, started = None, False
    if not redis_url:
        # The directory every `scrapy crawl` in the project would use (REDIS_EMBEDDED_DIR unset).
        embedded = EmbeddedRedis(project / ".scrapy" / DEFAULT_DIRNAME)
        redis_url, started = embedded.ensure_running()
    settings = {"REDIS_URL": redis_url}
    client = get_redis(settings)
    wait_loaded(client, loading_timeout)
    try:
        check_reachable(client, settings)
    except Exception:
        client.close()
        if started and embedded is not None:
            embedded.shutdown()
        raise
    return client, redis_url, embedded, started


def wait_loaded(client: Any, timeout: float) -> None:
    """Wait up to ``timeout`` seconds while the server is loading its data file.

    A server that just started may still be loading: PING answers LOADING until it is done
    (EmbeddedRedis.ensure_running() returns as soon as it answers at all). Any other error ends the wait;
    the caller's reachability check reports it.
    """
    from redis.exceptions import BusyLoadingError, RedisError

    deadline = time.monotonic() + timeout
    while True:
        try:
            client.ping()
            return
        except BusyLoadingError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)
        except (RedisError, OSError):
            return


def bloom_claims(client: Any, keys: CrawlKeys, urls: list[str]) -> list[bool] | None:
    """Whether the crawl's bloom filter holds each URL (no writes), or ``None`` if the crawl has no
    bloom filter. Fingerprints as the workers make them (Scrapy's default fingerprinter)."""
    from scrapy import Request
    from scrapy.utils.request import RequestFingerprinter

    from scrapy_dist.dupefilter import BloomDupeFilter

    capacity, error_rate, block_bits, n = client.hmget(
        keys.bloom, ["capacity", "error_rate", "block_bits", "n"]
    )
    if capacity is None:
        return None
    df = BloomDupeFilter(
        client, keys, RequestFingerprinter(),
        capacity=int(capacity), error_rate=float(error_rate), block_bits=int(block_bits),
    )
    df.observe(int(n or 0))
    return df.seen_tokens([df.tokens(Request(u)) for u in urls], add=False)


def others_connected(client: Any) -> bool:
    """Whether clients other than this process's are connected to the Redis (two round trips)."""
    me = client.client_id()
    return any(int(c.get("id", me)) != me for c in client.client_list())


def compact(client: Any, timeout: float = 10.0) -> None:
    """Rewrite the embedded server's append-only file before stopping it: every run writes (and then
    deletes) tens of thousands of entries, which the file would otherwise keep -- and replay at every
    start -- until it reaches Redis's 64 MB rewrite threshold."""
    client.bgrewriteaof()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = client.info("persistence")
        if not info.get("aof_rewrite_in_progress") and not info.get("aof_rewrite_scheduled"):
            return
        time.sleep(0.05)


def delete_keys(client: Any, prefix: str) -> int:
    """Delete a run's keys (every key holding its unique ``prefix``). Returns how many."""
    batch: list[Any] = []
    deleted = 0
    for key in client.scan_iter(match=f"*{prefix}*", count=1000):
        batch.append(key)
        if len(batch) >= 500:
            deleted += client.delete(*batch)
            batch = []
    if batch:
        deleted += client.delete(*batch)
    return deleted


def release_run(client: Any, prefix: str, started_redis: bool) -> bool:
    """After a run: delete its keys and close ``client``; if the demo started the server
    (``started_redis``) and nobody else uses it now, compact its data file first. Returns whether the
    server should be stopped. Never raises: the clean-up must finish whatever state Redis is in."""
    stop = started_redis
    with contextlib.suppress(Exception):
        delete_keys(client, prefix)
    if stop:
        # Another demo (or crawl) of the project may have joined the server meanwhile: keep it up.
        with contextlib.suppress(Exception):
            stop = not others_connected(client)
    if stop:
        with contextlib.suppress(Exception):
            compact(client)
    with contextlib.suppress(Exception):
        client.close()
    return stop
