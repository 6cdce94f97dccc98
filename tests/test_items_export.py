"""``scrapy-dist items SPIDER --export FILE``: items move from Redis to a file, none lost, none doubled,
even when an export is stopped between the file's fsync and the removal from Redis."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from scrapy_dist.cli import main
from scrapy_dist.cli import push as export_mod


def _fill(client: redis.Redis, stream: bool, n: int) -> None:
    for i in range(n):
        data = json.dumps({"n": i, "tags": ["a", i]})
        if stream:
            client.xadd("books:items", {"item": data})
        else:
            client.rpush("books:items", data)


@pytest.mark.parametrize("stream", [False, True], ids=["list", "stream"])
def test_export_moves_every_item_to_json_lines(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis, stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(export_mod, "EXPORT_CHUNK", 7)
    _fill(redis_client, stream, 30)
    out = tmp_path / "items.jsonl"
    result = CliRunner().invoke(main, ["--redis-url", redis_url, "items", "books", "--export", str(out)])
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["n"] for line in out.read_text().splitlines()] == list(range(30))
    assert (redis_client.xlen if stream else redis_client.llen)("books:items") == 0  # moved, not copied
    assert "30 items moved" in result.stderr
    assert not (tmp_path / "items.jsonl.export").exists()


@pytest.mark.parametrize("stream", [False, True], ids=["list", "stream"])
def test_an_export_stopped_after_the_fsync_resumes_without_doubling(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis, stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(export_mod, "EXPORT_CHUNK", 10)
    _fill(redis_client, stream, 25)
    out = tmp_path / "items.jsonl"
    exporter = export_mod.Exporter(redis_client, "books:items", out, "jsonl")
    assert exporter.step() == 10

    def killed(entry: object) -> None:  # the process dies between the fsync and the removal
        raise KeyboardInterrupt

    monkeypatch.setattr(exporter, "_remove", killed)
    with pytest.raises(KeyboardInterrupt):
        exporter.step()
    assert (tmp_path / "items.jsonl.export").exists()
    moved, _ = export_mod.export(redis_client, "books:items", out, None, progress=False)
    assert moved == 5
    assert [json.loads(line)["n"] for line in out.read_text().splitlines()] == list(range(25))
    assert (redis_client.xlen if stream else redis_client.llen)("books:items") == 0


def test_export_to_csv_writes_a_header_once_across_resumes(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(export_mod, "EXPORT_CHUNK", 4)
    _fill(redis_client, False, 6)
    out = tmp_path / "items.csv"
    export_mod.export(redis_client, "books:items", out, None, progress=False)
    _fill(redis_client, False, 3)
    export_mod.export(redis_client, "books:items", out, None, progress=False)
    rows = list(csv.DictReader(out.open(newline="")))
    assert [r["n"] for r in rows] == [str(i) for i in range(6)] + ["0", "1", "2"]
    assert rows[0]["tags"] == '["a", 0]'


def test_export_shows_a_progress_bar_on_a_terminal(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    _fill(redis_client, False, 5)
    moved, _ = export_mod.export(redis_client, "books:items", tmp_path / "x.jsonl", None, progress=True)
    assert moved == 5
    assert "exporting" in capsys.readouterr().out


def test_feeds_stored_only_at_close_are_named_at_risk() -> None:
    from scrapy_dist.frontier.engine import at_risk

    feeds = {
        "items.jsonl": {}, "file:///data/items.csv": {}, "stdout:": {}, "C:\\\\out\\\\items.jsonl": {},
        "s3://bucket/items.jsonl": {}, "ftp://host/items.jsonl": {}, "gs://b/x.jsonl": {},
        "local.jsonl.gz": {"postprocessing": ["scrapy.extensions.postprocessing.GzipPlugin"]},
    }
    risky = dict(at_risk(feeds))
    assert set(risky) == {
        "s3://bucket/items.jsonl", "ftp://host/items.jsonl", "gs://b/x.jsonl", "local.jsonl.gz"
    }
    assert "only at close" in risky["s3://bucket/items.jsonl"]
