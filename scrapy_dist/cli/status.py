"""``scrapy-dist status|pause|resume|close <spider>`` and ``scrapy-dist items <spider>`` (print the items a
crawl wrote to Redis, or move them to a file with ``--export``, :func:`scrapy_dist.cli.push.export`).

``items`` reads ``REDIS_ITEMS_KEY`` without consuming it: a LIST with ``LRANGE`` from an offset (``--follow``
polls ``LLEN``), a STREAM with ``XRANGE`` (``--follow`` blocks in ``XREAD``). A LIST a consumer pops from
shifts under the offset: use a STREAM when items are consumed and watched at once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from scrapy_dist import seeds as nearmiss
from scrapy_dist.cli import (
    ClientFactory,
    console,
    force_option,
    json_safe,
    main,
    pass_redis,
    printable,
    project_spiders,
)
from scrapy_dist.frontier.layout import (
    close_crawl,
    end_chains,
    parse_control,
    pause_crawl,
    resume_crawl,
    valid_reason,
)
from scrapy_dist.monitor.status import read_status
from scrapy_dist.pipelines import STREAM_FIELD
from scrapy_dist.redis.outage import READ_ERRORS, describe

#: Items read per round trip.


_STATE_STYLE = {"running": "green", "lost": "bold red", "closed": "dim"}


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):  # a stat that is not a number: garbage from Redis
        return printable(value, 40)
    if isinstance(value, float):
        return f"{value:,.1f}"
    return f"{value:,}"


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.0f}h ago"


def back_in(leases: dict[str, Any]) -> str:
    """When held leases come back to the queue: ``back in the queue in 42 s, the last in 58 s``."""
    first, last = leases.get("first_in"), leases.get("last_in")
    if first is None:
        return "back in the queue when the leases expire"
    if not last:
        return "their leases have run out: back in the queue at the next sync of any worker"
    text = f"back in the queue in {first:,.0f} s"
    return text + (f", the last in {last:,.0f} s" if last - first >= 1 else "")


def _held(leases: dict[str, Any], state: str) -> Text:
    """Leases not in flight: prefetched by running workers (all that a paused crawl holds), and those of
    lost workers, which come back to the queue when they expire."""
    parts = [f"{leases['prefetched']:,} prefetched" + (" (paused: held, not crawled)" if state == "paused"
                                                       and leases["prefetched"] else "")]
    if leases["other"] and not leases["prefetched"]:
        parts = []
    if leases["other"]:
        parts.append(f"{leases['other']:,} by lost or just-started workers ({back_in(leases)})")
    return Text(", ".join(parts))


def held_text(status: dict[str, Any]) -> str:
    """``31 leased requests held by lost workers, back in the queue in 42 s`` while no worker runs and
    leases are held (a crawl stopped by a kill), else ``""``."""
    leases = status.get("leases") or {}
    if status["state"] != "stopped" or not leases.get("other"):
        return ""
    n = leases["other"]
    text = f"{n:,} leased request{'s' if n != 1 else ''} held by lost workers, {back_in(leases)}"
    if leases.get("first_in") is not None:
        text += "; a worker must run to requeue them"
    return text


def idle_text(status: dict[str, Any]) -> str:
    """``idle, next revisit in N s`` while nothing is queued or in flight and the delayed set holds
    something (a long-running crawl between two rounds of revisits), else ``""``."""
    front = status["frontier"]
    next_in = (status.get("revisits") or {}).get("next_in")
    if front["queued"] or front["inflight"] or next_in is None:
        return ""
    return f"idle, next revisit in {next_in:,.0f} s"


def render(status: dict[str, Any]) -> Group:
    """The status as rich renderables: a headline, the crawl's figures and the workers table."""
    rates, errors, front, seeds = status["rates"], status["errors"], status["frontier"], status["seeds"]
    spider = printable(status["spider"], 120)
    state = status["state"]
    idle = idle_text(status) or held_text(status)
    headline = Text.assemble(
        (spider, "bold"), "  ",
        (state, "bold yellow" if state == "paused" else "bold"), "  ",
        (f"{idle}  " if idle else ""),
        f"{_num(rates['pages_per_min'])} pages/min  ",
        "error rate " + ("-" if rates["error_rate"] is None else f"{rates['error_rate']:.1%}"),
        f" ({errors['errors']:,} errors / {errors['attempts']:,} attempts in {errors['window']:,.0f}s)"
        if errors["window"] else "",
    )
    overview = Table(show_header=False, box=None, padding=(0, 2))
    overview.add_column(style="bold")
    overview.add_column(justify="right")
    overview.add_column(style="bold")
    overview.add_column(justify="right")
    stats = status["stats"]
    shards = status.get("shards", 1)
    queued = f"Queued ({shards} shards)" if shards > 1 else "Queued"
    overview.add_row(queued, _num(front["queued"]), "Pages", _num(stats.get("response_received_count", 0)))
    leases = status.get("leases") or {}
    # a worker without the figures (older version): every lease counts as in flight
    known = leases.get("in_flight") is not None
    in_flight = leases["in_flight"] if known else front["inflight"]
    overview.add_row("In flight", _num(in_flight), "Items", _num(stats.get("item_scraped_count", 0)))
    overview.add_row("Delayed", _num(front["delayed"]), "Dead letters", _num(status["deadletter"]))
    revisits = status.get("revisits") or {}
    if revisits.get("scheduled") or revisits.get("next_in") is not None:
        overview.add_row("Revisits", _num(revisits.get("scheduled", 0)), "", "")
    overview.add_row("Seeds waiting", _num(seeds["waiting"] + seeds["processing"]),
                     "Rejected", f"{seeds['rejected']:,} seeds, {status['rejected']['queue']:,} queue")
    f = status["filter"]
    if f is None:
        filt = "-"
    elif f["kind"] == "garbage":
        filt = "unreadable (the filter's recorded parameters are garbage)"
    elif f["kind"] == "bloom":
        filt = (f"bloom, {f['items']:,} of {f['capacity']:,} ({f['fill']:.2%} full),"
                f" estimated false positives {f['fpr_estimate']:.2g}")
        if f.get("ttl"):
            filt += f"; forgets after {f['ttl']:g} s ({f['generations']} generations)"
    else:
        filt = f"exact, {f['items']:,} fingerprints"
    lines = [Text.assemble(("Filter  ", "bold"), filt)]
    if known and (leases["prefetched"] or leases["other"]):
        lines.append(Text.assemble(("Held  ", "bold"), _held(leases, state)))
    for hint in status.get("seed_hints") or []:
        lines.append(Text.assemble(("Seeds elsewhere  ", "bold yellow"),
                                   nearmiss.NearMiss(**hint).hint() + " (no crawl reads that key)"))
    if errors["reasons"]:
        top = ", ".join(f"{printable(r, 80)} {n:,}" for r, n in list(errors["reasons"].items())[:5])
        lines.append(Text.assemble(("Top errors  ", "bold"), top))

    summary = status["workers_summary"]
    title = (f"Workers: {summary['running']:,} running, {summary['lost']:,} lost, "
             f"{summary['closed']:,} closed")
    workers = Table(title=title, title_justify="left")
    workers.add_column("Worker", no_wrap=True)
    for name in ("State", "Seen", "Pages", "Items", "Errors", "Leases", "Pages/min"):
        workers.add_column(name, justify="left" if name == "State" else "right")
    for w in status["workers"][:50]:
        st = w["state"] + (f" ({printable(w['finish_reason'], 60)})" if w["finish_reason"] else "")
        workers.add_row(
            Text(printable(w["id"], 120)), Text(st, style=_STATE_STYLE.get(w["state"], "")),
            _ago(w["seen_ago"]),
            _num(w["pages"]), _num(w["items"]), _num(w["errors"]), _num(w["leases"]),
            _num(w["pages_per_min"]),
        )
    if len(status["workers"]) > 50:
        workers.caption = f"... and {len(status['workers']) - 50} more (see --json)"
    # no empty table: a crawl no worker has joined yet says so in one line
    parts: list[Any] = [workers if status["workers"] else Text(f"Workers: none yet (scrapy crawl {spider})")]
    if status.get("domains"):
        domains = Table(title="Busiest domains (crawl-wide politeness)", title_justify="left")
        domains.add_column("Domain", no_wrap=True)
        for name in ("Backlog", "In flight", "Delay", "Concurrency", "Next in"):
            domains.add_column(name, justify="right")
        for d in status["domains"]:
            domains.add_row(
                Text(printable(d["domain"], 120)), _num(d["backlog"]), _num(d["in_flight"]),
                f"{d['delay']:g}s",
                str(d["concurrency"] or "-"), f"{d['next_in']:.1f}s",
            )
        parts.append(domains)
    garbage = status.get("garbage") or {}
    if garbage.get("control") or garbage.get("workers") or garbage.get("stats"):
        what = [printable(p, 120) for p in garbage.get("control", [])]
        if garbage.get("workers"):
            what.append(f"{garbage['workers']:,} worker hashes with garbage fields (shown as -)")
        if garbage.get("stats"):
            what.append(f"{garbage['stats']:,} stats fields (numbers out of range, overlong names, over the"
                        " limit)")
        lines.append(Text.assemble(("Ignored garbage  ", "bold yellow"), "; ".join(what)))
    stamp = datetime.fromtimestamp(status["time"], tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    if status.get("redis"):
        stamp += f"  Redis {status['redis']['url']} ({status['redis']['source']})"
    return Group(headline, Text(stamp, style="dim"), overview, *lines, *parts)


def seed_hints(redis: ClientFactory, client: Any, keys: Any) -> list[nearmiss.NearMiss]:
    """Keys holding seeds that no crawl reads, close to the seeds key of ``keys`` (none if this Redis user
    may not ``SCAN``); inside a project, the seeds keys of its spiders count as read."""
    from redis.exceptions import ResponseError

    try:
        misses = nearmiss.find(client, keys)
    except ResponseError:  # NOPERM under an ACL without SCAN: the hint is not worth an error
        return []
    if misses and redis.inside_project:
        read = {redis.keys(name).start_urls for name in project_spiders(redis.settings) or []}
        misses = [m for m in misses if m.key not in read]
    return misses


@main.command()
@click.argument("spider")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (one object per refresh with --watch).")
@click.option("--watch", is_flag=True, help="Refresh until interrupted (Ctrl-C).")
@click.option("--interval", default=2.0, show_default=True, type=click.FloatRange(0.1),
              help="Seconds between refreshes with --watch.")
@force_option
@pass_redis
def status(
    redis: ClientFactory, spider: str, as_json: bool, watch: bool, interval: float, force: bool
) -> None:
    """Show the crawl of SPIDER: frontier, seeds, dead letters, filter, rates, workers and stats."""
    redis.check_spider(spider, force)
    redis.check(notice=False)  # the output names the Redis
    keys = redis.keys(spider)
    client = redis.client()
    default_interval = redis.dist.monitoring.interval or 5.0
    where = {"url": redis.masked_url, "source": redis.source}
    hints = [dataclasses.asdict(m) for m in seed_hints(redis, client, keys)]  # once, not every refresh

    def read() -> dict[str, Any]:
        status = read_status(client, keys, default_interval=default_interval)
        return {**status, "redis": where, "seed_hints": hints}

    if not watch:
        data = read()
        if as_json:
            click.echo(json_safe(json.dumps(data, indent=2)))
        else:
            console().print(render(data))
        return
    try:
        if as_json:
            while True:
                try:
                    data = read()
                except READ_ERRORS as exc:  # one object per refresh all the same, saying why
                    data = {"spider": spider, "time": time.time(),
                            "error": f"Redis unavailable ({describe(exc)})"}
                click.echo(json_safe(json.dumps(data)))
                time.sleep(interval)
        with Live(render(read()), console=console(), auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                try:
                    live.update(render(read()), refresh=True)
                except READ_ERRORS as exc:
                    live.update(Text(f"Redis unavailable ({exc}); retrying every {interval:g}s", style="red"),
                                refresh=True)
    except KeyboardInterrupt:
        pass


def _control_command(name: str, doc: str, act: Callable[[Any, Any], None], done: str) -> click.Command:
    """``scrapy-dist NAME SPIDER``: check the spider and the Redis, ``act(client, keys)``, print ``done``
    (``{name}`` is replaced by the spider's name, ``{quoted}`` by its quoted name)."""

    @main.command(name=name, help=doc)
    @click.argument("spider")
    @force_option
    @pass_redis
    def command(redis: ClientFactory, spider: str, force: bool) -> None:
        redis.check_spider(spider, force)
        redis.check()
        act(redis.client(), redis.keys(spider))
        click.echo(done.format(name=spider, quoted=repr(spider)))

    return command


pause = _control_command(
    "pause", "Pause the crawl of SPIDER: every worker stops taking new requests (within a second).",
    lambda client, keys: pause_crawl(client, keys.control, by="cli"),
    "Paused {quoted}: workers finish what they hold and take nothing new. Resume with `scrapy-dist resume "
    "{name}`.",
)
resume = _control_command(
    "resume", "Resume the crawl of SPIDER (after `scrapy-dist pause` or an error monitor pause).",
    lambda client, keys: resume_crawl(client, keys.control, keys.errors),
    "Resumed {quoted}: workers take new requests again (the error window starts afresh).",
)


def _reason(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    if not valid_reason(value):
        raise click.BadParameter(f"{value!r}: letters, digits and _.:- only, at most 64 characters")
    return value


@main.command(name="close")
@click.argument("spider")
@click.option("--reason", default="shutdown", show_default=True, callback=_reason,
              help="The finish reason the workers close with.")
@force_option
@pass_redis
def close(redis: ClientFactory, spider: str, reason: str, force: bool) -> None:
    """Close the crawl of SPIDER: every running worker closes gracefully (within a few seconds), also
    those of a crawl that never closes on its own (SCHEDULER_IDLE_BEFORE_CLOSE = None)."""
    redis.check_spider(spider, force)
    redis.check()
    client, keys = redis.client(), redis.keys(spider)
    close_crawl(client, keys.control, reason)
    control = parse_control(client.hgetall(keys.control))
    ended = end_chains(client, keys.shards(control.shards or 1), control.politeness == "cluster")
    click.echo(f"Closing {spider!r}: every running worker closes (reason {reason}); what they hold goes"
               f" back to the queue, and {ended:,} scheduled revisits end. Workers started from now on crawl"
               f" again (`scrapy-dist resume {spider}` clears the decision).")


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
        from scrapy_dist.cli.push import export  # push imports this module

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
