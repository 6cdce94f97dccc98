"""``scrapy-dist forget SPIDER URL... | --file F | --fingerprint HEX``: make URLs new again.

After a forget, the next time a worker finds one of these URLs (a link, or a seed pushed again with
``REDIS_START_URLS_DEDUPE``) it is fetched again. Whatever filter the crawl has in Redis is told:

* the exact filters (``SetDupeFilter``: ``{spider}:fingerprints``, and ``{spider}:fingerprints:ttl`` with
  ``DUPEFILTER_TTL``) remove the fingerprint;
* the bloom filter cannot remove one item, so ``"<h1>:<h2>"`` of the fingerprint goes into the exact
  ``{spider}:forgotten`` SET, which the filter consults before its bits and empties as it admits: each
  forgotten URL is admitted once (``lua/dupe.lua``).

With ``SCHEDULER_SHARDS``, each fingerprint is forgotten in the shard its URL is routed to (with crawl-wide
politeness, its host's shard: a bare ``--fingerprint`` is then forgotten on every shard).

Fingerprints are made as the workers make them: the project's ``REQUEST_FINGERPRINTER_CLASS`` (Scrapy's
default outside a project). A URL alone stands for ``GET <url>`` with no body; a request the spider makes
differently (POST, headers the fingerprinter includes) is named with ``--fingerprint`` (its hex, as
``scrapy-dist dead --json`` or a log line shows it). A running worker of a crawl on Scrapy's own scheduler
keeps a per-process first-level filter: there, a forget takes effect for new workers. A scrapy-dist worker
also skips, for a while, links it sent itself (certainly known crawl-wide); a forget writes a new token
to the control hash's ``forgets`` field, which every worker's next sync answers, and a worker seeing it
change drops that memory: the forgotten URLs are fetched when found again, by any worker.
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
from scrapy_dist.dupefilter.bloom import parse_bloom_record
from scrapy_dist.dupefilter.filters import BloomDupeFilter, RedisDupeFilter, SetDupeFilter
from scrapy_dist.extensions.control import move_aside_foreign, parse_control
from scrapy_dist.frontier.shard import domain_shard, shard_of

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
    finally:
        client.close()
    if not kinds:
        click.echo(f"nothing to forget: the crawl of {spider!r} has no dupefilter in Redis")
        return
    click.echo(f"forgot {len(fps):,} fingerprints of {spider!r} ({' and '.join(kinds)} filter)")
