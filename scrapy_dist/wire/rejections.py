"""Records for untrusted input that was refused (queue entries, seeds); their rate-limited logging is
:class:`scrapy_dist.utils.RateLimitedLog`.

A record is JSON: ``{"reason": ..., "detail": ..., "raw": ..., "raw_encoding": "utf-8"|"base64",
"at": <unix time>, "worker": <worker id>}`` where ``raw`` is the first 1 KiB of the refused bytes (as text
when they are UTF-8, else base64).
"""

from __future__ import annotations

import base64
import json
import time

__all__ = ["PREVIEW_LIMIT", "RAW_LIMIT", "preview", "rejection_record"]

RAW_LIMIT = 1024
#: Characters of a refused entry quoted in a log line.
PREVIEW_LIMIT = 100


def preview(raw: bytes | str, limit: int = PREVIEW_LIMIT, quote: bool = True) -> str:
    """The head of refused input for a log line (quoted unless not ``quote``): at most ``limit`` characters
    (then ``…``), undecodable bytes
    as ``\\xNN`` and every character that is not printable (newlines, terminal escapes, bidi controls) as
    an escape, so one entry is one line that shows what it was and cannot rewrite the log or terminal."""
    text = raw[: limit * 4].decode("utf-8", "backslashreplace") if isinstance(raw, bytes) else raw
    cut = len(text) > limit or len(raw) > limit * 4
    shown = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"
                    for c in text[:limit])
    if quote:
        return "'" + shown.replace("'", "\\'") + ("'…" if cut else "'")
    return shown + ("…" if cut else "")


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
