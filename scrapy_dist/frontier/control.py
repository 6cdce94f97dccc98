"""The crawl-wide control flags in ``{spider}:control`` (a HASH: ``paused``, ``close``/``close_at``,
``errors_tripped_at``, ``shards``; docs/monitoring.md, "Control flags"), read and written by the scheduler,
the monitors and ``scrapy-dist pause|resume|close``.

Anything in this hash is untrusted: :func:`parse_control` is the one parser; it never raises for garbage,
it ignores a bad field and names it in :attr:`ControlState.problems` (reported once,
:func:`report_problems`). A close decision counts only if ``close_at`` lies between the worker's start and
:data:`CLOSE_AT_SLACK` seconds past the server's time, so a ``close_at`` set far in the future cannot close
every worker started later.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass
from typing import Any

from scrapy_dist.redis.keys import GARBAGE
from scrapy_dist.redis.replies import hash_fields

logger = logging.getLogger(__name__)

#: How far in the future (seconds, server time) a ``close_at`` may lie and still count: the clocks of
#: Redis and of a worker never disagree, it is all server time, so this only absorbs a slow round trip.
#: (Mirrored in lua/idle.lua.)
CLOSE_AT_SLACK = 60.0
#: The most shards the tools and workers believe a control hash about (more is garbage, not a crawl).
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
    """Log each garbage field of ``control_key`` once per process (WARNING), never once per poll -- nor
    once per value: a field rewritten with new garbage at every poll is still one line (and one entry of
    the record of what was reported, which would otherwise grow without bound)."""
    for problem in state.problems:
        field = problem.partition("=")[0]
        if (control_key, field) not in _reported:
            _reported.add((control_key, field))
            log.warning("Ignoring garbage in %s: %s", control_key, problem)


def move_aside_foreign(client: Any, control_key: str) -> bool:
    """The control hash holding another Redis type is not ours (the sync script's policy for every key of
    the frontier): moved aside to ``<key>:garbage`` with a warning, so that the worker or tool goes on
    with it empty instead of failing on WRONGTYPE. Synchronous client; True if it moved it."""
    kind = client.type(control_key)
    kind = kind.decode(errors="replace") if isinstance(kind, bytes) else str(kind)
    if kind in ("none", "hash"):
        return False
    client.rename(control_key, control_key + GARBAGE)
    logger.warning("%s held another Redis type (%s): moved to %s", control_key, kind, control_key + GARBAGE)
    return True


def pause_crawl(client: Any, control_key: str, by: str = "cli") -> None:
    """Pause the crawl: every worker stops taking new requests at its next sync (one round trip, two
    when the control hash holds another Redis type: moved aside first)."""
    move_aside_foreign(client, control_key)
    client.hset(control_key, mapping={"paused": "1", "paused_by": by, "paused_at": repr(time.time())})


def valid_reason(reason: str) -> bool:
    """Whether ``reason`` may be a close reason (what :func:`parse_control` accepts)."""
    return bool(_REASON.fullmatch(reason))


def close_crawl(client: Any, control_key: str, reason: str = "shutdown") -> None:
    """Decide that the crawl closes: every running worker's idle monitor sees the flag (within a few
    seconds) and closes with ``reason``; workers started afterwards ignore it (``close_at`` is the Redis
    server's time now). Two round trips (three when the control hash holds another Redis type)."""
    if not valid_reason(reason):
        raise ValueError(f"close reason {reason!r}: letters, digits and _.:- only, at most 64")
    move_aside_foreign(client, control_key)
    sec, usec = client.time()
    client.hset(control_key, mapping={"close": reason, "close_at": f"{int(sec) + int(usec) / 1e6:.6f}"})


def resume_crawl(client: Any, control_key: str, errors_key: str) -> None:
    """Resume a paused crawl and give it a fresh start: the pause and any close decision are lifted and the
    error window is emptied (else the errors that caused an automatic pause would trip it again at once).
    One round trip (two when the control hash holds another Redis type: moved aside first)."""
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
    """When a monitor starts watching, on :func:`server_time`'s clock -- or on this machine's if Redis does
    not answer yet (the monitor's loop then meets the outage)."""
    try:
        return await server_time(redis)
    except Exception:
        return time.time()
