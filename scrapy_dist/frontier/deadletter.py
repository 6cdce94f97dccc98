"""Dead letters: the record format of a request that finally failed, one JSON object in
``{spider}:deadletter`` (fields: docs/retries.md, "Record format"; retry timing is
:mod:`scrapy_dist.frontier.retrytiming`). Anyone with access to Redis can write that list, so
:func:`parse_record` and :func:`requeue_payload` treat records as untrusted and raise
:class:`~scrapy_dist.exceptions.RejectedEntry` for anything malformed.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack

from scrapy_dist.exceptions import RejectedEntry
from scrapy_dist.wire.codec import (
    DEFAULT_POLICY,
    SIGNED_HEAD,
    TAG_BYTES,
    VERSION,
    EntryPolicy,
    check_url,
    encode_request,
    load_payload,
    split_payload,
)
from scrapy_dist.wire.entrypolicy import DEAD, FRONTIER

if TYPE_CHECKING:
    from scrapy import Request, Spider

#: longest exception message kept in a record
DETAIL_LIMIT = 300
#: largest record ``scrapy-dist dead`` accepts (a 1 MiB payload in base64 plus the other fields)
MAX_RECORD_BYTES = 2 * 1024 * 1024
#: Latest ``at`` a record may carry (year 5138): later is garbage, and beyond what dates can show.
MAX_AT = 1e11


# -- records --------------------------------------------------------------------------------------


def dead_letter_record(
    request: Request,
    *,
    reason: str,
    worker: str,
    spider: Spider | None = None,
    status: int | None = None,
    detail: str = "",
    attempts: int | None = None,
    now: float | None = None,
    policy: EntryPolicy | None = None,
) -> str:
    """The JSON record for ``request``; ``attempts`` defaults to ``meta["retry_times"] + 1``. The request
    is recorded as scheduled: credential headers a downloader middleware added are left out
    (:func:`scrapy_dist.wire.credentials.as_scheduled`); ``policy`` signs the payload.

    A request that cannot be encoded (see :class:`~scrapy_dist.exceptions.UnserializableRequest`) is
    still recorded, with ``"request": null``, so an audit lists it.
    """
    from scrapy_dist.exceptions import UnserializableRequest
    from scrapy_dist.wire.credentials import as_scheduled

    try:
        encoded = encode_request(as_scheduled(request), spider, policy)
        payload: str | None = base64.b64encode(encoded).decode("ascii")
    except UnserializableRequest:
        payload = None
    if attempts is None:
        attempts = _int(request.meta.get("retry_times"), 0) + 1
    record: dict[str, Any] = {
        "request": payload,
        "url": request.url,
        "reason": reason,
        "attempts": attempts,
        "worker": worker,
        "at": time.time() if now is None else now,
    }
    if status is not None:
        record["status"] = status
    if detail:
        record["detail"] = detail[:DETAIL_LIMIT]
    return json.dumps(record)


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


@dataclass(frozen=True)
class DeadLetter:
    """A dead-letter record read back from Redis; ``raw`` is the exact list element (for ``LREM``)."""

    raw: bytes
    url: str
    reason: str
    attempts: int
    worker: str
    at: float
    status: int | None
    detail: str
    payload: bytes | None

    def as_dict(self) -> dict[str, Any]:
        """The record's fields (payload as base64), for ``--json`` output."""
        return {
            "url": self.url, "reason": self.reason, "attempts": self.attempts, "worker": self.worker,
            "at": self.at, "status": self.status, "detail": self.detail,
            "request": base64.b64encode(self.payload).decode("ascii") if self.payload is not None else None,
        }


