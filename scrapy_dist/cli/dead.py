"""``scrapy-dist dead <spider>`` (list, requeue or purge dead letters: docs/retries.md) and ``scrapy-dist
forget`` (make URLs new again, end their revisit chains: docs/continuous.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections import Counter, defaultdict
from datetime import datetime, timezone
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import urlsplit

import click
import redis
from rich.table import Table
from rich.text import Text
from scrapy import Request, Spider
from scrapy.crawler import Crawler
from scrapy.utils.misc import build_from_crawler, load_object

from scrapy_dist.cli import ClientFactory, console, json_safe, printable, spider_command
from scrapy_dist.cli.push import entries
from scrapy_dist.dupefilter import BloomDupeFilter, RedisDupeFilter, SetDupeFilter
from scrapy_dist.dupefilter.bloom import parse_bloom_record
from scrapy_dist.exceptions import RejectedEntry
from scrapy_dist.frontier import orders as queue
from scrapy_dist.frontier.layout import end_chains, move_aside_foreign, parse_control
from scrapy_dist.frontier.orders import DeadLetter, parse_record, reason_matches, requeue_payload
from scrapy_dist.frontier.shard import Frontier, SyncBatch, domain_shard, shard_of
from scrapy_dist.redis.connection import build_async
from scrapy_dist.redis.scripts import text
from scrapy_dist.settings import SchedulerSettings
from scrapy_dist.wire.codec import EntryPolicy

if TYPE_CHECKING:
    from scrapy_dist.redis.keys import CrawlKeys
    from scrapy_dist.settings import DistSettings

BAD_SHOWN = 20  #: Malformed records named one by one on stderr (the rest are counted).
CHUNK = 500  #: Records requeued per ``sync`` call, or purged per round trip.
TABLE_ROWS = 100  #: Rows of the table when ``--limit`` is not given.
FORGETS_FIELD = "forgets"  #: control field; a new token makes every worker forget the links it sent
MAX_FINGERPRINT_BYTES = 64  #: longest --fingerprint accepted (Scrapy's are 20 bytes)

Letters = list[tuple[int, DeadLetter]]


def select(client: redis.Redis, key: str, reason: str | None) -> tuple[Letters, list[tuple[int, bytes, str]]]:
    """The valid records matching ``reason`` (all if ``None``), and the malformed ones."""
    good: Letters = []
    bad: list[tuple[int, bytes, str]] = []
    for index, raw in entries(client, key, follow=False, kind="list"):
        try:
            letter = parse_record(raw)
        except RejectedEntry as exc:
            bad.append((index, raw, exc.detail or exc.reason))
            continue
        if reason is None or reason_matches(letter.reason, reason):
            good.append((index, letter))
    return good, bad


def queue_order(ds: DistSettings) -> queue.QueueOrder:
    """The crawl's ``SCHEDULER_QUEUE_CLASS``, which scores and sequences entries."""
    cls: Any = queue.ALIASES.get(ds.scheduler.queue_class) or load_object(ds.scheduler.queue_class)
    return cls()  # type: ignore[no-any-return]


def requeue_targets(letters: Letters, ds: DistSettings, keys: CrawlKeys
                    ) -> tuple[list[tuple[DeadLetter, bytes, float]], list[tuple[DeadLetter, str]]]:
    """``(record, payload, queue score)`` for each requeueable record, and why the others are not."""
    order = queue_order(ds)
    # re-signs only records whose tag verifies as this crawl's dead letters
    policy = EntryPolicy.from_dist(ds).bound(crawl=keys.shard(0, 1).tag)
    ok: list[tuple[DeadLetter, bytes, float]] = []
    refused: list[tuple[DeadLetter, str]] = []
    for _, d in letters:
        if d.payload is None:
            refused.append((d, "the request could not be encoded when it failed"))
            continue
        try:
            payload, priority = requeue_payload(d.payload, ds.scheduler.allowed_schemes,
                                                ds.scheduler.max_entry_bytes, policy)
            score = float(order.score(Request(d.url or "http://x", priority=priority)))
        except RejectedEntry as exc:
            refused.append((d, str(exc)))
        except (ValueError, TypeError, OverflowError) as exc:  # e.g. a url Request() refuses
            refused.append((d, f"{type(exc).__name__}: {exc}"))
        else:
            ok.append((d, payload, score))
    return ok, refused


