"""Records for untrusted input that was refused (queue entries, seeds); their rate-limited logging is
:class:`scrapy_dist.utils.ratelimit.RateLimitedLog`.

A record is JSON: ``{"reason": ..., "detail": ..., "raw": ..., "raw_encoding": "utf-8"|"base64",
"at": <unix time>, "worker": <worker id>}`` where ``raw`` is the first 1 KiB of the refused bytes (as text
when they are UTF-8, else base64).
"""

from __future__ import annotations

import base64
import json
import time

__all__ = ["RAW_LIMIT", "rejection_record"]

RAW_LIMIT = 1024


def rejection_record(reason: str, raw: bytes, worker: str, detail: str = "", now: float | None = None) -> str:
    """The JSON record pushed to a ``:rejected`` key."""
    head = raw[:RAW_LIMIT]
    try:
        text, enc = head.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        text, enc = base64.b64encode(head).decode("ascii"), "base64"
    return json.dumps(
        {
            "reason": reason,
            "detail": detail[:500],
            "raw": text,
            "raw_encoding": enc,
            "raw_bytes": len(raw),
            "at": time.time() if now is None else now,
            "worker": worker,
        }
    )
