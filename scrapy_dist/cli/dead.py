"""``scrapy-dist dead <spider>`` (list, requeue or purge dead letters, docs/retries.md) and
``scrapy-dist forget`` (make URLs new again, end their revisit chains: docs/continuous.md).

``--requeue`` goes through the frontier's ``sync`` script (no deduplication), then removes the records one by
one with ``LREM``: an interrupted requeue requeues some requests twice rather than losing any. Records are
untrusted: malformed ones are reported on stderr, never requeued, and only purged by ``--purge`` without
``--reason``.

``forget``: the exact filters remove the fingerprint; the bloom filter cannot, so ``"<h1>:<h2>"`` goes into
the ``{spider}:forgotten`` SET it consults first. With shards, each fingerprint is forgotten on its URL's
shard. Fingerprints are made as workers make them (``REQUEST_FINGERPRINTER_CLASS``, ``GET <url>``); other
requests are named with ``--fingerprint``. A new token in the control hash's ``forgets`` field makes every
worker drop its memory of the links it sent.
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

from scrapy_dist.cli import ClientFactory, console, force_option, json_safe, main, pass_redis, printable
from scrapy_dist.exceptions import RejectedEntry
from scrapy_dist.frontier import orders as queue
from scrapy_dist.frontier.layout import parse_control
from scrapy_dist.frontier.orders import (
    DeadLetter,
    DomainLimits,
    parse_record,
    reason_matches,
    requeue_payload,
)
from scrapy_dist.frontier.shard import Frontier, SyncBatch, domain_shard
from scrapy_dist.settings import DistSettings
from scrapy_dist.wire.codec import EntryPolicy

if TYPE_CHECKING:
    import redis

    from scrapy_dist.redis.keys import CrawlKeys

#: Malformed records named one by one on stderr (the rest are counted).

import secrets
from collections import defaultdict
from typing import IO

from scrapy import Spider
from scrapy.utils.misc import build_from_crawler

from scrapy_dist.dupefilter import BloomDupeFilter, RedisDupeFilter, SetDupeFilter
from scrapy_dist.dupefilter.bloom import parse_bloom_record
from scrapy_dist.frontier.layout import end_chains, move_aside_foreign
from scrapy_dist.frontier.shard import shard_of
from scrapy_dist.redis.scripts import text

#: the control hash's field naming the last forget (a random token; the sync script answers it, lua/sync.lua)


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


FORGETS_FIELD = "forgets"
#: longest fingerprint accepted with --fingerprint (Scrapy's are 20 bytes; custom ones may differ)
MAX_FINGERPRINT_BYTES = 64


def project_fingerprinter(redis: ClientFactory) -> Any:
    """The fingerprinter the project's workers use (its ``REQUEST_FINGERPRINTER_CLASS``)."""
    from scrapy.crawler import Crawler

    settings = redis.settings
    path = settings.get("REQUEST_FINGERPRINTER_CLASS") or "scrapy.utils.request.RequestFingerprinter"
    cls = load_object(path)
    try:
        return build_from_crawler(cls, Crawler(Spider, settings))
    except Exception as exc:  # a custom class wanting more of a crawler than settings
        raise click.ClickException(
            f"cannot build REQUEST_FINGERPRINTER_CLASS {cls.__name__} outside a crawl ({exc}); name the"
            " requests with --fingerprint HEX instead"
        ) from None


def url_fingerprints(urls: list[str], fingerprinter: Any) -> list[bytes]:
    """The fingerprint of ``GET url`` for each URL; a bad URL stops the command in one line."""
    out = []
    for url in urls:
        try:
            out.append(bytes(fingerprinter.fingerprint(Request(url))))
        except ValueError as exc:
            raise click.ClickException(f"not a URL: {printable(url, 200)} ({exc})") from None
    return out


def hex_fingerprints(values: tuple[str, ...]) -> list[bytes]:
    out = []
    for value in values:
        try:
            fp = bytes.fromhex(value)
        except ValueError:
            fp = b""
        if not 1 <= len(fp) <= MAX_FINGERPRINT_BYTES:
            raise click.ClickException(
                f"--fingerprint {printable(value, 200)}: not a hexadecimal fingerprint"
            )
        out.append(fp)
    return out


