"""``scrapy-dist items SPIDER --export FILE``: move a crawl's items from Redis to a file, losing none.

Items are taken from the head of the items key in chunks. Each chunk is appended to FILE (JSON Lines, or
CSV for a ``.csv`` name or ``--format csv``), the file is flushed and fsynced, and only then is the chunk
removed from Redis (LIST: ``LTRIM``, STREAM: ``XDEL``). Between the two, a small journal beside the file
(``FILE.export``) names the chunk: an export stopped at any point (Ctrl-C, SIGKILL, Redis away) is started
again with the same command and goes on where it stopped, without writing a chunk twice -- the journal
says whether the chunk already in the file still has to leave Redis.

RedisPipeline only appends to the key, so the head a chunk was read from is still the head when it is
removed; the removal checks that it is (a script), so a concurrent consumer popping the same LIST makes
the export stop with an error rather than remove items it did not write.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import click

from scrapy_dist.pipelines import STREAM_FIELD

#: items moved per round (a chunk is one append, one fsync, one removal)
CHUNK = 1000

#: remove the first n elements of a LIST only if they are still the ones exported (their SHA-1 digest)
_TRIM_IF_HEAD = """
local head = redis.call('LRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)
if #head ~= tonumber(ARGV[1]) or redis.sha1hex(table.concat(head, '\\n')) ~= ARGV[2] then return 0 end
redis.call('LTRIM', KEYS[1], tonumber(ARGV[1]), -1)
return 1
"""


def _digest(values: list[bytes]) -> str:
    return hashlib.sha1(b"\n".join(values)).hexdigest()


class Exporter:
    """Moves the items of ``key`` (LIST or STREAM) to ``path`` in ``fmt`` ("jsonl" or "csv")."""

    def __init__(self, client: Any, key: str, path: Path, fmt: str) -> None:
        self.client = client
        self.key = key
        self.path = path
        self.fmt = fmt
        self.journal = path.with_name(path.name + ".export")
        self._trim = client.register_script(_TRIM_IF_HEAD)
        self.fields: list[str] | None = None
        self.skipped = 0

    def kind(self) -> str:
        found = self.client.type(self.key)
        return found.decode() if isinstance(found, bytes) else str(found)

    def remaining(self) -> int:
        kind = self.kind()
        if kind not in ("list", "stream"):
            return 0
        return int(self.client.llen(self.key) if kind == "list" else self.client.xlen(self.key))

    # -- the journal ------------------------------------------------------------------------------
    def recover(self) -> None:
        """Finish the removal of a chunk an earlier run wrote and fsynced but may not have removed."""
        if not self.journal.exists():
            return
        entry = json.loads(self.journal.read_text())
        self._remove(entry)
        self.journal.unlink()

    def _remove(self, entry: dict[str, Any]) -> None:
        if entry["kind"] == "stream":
            if entry["ids"]:
                self.client.xdel(self.key, *entry["ids"])
        elif not self._trim(keys=[self.key], args=[entry["n"], entry["sha1"]]):
            # not the head it was read from: removed already (the run stopped after the trim), or popped
            head = self.client.lrange(self.key, 0, entry["n"] - 1)
            if _digest(head) == entry["sha1"]:  # pragma: no cover - the script saw otherwise a moment ago
                raise click.ClickException("the items LIST changed while exporting")

    # -- one chunk --------------------------------------------------------------------------------
    def step(self) -> int:
        """Move one chunk; how many items it held (0: the key is empty)."""
        kind = self.kind()
        if kind == "list":
            values = self.client.lrange(self.key, 0, CHUNK - 1)
            entry: dict[str, Any] = {"kind": "list", "n": len(values), "sha1": _digest(values)}
        elif kind == "stream":
            rows = self.client.xrange(self.key, count=CHUNK)
            values = [fields.get(STREAM_FIELD.encode(), b"") for _, fields in rows]
            entry = {"kind": "stream", "ids": [i.decode() for i, _ in rows]}
        elif kind == "none":
            return 0
        else:
            raise click.ClickException(f"{self.key!r} is a Redis {kind}, not an items LIST or STREAM")
        if not values:
            return 0
        self._append(values)
        self.journal.write_text(json.dumps(entry))
        _fsync_path(self.journal)
        self._remove(entry)
        self.journal.unlink()
        return len(values)

    def _append(self, values: list[bytes]) -> None:
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        with open(self.path, "ab") as fh:
            fh.write(self._encode(values, fresh))
            fh.flush()
            os.fsync(fh.fileno())

    def _encode(self, values: list[bytes], fresh: bool) -> bytes:
        if self.fmt == "jsonl":
            return b"".join(v.rstrip(b"\n") + b"\n" for v in values)
        items = []
        for raw in values:
            try:
                item = json.loads(raw)
            except ValueError:
                item = None
            if not isinstance(item, dict):
                self.skipped += 1  # a CSV row needs named fields
                continue
            items.append(item)
        if self.fields is None:
            self.fields = self._header() if not fresh else list(dict.fromkeys(k for i in items for k in i))
        out = io.StringIO()
        writer = csv.DictWriter(out, self.fields, extrasaction="ignore")
        if fresh:
            writer.writeheader()
        for item in items:
            writer.writerow({k: v if isinstance(v, (str, int, float)) else json.dumps(v)
                             for k, v in item.items()})
        return out.getvalue().encode()

    def _header(self) -> list[str]:
        with open(self.path, newline="") as fh:
            return next(csv.reader(fh), [])


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def export(client: Any, key: str, path: Path, fmt: str | None, progress: bool = True) -> tuple[int, int]:
    """Move every item of ``key`` to ``path``; (items moved, items skipped). Resumes an earlier run."""
    fmt = fmt or ("csv" if path.suffix.lower() == ".csv" else "jsonl")
    exporter = Exporter(client, key, path, fmt)
    exporter.recover()
    moved = 0
    if not progress:
        while n := exporter.step():
            moved += n
        return moved, exporter.skipped
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("exporting"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  transient=False) as bar:
        task = bar.add_task("items", total=exporter.remaining())
        while n := exporter.step():
            moved += n
            bar.update(task, advance=n, total=max(moved + exporter.remaining(), moved))
    return moved, exporter.skipped
