"""``scrapy-dist dead <spider>``: list, requeue or purge the crawl's dead letters (docs/retries.md).

``--requeue`` goes through the frontier's own ``sync`` script (no deduplication), then removes the records
one by one with ``LREM``, so records appended meanwhile stay and an interrupted requeue requeues some
requests twice rather than losing any. Records are untrusted (:mod:`scrapy_dist.frontier.control`
parses them): malformed ones are reported on stderr, never requeued, and only purged by a ``--purge``
without ``--reason``.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

import click
import redis
from scrapy import Request
from scrapy.utils.misc import load_object

from scrapy_dist.cli import ClientFactory, force_option, main, pass_redis
from scrapy_dist.cli.text import console, json_safe, printable
from scrapy_dist.exceptions import RejectedEntry
from scrapy_dist.frontier import orders as queue
from scrapy_dist.frontier.control import (
    DeadLetter,
    parse_control,
    parse_record,
    reason_matches,
    requeue_payload,
)
from scrapy_dist.frontier.orders import DomainLimits
from scrapy_dist.frontier.shard import Frontier, SyncBatch, domain_shard
from scrapy_dist.settings import DistSettings
from scrapy_dist.wire.codec import EntryPolicy

if TYPE_CHECKING:
    import redis

    from scrapy_dist.redis.keys import CrawlKeys

#: Malformed records named one by one on stderr (the rest are counted).
BAD_SHOWN = 20
#: Records read per round trip, and requeued per ``sync`` call.
CHUNK = 500
#: Rows of the table when ``--limit`` is not given.
TABLE_ROWS = 100


def read_records(client: redis.Redis, key: str) -> Iterator[tuple[int, bytes]]:
    """``(index, raw record)`` for every element of the dead-letter LIST, ``CHUNK`` per round trip."""
    offset = 0
    while True:
        chunk: list[bytes] = client.lrange(key, offset, offset + CHUNK - 1)  # type: ignore[assignment]
        for i, raw in enumerate(chunk):
            yield offset + i, raw
        offset += len(chunk)
        if len(chunk) < CHUNK:
            return


def select(
    client: redis.Redis, key: str, reason: str | None
) -> tuple[list[tuple[int, DeadLetter]], list[tuple[int, bytes, str]]]:
    """The valid records matching ``reason`` (all if ``None``), and the malformed ones."""
    good: list[tuple[int, DeadLetter]] = []
    bad: list[tuple[int, bytes, str]] = []
    for index, raw in read_records(client, key):
        try:
            letter = parse_record(raw)
        except RejectedEntry as exc:
            bad.append((index, raw, exc.detail or exc.reason))
            continue
        if reason is None or reason_matches(letter.reason, reason):
            good.append((index, letter))
    return good, bad


def _when(at: float) -> str:
    try:
        if at > 0:
            return datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    except (ValueError, OverflowError, OSError):
        pass
    return "?"


def _table(letters: list[tuple[int, DeadLetter]], key: str) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"dead letters in {key}", title_justify="left")
    for name in ("#", "at (UTC)", "reason", "status", "attempts", "worker", "url"):
        table.add_column(name, overflow="fold", no_wrap=name not in ("url", "reason"))
    for index, d in letters:
        table.add_row(  # Text, never markup: a worker id like "[/x]" is data
            f"{index:,}", _when(d.at), Text(printable(d.reason, 200)),
            "" if d.status is None else str(d.status), f"{d.attempts:,}", Text(printable(d.worker, 120)),
            Text(printable(d.url, 2000) + ("" if d.payload is not None else "  (not requeueable)")),
        )
    console().print(table)


def queue_order(ds: DistSettings) -> queue.QueueOrder:
    """The crawl's queue class (``SCHEDULER_QUEUE_CLASS``), which scores and sequences entries."""
    path = ds.scheduler.queue_class
    cls: Any = queue.ALIASES.get(path) or load_object(path)
    return cast("queue.QueueOrder", cls())


def requeue_targets(
    letters: list[tuple[int, DeadLetter]], ds: DistSettings, keys: CrawlKeys
) -> tuple[list[tuple[DeadLetter, bytes, float]], list[tuple[DeadLetter, str]]]:
    """``(record, payload, queue score)`` for each requeueable record, and why the others are not."""
    order = queue_order(ds)
    schemes = ds.scheduler.allowed_schemes
    max_bytes = ds.scheduler.max_entry_bytes
    # re-signs only records whose tag verifies as this crawl's dead letters
    policy = EntryPolicy.from_dist(ds).bound(crawl=keys.shard(0, 1).tag)
    ok: list[tuple[DeadLetter, bytes, float]] = []
    refused: list[tuple[DeadLetter, str]] = []
    for _, d in letters:
        if d.payload is None:
            refused.append((d, "the request could not be encoded when it failed"))
            continue
        try:
            payload, priority = requeue_payload(d.payload, schemes, max_bytes, policy)
            # the queue class scores a request from its priority (see scrapy_dist.frontier.orders)
            score = float(order.score(Request(d.url or "http://x", priority=priority)))
        except RejectedEntry as exc:
            refused.append((d, str(exc)))
            continue
        except (ValueError, TypeError, OverflowError) as exc:  # e.g. a url Request() refuses
            refused.append((d, f"{type(exc).__name__}: {exc}"))
            continue
        ok.append((d, payload, score))
    return ok, refused


