"""``scrapy-dist push`` (seeds in, checked as spiders check them) and ``items`` (read, or ``--export``ed)."""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import itertools
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

from scrapy_dist.cli import ClientFactory, console, json_safe, printable, spider_command
from scrapy_dist.exceptions import RejectedEntry
from scrapy_dist.pipelines import STREAM_FIELD
from scrapy_dist.redis.scripts import register, text
from scrapy_dist.seeds import SeedRules, class_has_callback, iter_lines, parse_seed

if TYPE_CHECKING:
    import redis

CHUNK = 2000  #: Seeds per RPUSH/SADD/ZADD command.
CHUNKS_PER_ROUND_TRIP = 10  #: Commands pipelined per round trip.
PROGRESS_MIN_BYTES = 1 << 20  #: Files at least this large get a progress bar (bytes).
EXAMPLES = 5  #: Rejected seeds shown individually.
ITEMS_CHUNK = 500  #: Items read per round trip.
EXPORT_CHUNK = 1000  #: Items moved per export round (a chunk is one append, one fsync, one removal).
POLL_SECONDS = 0.5  #: How often ``--follow`` looks for new LIST items or for the key to appear (seconds).
BLOCK_MS = 1000  #: How long one blocking ``XREAD`` waits (milliseconds), so Ctrl-C is noticed promptly.


@dataclass
class PushReport:
    """What :func:`push_seeds` did."""

    accepted: int = 0  #: valid seeds (pushed, unless a dry run)
    pushed: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    examples: list[tuple[str, str, str]] = field(default_factory=list)  #: (where, reason, detail), the first
    seconds: float = 0.0


@dataclass(frozen=True)
class PushOptions:
    """How seeds are checked and written."""

    kind: str = "list"
    rules: SeedRules = SeedRules()
    has_callback: Callable[[str], bool] | None = None
    priority: int | None = None  #: for seeds that set none (ZSET: the score)
    meta: dict[str, Any] | None = None  #: merged into every seed's meta (the seed's own keys win)
    dry_run: bool = False


def prepare(raw: bytes, opts: PushOptions) -> tuple[bytes, float]:
    """One seed's bytes to push (JSON if --priority/--meta change it) and ZSET score; raises RejectedEntry."""
    seed = parse_seed(raw, opts.rules, opts.has_callback)
    score = float(seed.priority if seed.priority is not None else opts.priority or 0)
    fill = opts.priority is not None and seed.priority is None and opts.kind != "zset"
    if not fill and not opts.meta:
        return raw, score
    if fill:
        seed.priority = opts.priority
    if opts.meta:
        seed.meta = {**opts.meta, **(seed.meta or {})}
    if len(out := seed.to_json().encode()) > opts.rules.max_bytes:
        raise RejectedEntry("too_large", f"{len(out)} bytes with --meta/--priority > {opts.rules.max_bytes}")
    return out, score


def push_seeds(client: redis.Redis, key: str, seeds: Iterable[tuple[str, bytes]],
               opts: PushOptions = PushOptions()) -> PushReport:
    """Validate ``seeds`` (``(where, raw)`` pairs) and push the valid ones to ``key`` in pipelined chunks."""
    report = PushReport()
    started = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    command = {"list": "RPUSH", "set": "SADD"}.get(opts.kind, "ZADD")
    per_seed = 2 if opts.kind == "zset" else 1
    buf: list[Any] = []

    def flush(last: bool = False) -> None:
        if buf:
            pipe.execute_command(command, key, *buf)
            report.pushed += 0 if opts.dry_run else len(buf) // per_seed
            buf.clear()
        if last or len(pipe) >= CHUNKS_PER_ROUND_TRIP:
            if len(pipe) and not opts.dry_run:
                pipe.execute()
            pipe.reset()
    for where, raw in seeds:
        try:
            value, score = prepare(raw, opts)
        except RejectedEntry as exc:
            report.rejected[exc.reason] += 1
            if len(report.examples) < EXAMPLES:
                report.examples.append((where, exc.reason, exc.detail))
            continue
        report.accepted += 1
        buf.extend([repr(score), value] if opts.kind == "zset" else [value])
        if len(buf) >= CHUNK * per_seed:
            flush()
    flush(last=True)
    report.seconds = time.perf_counter() - started
    return report