async def requeue_letters(factory: ClientFactory, keys: CrawlKeys,
                          targets: list[tuple[DeadLetter, bytes, float]]) -> int:
    """Enqueue ``targets`` with the frontier's sync script, then remove their records; returns how many."""
    client, ds = build_async(factory.target), factory.dist
    control = parse_control({})  # the crawl's own mode and shards; none recorded if the key is another type
    with contextlib.suppress(redis.ResponseError):  # (garbage: the workers move it aside)
        control = parse_control(await client.hgetall(keys.control))
    politeness = control.politeness or ds.scheduler.politeness
    limits = queue.DomainLimits.from_dist(ds)
    shards = keys.shards(control.shards or 1)
    # worker id "": a tool; requests need no dedupe: shard 0 takes them, with politeness their domain's shard
    config, sequence = SchedulerSettings(politeness=politeness), queue_order(ds).sequence
    frontiers = [Frontier(client, k, "", None, config, sequence, heartbeat=i == 0)
                 for i, k in enumerate(shards)]
    try:
        for i in range(0, len(targets), CHUNK):
            chunk = targets[i : i + CHUNK]
            batches = [SyncBatch() for _ in shards]
            for d, payload, score in chunk:
                domain = (urlsplit(d.url or "").hostname or "").lower()
                shard = domain_shard(domain, len(shards)) if politeness == "cluster" else 0
                limit = limits.for_domain(domain).encode()
                batches[shard].enqueue.append(("", "", score, payload, domain, limit))
            for frontier, batch in zip(frontiers, batches, strict=True):
                if batch.enqueue:
                    await frontier.sync(batch)
            # only now drop the records: a crash in between requeues twice, never loses
            async with client.pipeline(transaction=False) as pipe:
                for d, _, _ in chunk:
                    pipe.lrem(keys.deadletter, 1, d.raw)  # type: ignore[arg-type]  # bytes work
                await pipe.execute()
    finally:
        await client.aclose()
    return len(targets)


@spider_command
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line instead of a table.")
@click.option("--reason", metavar="R", help="Only records with this reason (e.g. 500, DownloadTimeoutError).")
@click.option("--limit", type=click.IntRange(0),
              help=f"Show only the last N records (table default: {TABLE_ROWS}; 0: all).")
@click.option("--requeue", is_flag=True, help="Put the requests back in the frontier, retry counts reset.")
@click.option("--purge", is_flag=True, help="Delete the records (with --reason: only the matching ones).")
def dead(redis: ClientFactory, spider: str, as_json: bool, reason: str | None, limit: int | None,
         requeue: bool, purge: bool, force: bool) -> None:
    """List (or --requeue, or --purge) the dead letters of SPIDER's crawl: requests that finally failed."""
    if requeue and purge:
        raise click.UsageError("--requeue and --purge cannot be combined")
    keys = redis.crawl(spider, force)
    key = keys.deadletter
    with redis.client() as client:
        if purge and reason is None:
            n, _ = client.pipeline(transaction=False).llen(key).delete(key).execute()
            click.echo(f"purged {n:,} dead letters from {key!r}")
            return
        letters, bad = select(client, key, reason)
        for index, raw, why in bad[:BAD_SHOWN]:
            click.echo(f"skipped malformed record #{index} ({printable(why, 200)}): {raw[:80]!r}", err=True)
        if len(bad) > BAD_SHOWN:
            click.echo(f"... and {len(bad) - BAD_SHOWN:,} more malformed records skipped", err=True)
        if purge:
            removed = 0
            for i in range(0, len(letters), CHUNK):
                pipe = client.pipeline(transaction=False)
                for _, d in letters[i : i + CHUNK]:
                    pipe.lrem(key, 1, d.raw)  # type: ignore[arg-type]  # bytes work
                removed += sum(pipe.execute())
            click.echo(f"purged {removed:,} dead letters with reason {reason!r} from {key!r}")
        elif requeue:
            targets, refused = requeue_targets(letters, redis.dist, keys)
            for d, why in refused:
                click.echo(f"kept {printable(d.url, 300)} (cannot be requeued: {printable(why, 300)})",
                           err=True)
            done = asyncio.run(requeue_letters(redis, keys, targets)) if targets else 0
            click.echo(f"requeued {done:,} dead letters into {keys.queue!r}; {len(refused):,} kept")
        else:
            _show(letters, key, as_json, limit)


