"""Fuzz the decoders of what Redis answers or holds for the frontier: the ``{spider}:bloom`` HASH, the
bloom settings and the sync script's answer. Only the documented rejection (a ScrapyDistError) escapes."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scrapy_dist.dupefilter.bloom import (
    MAX_OVERSHOOT,
    BloomParameterError,
    check_parameters,
    parse_bloom_record,
)
from scrapy_dist.exceptions import FrontierScriptError
from scrapy_dist.frontier.shard import SYNC_RESULT, SyncResult, decode_sync_result

FIELDS = ["capacity", "error_rate", "block_bits", "n", "hashing", "filters"]
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

numbers_as_text = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["", " 1", "1e400", "0x10", "١٢٣", "nan", "-0", "4096", "1000", "0.01", "3"]),
)
field_value = st.one_of(numbers_as_text, numbers_as_text.map(str.encode), st.binary(max_size=30), st.none())


@FUZZ
@given(st.dictionaries(st.sampled_from(FIELDS + [f.encode() for f in FIELDS]), field_value))
def test_bloom_record_decoder_only_refuses(fields: dict[Any, Any]) -> None:
    fields = {k: v for k, v in fields.items() if v is not None}
    try:
        rec = parse_bloom_record(fields, "{s}:bloom")
    except BloomParameterError as exc:
        msg = str(exc)
        assert "\n" not in msg and "{s}:bloom" in msg and len(msg) < 300
        return
    assert rec.capacity >= 1 and 0 < rec.error_rate < 1 and 0 <= rec.n <= rec.capacity * MAX_OVERSHOOT


@FUZZ
@given(
    st.one_of(st.integers(), st.floats(), st.text(max_size=5), st.booleans(), st.none()),
    st.one_of(st.integers(), st.floats(), st.text(max_size=5), st.booleans(), st.none()),
    st.one_of(st.integers(), st.floats(), st.booleans(), st.none()),
)
def test_bloom_settings_only_refuse(capacity: Any, error_rate: Any, block_bits: Any) -> None:
    try:
        check_parameters(capacity, error_rate, block_bits)
    except BloomParameterError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("BLOOMFILTER_")


redis_scalar = st.one_of(st.integers(min_value=-(2**63), max_value=2**63 - 1), st.binary(max_size=12))
redis_reply = st.recursive(redis_scalar, lambda inner: st.lists(inner, max_size=6), max_leaves=30)


def _plausible(draw: Any) -> list[Any]:
    """A sync answer: the right names with fuzzed values, sometimes names dropped or renamed."""
    out: list[Any] = []
    for name in SYNC_RESULT:
        if draw(st.integers(0, 9)) == 0:
            continue
        out.append(name.encode() if draw(st.booleans()) else draw(st.binary(max_size=8)))
        out.append(draw(redis_reply))
    return out


@settings(FUZZ, max_examples=100)  # a draw is a dozen nested replies: the costliest examples here
@given(st.one_of(redis_reply, st.composite(lambda draw: _plausible(draw))()), st.integers(0, 3))
def test_sync_result_decoder_only_refuses(raw: Any, n_enqueue: int) -> None:
    try:
        res = decode_sync_result(raw, n_enqueue)
    except FrontierScriptError as exc:  # FrontierStateError included
        assert "\n" not in str(exc)
        return
    assert isinstance(res, SyncResult) and len(res.new) == n_enqueue
    assert all(isinstance(m, bytes) and isinstance(s, float) for m, s in res.leased)


def test_a_well_formed_answer_decodes_by_name() -> None:
    raw = [b"seq", b"7", b"flags", b"10", b"leased", [b"m1", b"-2"], b"requeued", 1, b"moved", 0,
           b"queued", 3, b"inflight", 1, b"delayed", 0, b"bloom_n", 5, b"paused", b"0", b"rejected", 2,
           b"repaired", [b"{s}:seq"]]
    res = decode_sync_result(raw, 2)
    assert res.new == [True, False] and res.leased == [(b"m1", -2.0)] and res.seq == 7
    assert (res.requeued, res.queued, res.inflight, res.bloom_n, res.rejected) == (1, 3, 1, 5, 2)
    assert res.repaired == ["{s}:seq"] and res.paused is False