def _parse_meta(_ctx: click.Context, _param: click.Parameter, text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        meta = json.loads(text)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--meta") from None
    if not isinstance(meta, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--meta")
    try:
        parse_seed(json.dumps({"url": "http://example.com/", "meta": meta}).encode())
    except RejectedEntry as exc:
        raise click.BadParameter(str(exc), param_hint="--meta") from None
    return meta


@spider_command
@click.argument("urls", nargs=-1)
@click.option("--file", "file", type=click.Path(exists=True, dir_okay=False, readable=True, allow_dash=True),
              help="Read seeds from FILE, one a line ('-' = stdin; blank lines and # comments skipped).")
@click.option("--priority", type=click.IntRange(-(2**31), 2**31 - 1),
              help="Priority of seeds that set none (the score, for a ZSET seeds key).")
@click.option("--meta", metavar="JSON", callback=_parse_meta,
              help="JSON object merged into every seed's meta.")
@click.option("--dry-run", is_flag=True, help="Validate only; push nothing.")
def push(redis: ClientFactory, spider: str, urls: tuple[str, ...], file: str | None, priority: int | None,
         meta: dict[str, Any] | None, dry_run: bool, force: bool) -> None:
    """Validate seeds (URLs or JSON objects) and push them to SPIDER's seeds key.

    Exits with status 1 when a seed was rejected (the valid ones are pushed all the same)."""
    if not urls and file is None:
        raise click.UsageError("give URLs and/or --file FILE (- for stdin)")
    if not dry_run:
        redis.require_configured()
    redis.check_spider(spider, force)
    spidercls, ds = redis.spider_settings(spider)  # its custom_settings may change the seeds settings
    keys, kind = redis.keys(spider), ds.seeds.kind
    opts = PushOptions(kind, SeedRules.from_dist(ds), priority=priority, meta=meta, dry_run=dry_run,
                       has_callback=None if spidercls is None else class_has_callback(spidercls))
    if spidercls is None:
        click.echo(f"No spider {spider!r} in a Scrapy project here: callback names are checked for form"
                   " only, with the default seed settings.", err=True)
    client = redis.client()
    if not dry_run:
        redis.check()
        if (actual := text(client.type(keys.start_urls))) not in ("none", kind):
            raise click.ClickException(f"{keys.start_urls!r} is a {actual}, but {spider} reads a {kind}"
                                       " (REDIS_START_URLS_AS_SET / REDIS_START_URLS_AS_ZSET)")

    def sources(on_bytes: Callable[[int], None]) -> Iterator[tuple[str, bytes]]:
        for i, url in enumerate(urls, 1):
            yield f"argument {i}", os.fsencode(url)
        if file is not None:
            with click.open_file(file, "rb") as fh:  # "-": stdin, left open
                for number, line in enumerate(fh, 1):
                    on_bytes(len(line))
                    for raw in iter_lines((line,)):
                        yield f"{'stdin' if file == '-' else file}:{number}", raw
    size = os.path.getsize(file) if file not in (None, "-") else 0
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TimeRemainingColumn(), console=console(stderr=True), transient=True,
                  disable=size < PROGRESS_MIN_BYTES or not sys.stderr.isatty()) as bar:
        task = bar.add_task(f"pushing {os.path.basename(str(file))}", total=size)
        report = push_seeds(client, keys.start_urls, sources(lambda n: bar.advance(task, n)), opts)
    hints = [] if dry_run else redis.seed_hints(client, keys)
    client.close()
    rejected = report.rejected.total()
    rate = (report.accepted + rejected) / report.seconds if report.seconds > 0 else 0.0
    plural = "" if report.pushed == 1 else "s"
    head = (f"Dry run: {report.accepted:,} valid seeds for {keys.start_urls!r} ({kind}), nothing pushed"
            if dry_run else f"Pushed {report.pushed:,} seed{plural} to {keys.start_urls!r} ({kind})")
    click.echo(f"{head} in {report.seconds:.2f}s ({rate:,.0f} seeds/s); rejected {rejected:,}.")
    for hint in hints:
        click.echo(f"Note: {hint.hint()} No crawl reads that key: its seeds wait there for ever.", err=True)
    if report.rejected:
        reasons = ", ".join(f"{reason} {n:,}" for reason, n in report.rejected.most_common())
        click.echo(f"Rejected: {reasons}", err=True)
        for where, reason, detail in report.examples:
            click.echo(f"  {where}: {reason}" + (f" ({detail})" if detail else ""), err=True)
        if hidden := rejected - len(report.examples):
            click.echo(f"  ... and {hidden:,} more (only the first {EXAMPLES} are shown)", err=True)
        raise SystemExit(1)


# Clients are typed ``Any``: redis-py's reply unions (bytes | str | None | ...) would need a cast per line.
def items_kind(client: Any, key: str) -> str:
    """``list``, ``stream`` or ``none``: the type of the items key; one line for any other type."""
    if (kind := text(client.type(key))) not in ("list", "stream", "none"):
        raise click.ClickException(f"{key!r} is a Redis {kind}, not an items LIST or STREAM")
    return kind


def entries(client: Any, key: str, follow: bool, kind: str | None = None) -> Iterator[tuple[Any, bytes]]:
    """``(LIST index or STREAM id, raw item)`` for each item of ``key``; with ``follow``, waits for more."""
    if kind is None:
        while (kind := items_kind(client, key)) == "none" and follow:
            time.sleep(POLL_SECONDS)
    after: Any = 0 if kind == "list" else "0-0"  # the next LIST index, the last STREAM id read
    while kind in ("list", "stream"):
        if kind == "list":
            rows = list(enumerate(client.lrange(key, after, after + ITEMS_CHUNK - 1), after))
        else:
            reply = client.xread({key: after}, count=ITEMS_CHUNK, block=BLOCK_MS if follow else None)
            rows = [(i.decode(), f.get(STREAM_FIELD.encode(), b"")) for i, f in reply[0][1]] if reply else []
        yield from rows
        if rows:
            after = rows[-1][0] + 1 if kind == "list" else rows[-1][0]
        if len(rows) < ITEMS_CHUNK:
            if not follow:
                return
            if kind == "list":  # a STREAM read blocks instead
                time.sleep(POLL_SECONDS)


def _format_item(position: Any, raw: bytes, json_lines: bool) -> tuple[str, bool]:
    """The text for one entry, and whether it is a warning (for stderr) that the entry was skipped."""
    try:
        item: Any = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):  # JSONDecodeError is a ValueError
        decoded = raw.decode("utf-8", "replace")
        if json_lines:
            return f"skipped entry {printable(position)}: not JSON: {decoded[:80]!r}", True
        return f"--- {printable(position)} (not JSON)\n{printable(decoded, keep_newlines=True)}", False
    try:
        if json_lines:
            return json_safe(json.dumps(item, ensure_ascii=False, separators=(",", ":"))), False
        document = json_safe(json.dumps(item, ensure_ascii=False, indent=2))
    except (ValueError, RecursionError):  # NaN is read but a strict consumer would choke on it
        return f"skipped entry {printable(position)}: not printable as JSON", True
    return f"--- {printable(position)}\n{document}", False