def _when(at: float) -> str:
    with contextlib.suppress(ValueError, OverflowError, OSError):
        if at > 0:
            return datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    return "?"


def _show(letters: Letters, key: str, as_json: bool, limit: int | None) -> None:
    if limit is None and not as_json:
        limit = TABLE_ROWS
    shown = letters[-limit:] if limit else letters
    if as_json:
        for index, d in shown:
            click.echo(json_safe(json.dumps({"index": index, **d.as_dict()}, ensure_ascii=False)))
        return
    if not letters:  # no empty table
        click.echo(f"0 dead letters in {key!r}")
        return
    table = Table(title=f"dead letters in {key}", title_justify="left")
    for name in ("#", "at (UTC)", "reason", "status", "attempts", "worker", "url"):
        table.add_column(name, overflow="fold", no_wrap=name not in ("url", "reason"))
    for index, d in shown:  # Text, never markup: a worker id like "[/x]" is data
        table.add_row(f"{index:,}", _when(d.at), Text(printable(d.reason, 200)),
                      "" if d.status is None else str(d.status), f"{d.attempts:,}",
                      Text(printable(d.worker, 120)),
                      Text(printable(d.url, 2000) + ("" if d.payload is not None else "  (not requeueable)")))
    console().print(table)
    total = len(letters)
    counts = Counter(d.reason for _, d in letters).most_common(20)
    summary = ", ".join(f"{printable(r, 80)}: {n:,}" for r, n in counts)
    hidden = f" (showing the last {len(shown):,}; --limit 0 shows all)" if len(shown) < total else ""
    click.echo(f"{total:,} {'dead letter' if total == 1 else 'dead letters'}{hidden} -- {summary}")


def project_fingerprinter(redis: ClientFactory) -> Any:
    """The fingerprinter the project's workers use (its ``REQUEST_FINGERPRINTER_CLASS``)."""
    path = redis.settings.get("REQUEST_FINGERPRINTER_CLASS") or "scrapy.utils.request.RequestFingerprinter"
    cls = load_object(path)
    try:
        return build_from_crawler(cls, Crawler(Spider, redis.settings))
    except Exception as exc:  # a custom class wanting more of a crawler than settings
        raise click.ClickException(f"cannot build REQUEST_FINGERPRINTER_CLASS {cls.__name__} outside a crawl"
                                   f" ({exc}); name the requests with --fingerprint HEX instead") from None


def url_fingerprint(url: str, fingerprinter: Any) -> bytes:
    """The fingerprint of ``GET url``; a bad URL stops the command in one line."""
    try:
        return bytes(fingerprinter.fingerprint(Request(url)))
    except ValueError as exc:
        raise click.ClickException(f"not a URL: {printable(url, 200)} ({exc})") from None


def hex_fingerprint(value: str) -> bytes:
    with contextlib.suppress(ValueError):
        if 1 <= len(fp := bytes.fromhex(value)) <= MAX_FINGERPRINT_BYTES:
            return fp
    raise click.ClickException(f"--fingerprint {printable(value, 200)}: not a hexadecimal fingerprint")