def shard_filters(client: Any, keys: Any) -> list[RedisDupeFilter]:
    """The dupefilters one shard holds in Redis, built from what they recorded (a bloom filter's
    parameters are validated as untrusted: garbage stops the command in one line)."""
    out: list[RedisDupeFilter] = []
    found = text(client.type(keys.bloom))
    if found not in ("none", "hash"):  # the filter's parameters are unknown: nothing can be forgotten in it
        key = printable(keys.bloom, 200)
        raise click.ClickException(
            f"{key} is a {printable(found, 20)}, not the hash of the bloom filter's parameters (written by"
            f" someone else?): nothing was forgotten; look at it, then move it aside (RENAME {key}"
            f" {key}:garbage) or delete it"
        )
    fields = client.hgetall(keys.bloom)
    if fields:
        rec = parse_bloom_record(fields, keys.bloom)
        bloom = BloomDupeFilter(
            client, keys, None, ttl=rec.ttl or None, capacity=rec.capacity, error_rate=rec.error_rate,
            block_bits=rec.block_bits, generations=rec.generations,
        )
        bloom.adopt(rec)
        out.append(bloom)
    if client.exists(keys.fingerprints):
        out.append(SetDupeFilter(client, keys, None))
    if client.exists(keys.fingerprints_ttl):  # the TTL only matters to inserts, not to a forget
        out.append(SetDupeFilter(client, keys, None, ttl=1.0))
    return out



def forget_fingerprints(
    client: Any, keys: Any, fingerprints: list[bytes], domains: list[str | None] | None = None
) -> list[str]:
    """Forget ``fingerprints`` in every filter the crawl has, shard by shard, through each filter's own
    script (``dupe_batch`` "forget": ``lua/dupe.lua`` says what forgetting is for each kind); returns the
    kinds of filter told. ``domains``: each fingerprint's host (None: not known), for a sharded crawl
    routed by domain (crawl-wide politeness), where a fingerprint of unknown host goes to every shard."""
    move_aside_foreign(client, keys.control)
    control = parse_control(client.hgetall(keys.control))
    shards = keys.shards(control.shards or 1)
    by_domain = control.politeness == "cluster" and len(shards) > 1
    by_shard: dict[int, list[bytes]] = defaultdict(list)
    for fp, domain in zip(fingerprints, domains or [None] * len(fingerprints), strict=True):
        if not by_domain:
            by_shard[shard_of(fp, len(shards))].append(fp)
        elif domain is not None:
            by_shard[domain_shard(domain, len(shards))].append(fp)
        else:
            for i in range(len(shards)):
                by_shard[i].append(fp)
    kinds: set[str] = set()
    for index, fps in by_shard.items():
        for df in shard_filters(client, shards[index]):
            df.run_batch("forget", [df.fingerprint_tokens(fp) for fp in fps])
            kinds.add("bloom" if isinstance(df, BloomDupeFilter) else "exact")
    if kinds:  # a new forget generation: every worker drops its memory of the links it sent, at its next sync
        client.hset(keys.control, FORGETS_FIELD, secrets.token_hex(8))
    return sorted(kinds)


@main.command()
@click.argument("spider")
@click.argument("urls", nargs=-1)
@click.option("--file", "url_file", type=click.File("r"), help="URLs to forget, one per line ('-': stdin).")
@click.option("--fingerprint", "fingerprints", multiple=True, metavar="HEX",
              help="A request fingerprint (hex) to forget; repeatable.")
@force_option
@pass_redis
def forget(
    redis: ClientFactory, spider: str, urls: tuple[str, ...], url_file: IO[str] | None,
    fingerprints: tuple[str, ...], force: bool,
) -> None:
    """Make URLs new again for SPIDER's dupefilter: the next time they are found, they are fetched."""
    wanted = list(urls) + ([line.strip() for line in url_file if line.strip()] if url_file else [])
    if not wanted and not fingerprints:
        raise click.UsageError("name URLs, --file F or --fingerprint HEX")
    fps = hex_fingerprints(fingerprints)
    domains: list[str | None] = [None] * len(fps)
    redis.check_spider(spider, force)
    redis.check()
    if wanted:
        fps += url_fingerprints(wanted, project_fingerprinter(redis))
        domains += [(urlsplit(u).hostname or "").lower() for u in wanted]
    keys = redis.keys(spider)
    client = redis.client()
    try:
        kinds = forget_fingerprints(client, keys, fps, domains)
        control = parse_control(client.hgetall(keys.control))
        ended = end_chains(client, keys.shards(control.shards or 1), control.politeness == "cluster",
                           {u for w in wanted for u in (w, Request(w).url)}) if wanted else 0
    finally:
        client.close()
    chains = f"; ended {ended:,} scheduled revisits" if ended else ""
    if not kinds:
        click.echo(f"nothing to forget: the crawl of {spider!r} has no dupefilter in Redis{chains}")
        return
    click.echo(f"forgot {len(fps):,} fingerprints of {spider!r} ({' and '.join(kinds)} filter){chains}")
