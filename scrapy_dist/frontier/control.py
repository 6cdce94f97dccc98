"""What passes between a crawl and the people running it, outside the ``sync`` call: the control flags,
dead letters, and the frontier's stats and log lines.

**Control flags**: ``{spider}:control`` (a HASH: ``paused``, ``close``/``close_at``, ``errors_tripped_at``,
``shards``; docs/monitoring.md), read and written by the scheduler, the monitors and ``scrapy-dist
pause|resume|close``. Anything in it is untrusted: :func:`parse_control` never raises for garbage, it
ignores a bad field and names it in :attr:`ControlState.problems`. A close decision counts only if
``close_at`` lies between the worker's start and :data:`CLOSE_AT_SLACK` seconds past the server's time.

**Dead letters**: one JSON record per request that finally failed, in ``{spider}:deadletter`` (fields:
docs/retries.md). Anyone with access to Redis can write that list, so :func:`parse_record` and
:func:`requeue_payload` raise :class:`~scrapy_dist.exceptions.RejectedEntry` for anything malformed.

**Report**: :class:`FrontierReport` turns each shard's answer into Scrapy stats (slash paths,
docs/settings.md) and rate-limited log lines.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack

from scrapy_dist.exceptions import RejectedEntry, UnserializableRequest
from scrapy_dist.redis.keys import GARBAGE
from scrapy_dist.redis.scripts import hash_fields
from scrapy_dist.utils import RateLimitedLog
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

    from scrapy_dist.frontier.ledger import Applied
    from scrapy_dist.frontier.shard import SyncResult
    from scrapy_dist.redis.keys import CrawlKeys

logger = logging.getLogger(__name__)

#: how far past the server's time a ``close_at`` may lie and still count (a slow round trip; lua/idle.lua)
CLOSE_AT_SLACK = 60.0
#: the most shards a control hash may record (more is garbage)
MAX_SHARDS = 1024
_REASON = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_reported: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class ControlState:
    """The control flags as read from Redis (see :func:`parse_control`)."""

    paused: bool = False
    paused_by: str = ""
    close: str = ""
    close_at: float | None = None
    #: the crawl's recorded shard count, None if absent or garbage
    shards: int | None = None
    #: the crawl's recorded SCHEDULER_POLITENESS ("process" or "cluster"), "" if absent or garbage
    politeness: str = ""
    #: one short description per garbage field, for a one-time warning
    problems: tuple[str, ...] = ()

    @classmethod
    def from_hash(cls, raw: Any) -> ControlState:
        """Build from an ``HGETALL`` reply (bytes or str keys and values); see :func:`parse_control`."""
        return parse_control(raw)

    def close_reason(self, started_at: float, now: float | None = None) -> str:
        """The close reason this worker (started at ``started_at``, server time) must act on, or ``""``.

        Only a decision taken after the worker started and not later than ``now`` (server time) plus
        :data:`CLOSE_AT_SLACK` counts; ``now=None`` skips the upper bound (callers without a clock)."""
        if not self.close or self.close_at is None or self.close_at < started_at:
            return ""
        if now is not None and self.close_at > now + CLOSE_AT_SLACK:
            return ""
        return self.close


def parse_control(raw: Any) -> ControlState:
    """The one parser of ``{spider}:control``. Raises :class:`RejectedEntry` (reason ``not_a_hash``) only
    if ``raw`` is not a mapping; a garbage field is ignored and named in ``problems``."""
    d = hash_fields(raw, "control")
    problems: list[str] = []
    paused_text = d.get("paused", "")
    if paused_text not in ("", "0", "1"):
        problems.append(f"paused={paused_text[:40]!r} (expected 0 or 1)")
    close = d.get("close", "")
    if close and not _REASON.fullmatch(close):
        problems.append(f"close={close[:40]!r} (not a close reason)")
        close = ""
    at: float | None = None
    close_at = d.get("close_at", "")
    if close_at:
        try:
            at = float(close_at)
        except ValueError:
            at = None
        if at is None or not math.isfinite(at) or at < 0:
            problems.append(f"close_at={close_at[:40]!r} (not a time)")
            at = None
    shards: int | None = None
    shards_text = d.get("shards", "")
    if shards_text:
        digits = shards_text.isascii() and shards_text.isdigit() and len(shards_text) <= 6
        if digits and 1 <= int(shards_text) <= MAX_SHARDS:
            shards = int(shards_text)
        else:
            problems.append(f"shards={shards_text[:40]!r} (expected 1 to {MAX_SHARDS})")
    paused_by = d.get("paused_by", "")
    if paused_by and not _REASON.fullmatch(paused_by):
        problems.append(f"paused_by={paused_by[:40]!r}")
        paused_by = "?"
    politeness = d.get("politeness", "")
    if politeness not in ("", "process", "cluster"):
        problems.append(f"politeness={politeness[:40]!r} (expected process or cluster)")
        politeness = ""
    return ControlState(paused_text == "1", paused_by, close, at, shards, politeness, tuple(problems))


def report_problems(control_key: str, state: ControlState, log: logging.Logger = logger) -> None:
    """Log each garbage field of ``control_key`` once per process (WARNING), whatever values it takes."""
    for problem in state.problems:
        field = problem.partition("=")[0]
        if (control_key, field) not in _reported:
            _reported.add((control_key, field))
            log.warning("Ignoring garbage in %s: %s", control_key, problem)


def move_aside_foreign(client: Any, control_key: str) -> bool:
    """Move a control hash of another Redis type aside to ``<key>:garbage`` (with a warning), so the worker
    or tool goes on with it empty instead of failing on WRONGTYPE. Synchronous client; True if moved."""
    kind = client.type(control_key)
    kind = kind.decode(errors="replace") if isinstance(kind, bytes) else str(kind)
    if kind in ("none", "hash"):
        return False
    client.rename(control_key, control_key + GARBAGE)
    logger.warning("%s held another Redis type (%s): moved to %s", control_key, kind, control_key + GARBAGE)
    return True


def pause_crawl(client: Any, control_key: str, by: str = "cli") -> None:
    """Pause the crawl: every worker stops taking new requests at its next sync (one round trip)."""
    move_aside_foreign(client, control_key)
    client.hset(control_key, mapping={"paused": "1", "paused_by": by, "paused_at": repr(time.time())})


def valid_reason(reason: str) -> bool:
    """Whether ``reason`` may be a close reason (what :func:`parse_control` accepts)."""
    return bool(_REASON.fullmatch(reason))


def close_crawl(client: Any, control_key: str, reason: str = "shutdown") -> None:
    """Decide that the crawl closes: every running worker's idle monitor sees the flag and closes with
    ``reason``; workers started afterwards ignore it (``close_at`` is the server's time now)."""
    if not valid_reason(reason):
        raise ValueError(f"close reason {reason!r}: letters, digits and _.:- only, at most 64")
    move_aside_foreign(client, control_key)
    sec, usec = client.time()
    client.hset(control_key, mapping={"close": reason, "close_at": f"{int(sec) + int(usec) / 1e6:.6f}"})


def resume_crawl(client: Any, control_key: str, errors_key: str) -> None:
    """Resume a paused crawl afresh: lift the pause and any close decision and empty the error window
    (else the errors that paused it would trip it again at once). One round trip."""
    move_aside_foreign(client, control_key)
    pipe = client.pipeline(transaction=False)
    pipe.hset(control_key, "paused", "0")
    pipe.hdel(control_key, "paused_by", "paused_at", "close", "close_at", "errors_tripped_at")
    pipe.delete(errors_key)
    pipe.execute()


async def server_time(redis: Any) -> float:
    """Redis server time (unix seconds): the one clock every worker and the CLI agree on."""
    sec, usec = await redis.time()
    return int(sec) + int(usec) / 1e6


async def start_time(redis: Any) -> float:
    """When a monitor starts watching, on :func:`server_time`'s clock (this machine's if Redis is away)."""
    try:
        return await server_time(redis)
    except Exception:
        return time.time()


# -- dead letters --------------------------------------------------------------------------------
#: longest exception message kept in a record
DETAIL_LIMIT = 300
#: largest record ``scrapy-dist dead`` accepts (a 1 MiB payload in base64 plus the other fields)
MAX_RECORD_BYTES = 2 * 1024 * 1024
#: Latest ``at`` a record may carry (year 5138): later is garbage, and beyond what dates can show.
MAX_AT = 1e11


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
    """The JSON record for ``request`` as scheduled (credential headers a middleware added left out),
    signed by ``policy``; ``attempts`` defaults to ``meta["retry_times"] + 1``. A request that cannot be
    encoded is recorded with ``"request": null``."""
    from scrapy_dist.wire.entrypolicy import as_scheduled

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
    """A dead letter's payload ready to enqueue again (retry counter removed, URL checked):
    ``(payload, priority)``; raises :class:`RejectedEntry`.

    With a secret, a signed record is requeued only if its tag verifies as this crawl's dead letter --
    signed again as a queue entry with the same nonce, so a record requeued twice is fetched once -- and
    refused (``bad_tag``) otherwise. An unsigned record is requeued unsigned (held to the rules for seeds).
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


# -- the frontier's stats and log lines -----------------------------------------------------------
#: the scheduler's logger (the lines a Scrapy user reads come from the scheduler)
report_logger = logging.getLogger("scrapy_dist.frontier.scheduler")


class NoStats:
    """Stats sink of a scheduler built without a stats collector."""

    def inc_value(self, key: str, count: int = 1, start: int = 0) -> None:
        pass

    def set_value(self, key: str, value: Any) -> None:
        pass


class FrontierReport:
    """Stats and log lines of one worker's frontier (``shard_keys``: every shard's keys, for messages)."""

    def __init__(self, stats: Any, shard_keys: list[CrawlKeys], log_duplicate: Any) -> None:
        self.stats = stats
        self.shard_keys = shard_keys
        #: ``log_duplicate(request)``: the dupefilter's log of a filtered request
        self.log_duplicate = log_duplicate
        self._log = RateLimitedLog(report_logger)
        self._unserializable_log = RateLimitedLog.once(report_logger)
        #: acks and items refused since this worker's acks were last accepted (told once, see refusals_done)
        self._refused = [0, 0]
        #: the crawl exports feeds: a refused ack is a page whose items another fetch writes there again
        self.feeds = False

    def applied(self, applied: Applied, result: SyncResult) -> None:
        """Stats and logs of one shard's answer."""
        stats = self.stats
        for request in applied.duplicates:
            self.log_duplicate(request)
        if applied.enqueued:
            stats.inc_value("scheduler/enqueued/redis", applied.enqueued)
            stats.inc_value("scheduler/enqueued", applied.enqueued)
        if result.requeued:
            stats.inc_value("scheduler/requeued/lease_expired", result.requeued)
        if result.moved:
            stats.inc_value("scheduler/delayed/moved", result.moved)
        if result.rejected:  # malformed members, and copies of entries handed out, the script parked itself
            stats.inc_value("scheduler/rejected", result.rejected)
            if result.rejected > result.replayed:
                stats.inc_value("scheduler/rejected/bad_member", result.rejected - result.replayed)
            if result.replayed:
                stats.inc_value("scheduler/rejected/replayed", result.replayed)
        if result.items:
            stats.inc_value("redis_items/written", result.items)
        if result.acks_refused:
            stats.inc_value("scheduler/acks_refused", result.acks_refused)
            if result.items_refused:
                stats.inc_value("redis_items/refused", result.items_refused)
            if self.feeds:
                stats.inc_value("feeds/duplicate_pages", result.acks_refused)
            self._refused[0] += result.acks_refused
            self._refused[1] += result.items_refused
        if applied.acked > result.acks_refused:  # this worker's acks count again: the episode is over
            self.refusals_done()
        for key in result.repaired:
            self._log.log(
                logging.WARNING, "Repaired garbage in %s (written by someone else?) before writing", key,
                key=f"repaired:{key}",
            )
        for (shard, _), exc in applied.rejected:
            stats.inc_value("scheduler/rejected")
            stats.inc_value(f"scheduler/rejected/{exc.reason}")
            keys = self.shard_keys[shard]
            self._log.log(
                logging.ERROR, "Rejected a queue entry of %r (%s); moved it to %s",
                keys.queue, exc, keys.queue_rejected, key="rejected",
            )

    def refusals_done(self) -> None:
        """One WARNING for a run of refused acks (until an ack is accepted again, or at close)."""
        acks, items = self._refused
        if not acks:
            return
        self._refused = [0, 0]
        report_logger.warning(
            "The frontier refused %d acknowledgements and their %d items: those leases were no longer this"
            " worker's (it was stopped or cut off longer than SCHEDULER_LEASE_SECONDS and another worker"
            " took them, or an earlier call had already acknowledged them). Their items come from the other"
            " fetch, once; feed exports may hold these pages' items twice", acks, items,
        )

    def released(self, reason: str, given: int) -> None:
        """The leases a closing worker gave back to the queue."""
        self.stats.set_value("scheduler/released_at_close", given)
        report_logger.info("Closing (%s): gave %d leased requests back to the queue", reason, given)

    def unserializable(self, request: Request, exc: UnserializableRequest) -> None:
        """A request that cannot go to Redis (crawled by this worker only): counted, logged once per key."""
        self.stats.inc_value("scheduler/unserializable")
        self._unserializable_log.log(
            logging.ERROR,
            "Unable to put %(request)s in the shared frontier: %(reason)s. It is crawled by this worker"
            " only and is lost if it dies. Make %(key)s encodable (str, bytes, numbers, bools, None,"
            " lists, dicts) or pass a spider method name. Further requests failing on %(key)s are only"
            " counted in scheduler/unserializable.",
            {"request": request, "reason": exc, "key": exc.key}, key=exc.key,
        )

    @staticmethod
    def backlog(spider: str, pending: int, remembered: int, persist: bool) -> None:
        """The line scrapy-redis users look for, and a warning when joining a crawl that has finished."""
        if pending:
            report_logger.info("Resuming crawl (%d requests scheduled)", pending)
        elif remembered and persist:
            report_logger.warning(
                "The crawl %r has run before and finished: %d fingerprints are remembered"
                " (SCHEDULER_PERSIST=True), so requests already seen then are skipped now. To start"
                " afresh: -s SCHEDULER_FLUSH_ON_START=True for this run, or SCHEDULER_PERSIST=False so"
                " that a finished crawl removes its keys.",
                spider, remembered,
            )
