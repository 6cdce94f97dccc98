"""Untrusted Redis replies as text: what every parser of a crawl's HASHes (control flags, worker
heartbeats) starts with."""

from __future__ import annotations

from typing import Any

from scrapy_dist.exceptions import RejectedEntry

__all__ = ["count", "hash_fields", "text"]


def text(value: Any) -> str:
    """A reply value as text: bytes decoded as UTF-8 (bad bytes replaced), ``None`` as ``""``."""
    if value is None:
        return ""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def count(value: Any) -> int:
    """A counter someone else may have written (a queue's request count, a bloom item count): a
    non-negative decimal integer of at most 18 digits, else 0 -- the scripts heal such counters at their
    next call, and a reader meanwhile falls back on what it counts itself."""
    t = text(value)
    return int(t) if t.isascii() and t.isdigit() and len(t) <= 18 else 0


def hash_fields(raw: Any, what: str) -> dict[str, str]:
    """An ``HGETALL`` reply as text -> text (``None``: an empty hash). Raises :class:`RejectedEntry`
    (reason ``not_a_hash``, naming ``what``) if ``raw`` is not a mapping."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise RejectedEntry("not_a_hash", f"{what} hash reply of type {type(raw).__name__}")
    return {text(k): text(v) for k, v in raw.items()}
