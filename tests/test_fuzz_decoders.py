"""Hypothesis fuzz of the decoders of Redis contents: a queue member (single entries and chunks), a seed, a
dead-letter record. Whatever the bytes, only :class:`RejectedEntry` may escape (or a valid result)."""

from __future__ import annotations

import base64
import json
from typing import Any

import msgpack
import scrapy
from helpers import queue_singles
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scrapy_dist.exceptions import RejectedEntry
from scrapy_dist.frontier.orders import parse_record, requeue_payload
from scrapy_dist.frontier.shard import SEQ_BYTES
from scrapy_dist.seeds import parse_seed, seed_request, spider_has_callback
from scrapy_dist.wire.codec import EntryPolicy, decode_request

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
POLICIES = [EntryPolicy(), EntryPolicy(secret=b"k")]


class FuzzSpider(scrapy.Spider):
    name = "fuzz"
    allowed_domains = ["example.com"]

    def parse(self, response: Any) -> None:
        pass

    def parse_item(self, response: Any) -> None:
        pass


SPIDER = FuzzSpider()

ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    ints,
    st.floats(),
    st.text(max_size=20),
    st.binary(max_size=20),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8) | ints, inner, max_size=4)
    ),
    max_leaves=12,
)
# a field value: usually something plausible, sometimes anything at all
fields = {
    "u": st.sampled_from(["https://example.com/a", "http://x.example.com:99999/", "ftp://example.com/", ""])
    | values,
    "m": st.sampled_from(["GET", "POST", "BAD METHOD"]) | values,
    "h": st.lists(
        st.tuples(
            st.sampled_from([b"X-A", b"Host", b"Bad Name", b""]) | values,
            st.lists(st.binary(max_size=8), max_size=3) | values,
        ).map(list),
        max_size=4,
    )
    | values,
    "b": st.binary(max_size=20) | values,
    "c": st.dictionaries(st.text(max_size=5), values, max_size=3) | st.lists(values, max_size=3) | values,
    "M": st.dictionaries(
        st.sampled_from(["proxy", "depth", "x", "_p"]) | st.text(max_size=5), values, max_size=3
    )
    | values,
    "k": st.dictionaries(st.text(max_size=5), values, max_size=3) | values,
    "p": ints | values,
    "d": st.booleans() | values,
    "cb": st.sampled_from(["parse", "parse_item", "start", "_callback", "log", "nope"]) | values,
    "eb": st.sampled_from(["parse", "closed"]) | values,
    "f": st.lists(st.text(max_size=5), max_size=3) | values,
    "e": st.sampled_from(["utf-8", "latin-1", "rot13", "base64", "nope"]) | values,
    "C": st.sampled_from(["scrapy.http.request.form.FormRequest", "os.system", "x"]) | values,
}
maps = st.fixed_dictionaries({}, optional=fields).map(lambda d: msgpack.packb(d, use_bin_type=True))
payloads = st.one_of(
    st.binary(max_size=64),
    st.tuples(st.sampled_from([b"\x01", b"\x02" + b"\0" * 16, b"\x02", b"\x03"]), maps).map(
        lambda t: t[0] + t[1]
    ),
)


def _decode_or_reject(payload: bytes, policy: EntryPolicy) -> None:
    try:
        request = decode_request(payload, SPIDER, policy)
    except RejectedEntry:
        return
    assert isinstance(request, scrapy.Request)


@FUZZ
@given(payloads, st.sampled_from(POLICIES))
def test_queue_payloads_decode_or_are_rejected(payload: bytes, policy: EntryPolicy) -> None:
    _decode_or_reject(payload, policy)


record = st.tuples(
    st.integers(min_value=0, max_value=2**16 - 1), st.binary(min_size=SEQ_BYTES, max_size=SEQ_BYTES), payloads
)


@settings(FUZZ, max_examples=100)  # each example decodes up to five payloads
@given(st.lists(record, max_size=5), st.binary(max_size=8), st.sampled_from(POLICIES))
def test_queue_chunks_split_into_entries_that_decode_or_are_rejected(
    records: list[tuple[int, bytes, bytes]], tail: bytes, policy: EntryPolicy
) -> None:
    # a chunk member: 6-byte seq, NUL, then <2-byte length><6-byte seq><payload> records (lengths may lie)
    member = b"\0" * SEQ_BYTES + b"\0"
    for length, seq, payload in records:
        member += (length if length % 3 else len(payload)).to_bytes(2, "big") + seq + payload
    member += tail
    for single in queue_singles(member):
        _decode_or_reject(single[SEQ_BYTES:], policy)


seed_objects = st.fixed_dictionaries(
    {},
    optional={
        "url": st.sampled_from(["https://example.com/", "https://evil.org/", "javascript:x"]) | values,
        "method": values,
        "headers": st.dictionaries(st.text(max_size=8), values, max_size=3) | values,
        "body": values,
        "meta": st.dictionaries(st.sampled_from(["proxy", "x", "dont_x"]), values, max_size=2) | values,
        "cb_kwargs": values,
        "priority": values,
        "callback": st.sampled_from(["parse", "start", "_x"]) | values,
        "errback": values,
        "dont_filter": values,
        "cookies": values,
        "other": values,
    },
)
seeds = st.one_of(
    st.binary(max_size=80),
    st.text(max_size=80).map(lambda t: t.encode("utf-8", "surrogatepass")),
    seed_objects.map(lambda d: json.dumps(d, default=repr).encode()),
)


@FUZZ
@given(seeds)
def test_seeds_parse_or_are_rejected(raw: bytes) -> None:
    try:
        seed = parse_seed(raw, has_callback=spider_has_callback(SPIDER))
        request = seed_request(seed, SPIDER)
    except RejectedEntry:
        return
    assert isinstance(request, scrapy.Request)


dead_records = st.one_of(
    st.binary(max_size=80),
    st.fixed_dictionaries(
        {},
        optional={
            "request": payloads.map(lambda p: base64.b64encode(p).decode()) | values.map(repr),
            "url": values.map(repr) | st.just("https://example.com/"),
            "reason": values.map(repr),
            "attempts": st.integers() | st.floats(),
            "worker": st.text(max_size=5),
            "at": st.floats() | st.integers(),
            "status": st.integers() | st.text(max_size=3),
            "detail": st.text(max_size=10),
        },
    ).map(lambda d: json.dumps(d).encode()),
)


@FUZZ
@given(dead_records, st.sampled_from(POLICIES))
def test_dead_letter_records_parse_or_are_rejected(raw: bytes, policy: EntryPolicy) -> None:
    try:
        letter = parse_record(raw)
        if letter.payload is not None:
            payload, _ = requeue_payload(letter.payload, policy=policy)
            _decode_or_reject(payload, policy)
    except RejectedEntry:
        return