def shard_filters(client: Any, keys: Any) -> list[RedisDupeFilter]:
    """The dupefilters one shard holds in Redis, built from what they recorded."""
    out: list[RedisDupeFilter] = []
    if (found := text(client.type(keys.bloom))) not in ("none", "hash"):
        key = printable(keys.bloom, 200)
        raise click.ClickException(f"{key} is a {printable(found, 20)}, not the hash of the bloom filter's"
                                   " parameters (written by someone else?): nothing was forgotten; look at"
                                   f" it, then move it aside (RENAME {key} {key}:garbage) or delete it")
    if fields := client.hgetall(keys.bloom):
        rec = parse_bloom_record(fields, keys.bloom)
        bloom = BloomDupeFilter(client, keys, None, ttl=rec.ttl or None, capacity=rec.capacity,
                                error_rate=rec.error_rate, block_bits=rec.block_bits,
                                generations=rec.generations)
        bloom.adopt(rec)
        out.append(bloom)
    if client.exists(keys.fingerprints):
        out.append(SetDupeFilter(client, keys, None))
    if client.exists(keys.fingerprints_ttl):  # the TTL only matters to inserts, not to a forget
        out.append(SetDupeFilter(client, keys, None, ttl=1.0))
    return out


def forget_fingerprints(client: Any, keys: Any, fps: list[bytes], domains: list[str | None]) -> list[str]:
    """Forget ``fps`` in every filter of the crawl (a bloom filter records them as forgotten); the
    kinds of filter told. ``domains``: each one's host (None: every shard of a crawl sharded by domain)."""
    move_aside_foreign(client, keys.control)
    control = parse_control(client.hgetall(keys.control))
    shards = keys.shards(control.shards or 1)
    by_domain = control.politeness == "cluster" and len(shards) > 1
    by_shard: dict[int, list[bytes]] = defaultdict(list)
    for fp, domain in zip(fps, domains, strict=True):
        if not by_domain:
            by_shard[shard_of(fp, len(shards))].append(fp)
        elif domain is not None:
            by_shard[domain_shard(domain, len(shards))].append(fp)
        else:
            for i in range(len(shards)):
                by_shard[i].append(fp)
    kinds: set[str] = set()
    for index, group in by_shard.items():
        for df in shard_filters(client, shards[index]):
            df.run_batch("forget", [df.fingerprint_tokens(fp) for fp in group])
            kinds.add("bloom" if isinstance(df, BloomDupeFilter) else "exact")
    if kinds:
        client.hset(keys.control, FORGETS_FIELD, secrets.token_hex(8))
    return sorted(kinds)


@spider_command
@click.argument("urls", nargs=-1)
@click.option("--file", "url_file", type=click.File("r"), help="URLs to forget, one per line ('-': stdin).")
@click.option("--fingerprint", "fingerprints", multiple=True, metavar="HEX",
              help="A request fingerprint (hex) to forget; repeatable.")
def forget(redis: ClientFactory, spider: str, urls: tuple[str, ...], url_file: IO[str] | None,
           fingerprints: tuple[str, ...], force: bool) -> None:
    """Make URLs new again for SPIDER's dupefilter: the next time they are found, they are fetched."""
    wanted = list(urls) + ([line.strip() for line in url_file if line.strip()] if url_file else [])
    if not wanted and not fingerprints:
        raise click.UsageError("name URLs, --file F or --fingerprint HEX")
    fps = [hex_fingerprint(value) for value in fingerprints]
    domains: list[str | None] = [None] * len(fps)
    keys = redis.crawl(spider, force)
    if wanted:
        fingerprinter = project_fingerprinter(redis)
        fps += [url_fingerprint(url, fingerprinter) for url in wanted]
        domains += [(urlsplit(u).hostname or "").lower() for u in wanted]
    with redis.client() as client:
        kinds = forget_fingerprints(client, keys, fps, domains)
        control = parse_control(client.hgetall(keys.control))
        ended = end_chains(client, keys.shards(control.shards or 1), control.politeness == "cluster",
                           {u for w in wanted for u in (w, Request(w).url)}) if wanted else 0
    chains = f"; ended {ended:,} scheduled revisits" if ended else ""
    if not kinds:
        click.echo(f"nothing to forget: the crawl of {spider!r} has no dupefilter in Redis{chains}")
        return
    click.echo(f"forgot {len(fps):,} fingerprints of {spider!r} ({' and '.join(kinds)} filter){chains}")
