"""``scrapy-dist forget SPIDER URL... | --file F | --fingerprint HEX``: make URLs new again and end their
revisit chains (docs/continuous.md, "Forgetting URLs").

The exact filters remove the fingerprint; the bloom filter cannot, so ``"<h1>:<h2>"`` goes into the
``{spider}:forgotten`` SET it consults before its bits (``lua/dupe.lua``). With shards, each fingerprint is
forgotten on its URL's shard. Fingerprints are made as the workers make them (the project's
``REQUEST_FINGERPRINTER_CLASS``, for ``GET <url>``); other requests are named with ``--fingerprint``. A
forget also writes a new token to the control hash's ``forgets`` field: every worker's next sync sees it
change and drops its memory of the links it sent, so the URLs are fetched when found again, by any worker.
"""

from __future__ import annotations

import secrets
from collections import defaultdict
from typing import IO, Any
from urllib.parse import urlsplit

import click
from scrapy import Request, Spider
from scrapy.utils.misc import build_from_crawler, load_object

from scrapy_dist.cli import ClientFactory, force_option, main, pass_redis
from scrapy_dist.cli.text import printable
from scrapy_dist.dupefilter import BloomDupeFilter, RedisDupeFilter, SetDupeFilter
from scrapy_dist.dupefilter.bloom import parse_bloom_record
from scrapy_dist.frontier.control import move_aside_foreign, parse_control
from scrapy_dist.frontier.revisit import end_chains
from scrapy_dist.frontier.shard import domain_shard, shard_of
from scrapy_dist.redis.scripts import text

#: the control hash's field naming the last forget (a random token; the sync script answers it, lua/sync.lua)
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
