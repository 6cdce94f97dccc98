"""Fuzz of the parsers of Redis records the operator tools read (control hash, worker hash, dead-letter
record): whatever is in Redis, only the documented rejection (:class:`RejectedEntry`) escapes, and what they
return is typed and in range."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scrapy_dist.cli import json_safe, printable
from scrapy_dist.exceptions import RejectedEntry
from scrapy_dist.extensions.clusterstats import parse_worker_hash
from scrapy_dist.frontier.layout import MAX_SHARDS, parse_control
from scrapy_dist.frontier.orders import MAX_AT, parse_record
from scrapy_dist.monitor.status import worker_rows

FUZZ = settings(max_examples=200, deadline=None)

#: strings like the ones that break parsers: numbers in every spelling, markup, escapes, garbage
TRICKY = st.one_of(
    st.sampled_from(["nan", "NaN", "inf", "-inf", "1e300", "1e400", "-1", "0", "1", "100000", "²", "0x10",
                     "1_000", " 7 ", "[/x]", "\x1b[2J", "\x9b", "", "closed", "running", "finished"]),
    st.text(max_size=30),
    st.integers().map(str),
    st.floats().map(repr),
)
VALUE = st.one_of(TRICKY, TRICKY.map(lambda s: s.encode("utf-8", "surrogatepass")), st.binary(max_size=30))
FIELDS = st.sampled_from(["paused", "paused_by", "close", "close_at", "shards", "pages", "items", "errors",
                          "started", "interval", "pid", "inflight", "state", "pages_per_min", "host",
                          "finish_reason", "errors_tripped_at"])
HASH = st.dictionaries(st.one_of(FIELDS, FIELDS.map(str.encode), st.binary(max_size=8)), VALUE, max_size=12)
ANYTHING = st.one_of(HASH, st.none(), st.integers(), st.text(max_size=5), st.lists(st.binary(), max_size=3))


@pytest.mark.parametrize("shards", ["\u00b2", "\u0663", "9" * 5000, "-1", " 3"])
def test_control_shards_that_only_look_like_numbers_are_reported_not_raised(shards: str) -> None:
    state = parse_control({"shards": shards})  # '²'.isdigit() is True, int('²') raises; 5000 digits too
    assert state.shards is None and any(p.startswith("shards=") for p in state.problems)


@FUZZ
@given(ANYTHING)
def test_control_parser(raw: Any) -> None:
    try:
        state = parse_control(raw)
    except RejectedEntry as exc:
        assert exc.reason == "not_a_hash"
        return
    assert state.close_at is None or (math.isfinite(state.close_at) and state.close_at >= 0)
    assert state.shards is None or 1 <= state.shards <= MAX_SHARDS
    assert isinstance(state.close_reason(0.0, 1e9), str)
    for problem in state.problems:
        assert "\x1b" not in problem and "\n" not in problem


@FUZZ
@given(ANYTHING)
def test_worker_hash_parser(raw: Any) -> None:
    try:
        info = parse_worker_hash(raw)
    except RejectedEntry as exc:
        assert exc.reason == "not_a_hash"
        return
    for count in (info.pages, info.items, info.errors, info.inflight, info.pid):
        assert count is None or (isinstance(count, int) and count >= 0)
    for number in (info.started, info.interval, info.pages_per_min):
        assert number is None or math.isfinite(number)
    assert info.interval is None or info.interval > 0


@FUZZ
@given(st.lists(st.tuples(st.binary(max_size=12), st.floats(), HASH), max_size=4), st.floats(0, 2e9))
def test_worker_rows_never_raise(workers: list[tuple[bytes, float, dict[Any, Any]]], now: float) -> None:
    rows = worker_rows([(m, s) for m, s, _ in workers], [h for _, _, h in workers], None, now, 30.0)
    json.dumps(rows)  # JSON-ready
    for row in rows:
        assert "\x1b" not in printable(row["id"])


JSON_VALUE = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
RECORD_FIELDS = st.sampled_from(["url", "reason", "attempts", "worker", "at", "status", "detail", "request"])
RECORD = st.one_of(
    st.dictionaries(RECORD_FIELDS, JSON_VALUE, max_size=8).map(lambda d: json.dumps(d).encode()),
    JSON_VALUE.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64),
    st.integers(1, 50_000).map(lambda n: b"[" * n),
    st.sampled_from([b'{"at": NaN}', b'{"at": 1e999}', b'{"at": -Infinity}', b'{"at": ' + b"9" * 400 + b"}",
                     b'{"attempts": ' + b"9" * 5000 + b"}", b'{"request": "!!"}', b'{"status": 1e3}']),
)


@FUZZ
@given(RECORD)
def test_dead_letter_parser(raw: bytes) -> None:
    try:
        letter = parse_record(raw)
    except RejectedEntry as exc:
        assert exc.reason == "bad_deadletter"
        return
    assert math.isfinite(letter.at) and 0 <= letter.at <= MAX_AT
    assert isinstance(letter.url, str) and isinstance(letter.worker, str) and isinstance(letter.reason, str)
    json.loads(json_safe(json.dumps(letter.as_dict(), ensure_ascii=False)))


@FUZZ
@given(st.text(max_size=50), st.binary(max_size=50))
def test_printable_leaves_no_control_characters(text: str, data: bytes) -> None:
    for value in (text, data):
        out = printable(value)
        assert not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or c in "\u202a\u202b\u202c\u202d\u202e"
                       for c in out)
