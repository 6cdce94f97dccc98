"""``scrapy-dist items <spider> [--follow] [--json-lines] [--export FILE]``: print the items a crawl wrote
to Redis, or move them to a file (:mod:`scrapy_dist.cli.export`).

Reads ``REDIS_ITEMS_KEY`` without consuming it: a LIST with ``LRANGE`` from an offset (``--follow`` polls
``LLEN``), a STREAM with ``XRANGE`` (``--follow`` blocks in ``XREAD``). A LIST a consumer pops from shifts
under the offset (items skipped or shown twice): use a STREAM when items are consumed and watched at once.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from scrapy_dist.cli import ClientFactory, force_option, main, pass_redis
from scrapy_dist.cli.export import export
from scrapy_dist.cli.text import json_safe, printable
from scrapy_dist.pipelines import STREAM_FIELD

#: Items read per round trip.
CHUNK = 500
#: How often ``--follow`` looks for new LIST items or for the key to appear (seconds).
POLL_SECONDS = 0.5
#: How long one blocking ``XREAD`` waits (milliseconds), so Ctrl-C is noticed promptly.
BLOCK_MS = 1000


# Clients are typed ``Any``: redis-py's reply unions (bytes | str | None | ...) would need a cast per line.
def _type(client: Any, key: str) -> str:
    found = client.type(key)
    return found.decode() if isinstance(found, bytes) else str(found)


def list_entries(
    client: Any, key: str, follow: bool, poll: float = POLL_SECONDS
) -> Iterator[tuple[str, bytes]]:
    """``(position, raw item)`` for each LIST element from the first; with ``follow``, forever."""
    offset = 0
    while True:
        chunk = client.lrange(key, offset, offset + CHUNK - 1)
        for i, raw in enumerate(chunk):
            yield str(offset + i), raw
        offset += len(chunk)
        if len(chunk) == CHUNK:
            continue
        if not follow:
            return
        time.sleep(poll)


def stream_entries(client: Any, key: str, follow: bool) -> Iterator[tuple[str, bytes]]:
    """``(entry id, raw item)`` for each STREAM entry from the first; with ``follow``, forever."""
    last = "-"
    while True:
        chunk = client.xrange(key, min=last if last == "-" else f"({last}", count=CHUNK)
        for entry_id, fields in chunk:
            last = entry_id.decode()
            yield last, fields.get(STREAM_FIELD.encode(), b"")
        if len(chunk) == CHUNK:
            continue
        if not follow:
            return
        start = "0-0" if last == "-" else last
        while True:
            got = client.xread({key: start}, count=CHUNK, block=BLOCK_MS)
            if got:
                for entry_id, fields in got[0][1]:
                    start = entry_id.decode()
                    yield start, fields.get(STREAM_FIELD.encode(), b"")


def entries(client: Any, key: str, follow: bool) -> Iterator[tuple[str, bytes]]:
    """The entries of the items key, LIST or STREAM; with ``follow``, waits for the key to appear."""
    kind = _type(client, key)
    while kind == "none" and follow:
        time.sleep(POLL_SECONDS)
        kind = _type(client, key)
    if kind == "list":
        yield from list_entries(client, key, follow)
    elif kind == "stream":
        yield from stream_entries(client, key, follow)
    elif kind != "none":
        raise click.ClickException(f"{key!r} is a Redis {kind}, not an items LIST or STREAM")


def _format(position: str, raw: bytes, json_lines: bool) -> tuple[str | None, str | None]:
    """(stdout text, stderr warning) for one entry."""
    try:
        item: Any = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):  # JSONDecodeError is a ValueError
        text = raw.decode("utf-8", "replace")
        if json_lines:
            return None, f"skipped entry {printable(position)}: not JSON: {text[:80]!r}"
        return f"--- {printable(position)} (not JSON)\n{printable(text, keep_newlines=True)}", None
    try:
        if json_lines:
            return json_safe(json.dumps(item, ensure_ascii=False, separators=(",", ":"))), None
        return f"--- {printable(position)}\n{json_safe(json.dumps(item, ensure_ascii=False, indent=2))}", None
    except (ValueError, RecursionError):  # NaN is read but a strict consumer would choke on it
        return None, f"skipped entry {printable(position)}: not printable as JSON"



@main.command()
@click.argument("spider")
@click.option("--follow", "-f", is_flag=True, help="Keep printing items as they arrive (Ctrl-C stops).")
@click.option("--json-lines", "-j", is_flag=True, help="One compact JSON document per line, nothing else.")
@click.option("--export", "export_to", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Move the items to this file (JSON Lines, or CSV for a .csv name), removing each chunk"
                   " from Redis only once the file is fsynced; run again to resume.")
@click.option("--format", "fmt", type=click.Choice(["jsonl", "csv"]), default=None,
              help="--export's format (default: from the file name).")
@force_option
@pass_redis
def items(redis: ClientFactory, spider: str, follow: bool, json_lines: bool, force: bool,
          export_to: Path | None, fmt: str | None) -> None:
    """Print the items SPIDER's crawl wrote to Redis (RedisPipeline's REDIS_ITEMS_KEY), or move them to a
    file (--export)."""
    redis.check_spider(spider, force)
    redis.check()
    key = redis.keys(spider).items
    client = redis.client()
    if export_to is not None:
        try:
            moved, skipped = export(client, key, export_to, fmt, progress=sys.stderr.isatty())
        finally:
            client.close()
        extra = f" ({skipped:,} not JSON objects, left out of the CSV)" if skipped else ""
        click.echo(f"{moved:,} items moved from {key!r} to {export_to}{extra}", err=True)
        return
    count = 0
    try:
        for position, raw in entries(client, key, follow):
            out, warning = _format(position, raw, json_lines)
            if warning:
                click.echo(warning, err=True)
            if out is not None:
                click.echo(out)
                count += 1
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:  # `scrapy-dist items x | head`: stop quietly, like other Unix tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    finally:
        client.close()
    if not json_lines:
        click.echo(f"{count:,} items in {key!r}", err=True)