def parse_record(raw: bytes, max_bytes: int = MAX_RECORD_BYTES) -> DeadLetter:
    """The one parser of a dead-letter record: validate and decode one list element. Raises only
    :class:`RejectedEntry` (reason ``bad_deadletter``), for anything but a JSON object whose fields have
    their documented types -- ``at`` a finite time (not NaN, not 1e300), ``attempts`` and ``status`` in
    range, texts at most :data:`MAX_RECORD_BYTES` long."""
    if not isinstance(raw, (bytes, bytearray)):
        raise RejectedEntry("bad_deadletter", f"record of type {type(raw).__name__}")
    raw = bytes(raw)
    if len(raw) > max_bytes:
        raise RejectedEntry("bad_deadletter", f"record of {len(raw)} bytes")
    try:
        d = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RejectedEntry("bad_deadletter", f"not JSON: {exc}"[:200]) from None
    except RecursionError:
        raise RejectedEntry("bad_deadletter", "not JSON: nested too deep") from None
    if not isinstance(d, dict):
        raise RejectedEntry("bad_deadletter", f"record is a {type(d).__name__}")

    def field(name: str, types: type | tuple[type, ...], default: Any) -> Any:
        value = d.get(name, default)
        if value is default:
            return value
        if not isinstance(value, types) or isinstance(value, bool):
            raise RejectedEntry("bad_deadletter", f"{name} has type {type(value).__name__}")
        return value

    url = field("url", str, "")
    encoded = field("request", str, None)
    payload = None
    if encoded is not None:
        try:
            payload = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise RejectedEntry("bad_deadletter", "request is not base64") from None
    status = field("status", int, None)
    if status is not None and not 0 <= status <= 999:
        raise RejectedEntry("bad_deadletter", "status out of range")
    attempts = field("attempts", int, 0)
    if not 0 <= attempts <= 10**9:
        raise RejectedEntry("bad_deadletter", "attempts out of range")
    try:
        at = float(field("at", (int, float), 0.0))
    except OverflowError:  # an integer too big for a float
        at = math.inf
    if not (math.isfinite(at) and 0 <= at <= MAX_AT):
        raise RejectedEntry("bad_deadletter", "at is not a time")
    return DeadLetter(
        raw=raw,
        url=url,
        reason=str(field("reason", str, "")),
        attempts=attempts,
        worker=field("worker", str, ""),
        at=at,
        status=status,
        detail=field("detail", str, ""),
        payload=payload,
    )


def requeue_payload(
    payload: bytes,
    allowed_schemes: tuple[str, ...] = ("http", "https"),
    max_bytes: int = 1024 * 1024,
    policy: EntryPolicy = DEFAULT_POLICY,
) -> tuple[bytes, int]:
    """A dead letter's payload made ready to enqueue again: retry counter removed (a fresh set of
    attempts), URL checked. Returns ``(payload, priority)``; raises :class:`RejectedEntry`.

    With a secret (``policy``, bound to the crawl), a signed record is requeued only if its tag verifies
    as this crawl's dead letter -- signed again as a queue entry, with the same nonce, so that the same
    record requeued twice is fetched once -- and refused (``bad_tag``) otherwise: a record another crawl
    or another secret signed is never laundered into this crawl's queue. An unsigned record is requeued
    unsigned, so workers hold it to the rules for seeds.

    The payload is checked again by whichever worker leases it (:func:`scrapy_dist.wire.codec.decode_request`),
    so this only needs to understand the map well enough to edit ``meta``.
    """
    d = load_payload(payload, max_bytes)
    check_url(d.get("u"), allowed_schemes)
    version = split_payload(payload, max_bytes)[0]
    signed = policy.secret is not None and version != VERSION
    if signed and not policy.bound(kind=DEAD).verify(payload):
        raise RejectedEntry(
            "bad_tag", "its tag does not verify as a dead letter of this crawl (another crawl or secret)"
        )
    meta = d.get("M")
    if isinstance(meta, dict):
        meta.pop("retry_times", None)
        if not meta:
            del d["M"]
    priority = _int(d.get("p"), 0)
    body = msgpack.packb(d, use_bin_type=True)
    if not signed:
        return DEFAULT_POLICY.seal(body), priority
    return policy.bound(kind=FRONTIER).seal(body, payload[1 + TAG_BYTES : SIGNED_HEAD]), priority


def reason_matches(reason: str, wanted: str) -> bool:
    """Whether a record's ``reason`` is ``wanted``, case-insensitively: the exact reason, or the last
    dotted part of an exception name (``DownloadTimeoutError`` matches
    ``scrapy.exceptions.DownloadTimeoutError``)."""
    r, w = reason.lower(), wanted.lower()
    return r == w or r.rsplit(".", 1)[-1] == w