async def requeue_letters(
    factory: ClientFactory, keys: CrawlKeys, targets: list[tuple[DeadLetter, bytes, float]]
) -> int:
    """Enqueue ``targets`` with the frontier's sync script, then remove their records; returns how many."""
    client = factory.async_client()
    ds = factory.dist
    sequence = queue_order(ds).sequence
    try:
        control = parse_control(await client.hgetall(keys.control))  # the crawl's own mode and shards
    except redis.ResponseError:  # another Redis type: garbage (the workers move it aside); none recorded
        control = parse_control({})
    politeness = control.politeness or ds.scheduler.politeness
    limits = DomainLimits.from_dist(ds)
    shards = keys.shards(control.shards or 1)
    # "" as worker id: a tool, not a worker of the crawl; requests need no dedupe, so any shard takes
    # them -- but with crawl-wide politeness a domain's requests belong to its shard
    frontiers = [
        Frontier(client, k, "", None, sequence=sequence, politeness=politeness, heartbeat=i == 0)
        for i, k in enumerate(shards)
    ]
    by_domain = politeness == "cluster"

    def domain_of(d: DeadLetter) -> str:
        return (urlsplit(d.url or "").hostname or "").lower()

    def entry(d: DeadLetter, payload: bytes, score: float) -> tuple[str, str, float, bytes, str, str]:
        domain = domain_of(d)
        return ("", "", score, payload, domain, limits.for_domain(domain).encode())

    done = 0
    try:
        for i in range(0, len(targets), CHUNK):
            chunk = targets[i : i + CHUNK]
            batches = [SyncBatch() for _ in shards]
            for d, payload, score in chunk:
                shard = domain_shard(domain_of(d), len(shards)) if by_domain else 0
                batches[shard].enqueue.append(entry(d, payload, score))
            for frontier, batch in zip(frontiers, batches, strict=True):
                if batch.enqueue:
                    await frontier.sync(batch)
            # only now drop the records: a crash in between requeues twice, never loses
            async with client.pipeline(transaction=False) as pipe:
                for d, _, _ in chunk:
                    pipe.lrem(keys.deadletter, 1, d.raw)  # type: ignore[arg-type]  # bytes work
                await pipe.execute()
            done += len(chunk)
    finally:
        await client.aclose()
    return done


def _purge(client: redis.Redis, key: str, letters: list[tuple[int, DeadLetter]]) -> int:
    removed = 0
    for i in range(0, len(letters), CHUNK):
        pipe = client.pipeline(transaction=False)
        for _, d in letters[i : i + CHUNK]:
            pipe.lrem(key, 1, d.raw)  # type: ignore[arg-type]  # bytes work
        removed += sum(pipe.execute())
    return removed


@main.command()
@click.argument("spider")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line instead of a table.")
@click.option("--reason", metavar="R", help="Only records with this reason (e.g. 500, DownloadTimeoutError).")
@click.option("--limit", type=click.IntRange(0),
              help=f"Show only the last N records (table default: {TABLE_ROWS}; 0: all).")
@click.option("--requeue", is_flag=True, help="Put the requests back in the frontier, retry counts reset.")
@click.option("--purge", is_flag=True, help="Delete the records (with --reason: only the matching ones).")
@force_option
@pass_redis
def dead(
    redis: ClientFactory, spider: str, as_json: bool, reason: str | None, limit: int | None,
    requeue: bool, purge: bool, force: bool,
) -> None:
    """List (or --requeue, or --purge) the dead letters of SPIDER's crawl: requests that finally failed."""
    if requeue and purge:
        raise click.UsageError("--requeue and --purge cannot be combined")
    redis.check_spider(spider, force)
    redis.check()
    keys = redis.keys(spider)
    key = keys.deadletter
    client = redis.client()
    try:
        if purge and reason is None:
            n = client.llen(key)
            client.delete(key)
            click.echo(f"purged {n:,} dead letters from {key!r}")
            return
        letters, bad = select(client, key, reason)
        for index, raw, why in bad[:BAD_SHOWN]:
            click.echo(f"skipped malformed record #{index} ({printable(why, 200)}): {raw[:80]!r}", err=True)
        if len(bad) > BAD_SHOWN:
            click.echo(f"... and {len(bad) - BAD_SHOWN:,} more malformed records skipped", err=True)
        if purge:
            removed = _purge(client, key, letters)
            click.echo(f"purged {removed:,} dead letters with reason {reason!r} from {key!r}")
            return
        if requeue:
            targets, refused = requeue_targets(letters, redis.dist, keys)
            for d, why in refused:
                click.echo(f"kept {printable(d.url, 300)} (cannot be requeued: {printable(why, 300)})",
                           err=True)
            done = asyncio.run(requeue_letters(redis, keys, targets)) if targets else 0
            click.echo(f"requeued {done:,} dead letters into {keys.queue!r}; {len(refused):,} kept")
            return
        _show(letters, key, as_json, limit)
    finally:
        client.close()


def _show(letters: list[tuple[int, DeadLetter]], key: str, as_json: bool, limit: int | None) -> None:
    total = len(letters)
    if limit is None and not as_json:
        limit = TABLE_ROWS
    shown = letters[-limit:] if limit else letters
    if as_json:
        for index, d in shown:
            click.echo(json_safe(json.dumps({"index": index, **d.as_dict()}, ensure_ascii=False)))
        return
    if not total:  # no empty table
        click.echo(f"0 dead letters in {key!r}")
        return
    _table(shown, key)
    counts = Counter(d.reason for _, d in letters)
    summary = ", ".join(f"{printable(r, 80)}: {n:,}" for r, n in counts.most_common(20))
    hidden = f" (showing the last {len(shown):,}; --limit 0 shows all)" if len(shown) < total else ""
    noun = "dead letter" if total == 1 else "dead letters"
    click.echo(f"{total:,} {noun}{hidden}" + (f" -- {summary}" if summary else ""))