@spider_command
@click.option("--follow", "-f", is_flag=True, help="Keep printing items as they arrive (Ctrl-C stops).")
@click.option("--json-lines", "-j", is_flag=True, help="One compact JSON document per line, nothing else.")
@click.option("--export", "export_to", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Move the items to this file (JSON Lines, or CSV for a .csv name), removing each chunk"
                   " from Redis only once the file is fsynced; run again to resume.")
@click.option("--format", "fmt", type=click.Choice(["jsonl", "csv"]), default=None,
              help="--export's format (default: from the file name).")
def items(redis: ClientFactory, spider: str, follow: bool, json_lines: bool, force: bool,
          export_to: Path | None, fmt: str | None) -> None:
    """Print the items SPIDER's crawl wrote to Redis (REDIS_ITEMS_KEY), or move them to a file (--export)."""
    key, count = redis.crawl(spider, force).items, 0
    with redis.client() as client:
        if export_to is not None:
            moved, skipped = export(client, key, export_to, fmt, progress=sys.stderr.isatty())
            extra = f" ({skipped:,} not JSON objects, left out of the CSV)" if skipped else ""
            click.echo(f"{moved:,} items moved from {key!r} to {export_to}{extra}", err=True)
            return
        try:
            for position, raw in entries(client, key, follow):
                text, skipped = _format_item(position, raw, json_lines)
                click.echo(text, err=skipped)
                count += not skipped
        except KeyboardInterrupt:
            pass
        except BrokenPipeError:  # `scrapy-dist items x | head`: stop quietly, like other Unix tools
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return
    if not json_lines:
        click.echo(f"{count:,} items in {key!r}", err=True)


class Exporter:
    """Moves the items of ``key`` (LIST or STREAM) to ``path`` in ``fmt`` ("jsonl" or "csv")."""

    def __init__(self, client: Any, key: str, path: Path, fmt: str) -> None:
        self.client, self.key, self.path, self.fmt = client, key, path, fmt
        self.journal = path.with_name(path.name + ".export")
        self._trim = register(client, "items_trim")
        self.fields: list[str] | None = None
        self.skipped = 0

    def remaining(self) -> int:
        stream = items_kind(self.client, self.key) == "stream"
        return int(self.client.xlen(self.key) if stream else self.client.llen(self.key))  # a missing key: 0

    def recover(self) -> None:
        """Finish the removal of a chunk an earlier run wrote and fsynced but may not have removed."""
        if self.journal.exists():
            self._remove(json.loads(self.journal.read_text()))
            self.journal.unlink()

    def _remove(self, entry: dict[str, Any]) -> None:
        if entry["kind"] == "stream":
            if entry["ids"]:  # a journal is a file on disk: an empty list would be XDEL with no id
                self.client.xdel(self.key, *entry["ids"])
        else:  # trimmed only if still the head it was read from (else removed already, or popped)
            self._trim(keys=[self.key], args=[entry["n"], entry["sha1"]])

    def step(self) -> int:
        """Move one chunk; how many items it held (0: the key is empty)."""
        kind = items_kind(self.client, self.key)
        rows = list(itertools.islice(entries(self.client, self.key, False, kind), EXPORT_CHUNK))
        values = [raw for _, raw in rows]
        digest = hashlib.sha1(b"\n".join(values)).hexdigest()  # as items_trim.lua computes it
        entry: dict[str, Any] = ({"kind": "list", "n": len(values), "sha1": digest} if kind == "list"
                                 else {"kind": "stream", "ids": [i for i, _ in rows]})
        if not values:
            return 0
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        _write_synced(self.path, self._encode(values, fresh), "ab")
        _write_synced(self.journal, json.dumps(entry).encode(), "wb")
        self.recover()  # the removal, as a later run would finish it
        return len(values)

    def _encode(self, values: list[bytes], fresh: bool) -> bytes:
        if self.fmt == "jsonl":
            return b"".join(v.rstrip(b"\n") + b"\n" for v in values)
        items = []
        for raw in values:
            with contextlib.suppress(ValueError):
                if isinstance(item := json.loads(raw), dict):
                    items.append(item)
        self.skipped += len(values) - len(items)  # a CSV row needs named fields
        if self.fields is None and fresh:
            self.fields = list(dict.fromkeys(k for i in items for k in i))
        elif self.fields is None:
            with open(self.path, newline="") as fh:
                self.fields = next(csv.reader(fh), [])
        out = io.StringIO()
        writer = csv.DictWriter(out, self.fields, extrasaction="ignore")
        if fresh:
            writer.writeheader()
        for item in items:
            writer.writerow({k: v if isinstance(v, (str, int, float)) else json.dumps(v)
                             for k, v in item.items()})
        return out.getvalue().encode()


def _write_synced(path: Path, data: bytes, mode: str) -> None:
    with open(path, mode) as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def export(client: Any, key: str, path: Path, fmt: str | None, progress: bool = True) -> tuple[int, int]:
    """Move every item of ``key`` to ``path``; (items moved, items skipped). Resumes an earlier run."""
    exporter = Exporter(client, key, path, fmt or ("csv" if path.suffix.lower() == ".csv" else "jsonl"))
    exporter.recover()
    moved = 0
    with Progress("exporting", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  disable=not progress) as bar:
        task = bar.add_task("items", total=exporter.remaining() if progress else None)
        while n := exporter.step():
            moved += n
            if progress:
                bar.update(task, advance=n, total=max(moved + exporter.remaining(), moved))
    return moved, exporter.skipped
