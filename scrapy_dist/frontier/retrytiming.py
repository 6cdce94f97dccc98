"""When a failed request is tried again: pure functions of the attempt number, the settings and the
server's ``Retry-After`` header (used by the retry middleware and crawl-wide politeness)."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from datetime import timezone
from email.utils import parsedate_to_datetime

#: upward jitter of a backoff delay: the n-th retry waits between nominal and (1 + JITTER) x nominal
JITTER = 0.5
#: statuses whose ``Retry-After`` header sets the retry delay (RFC 9110 section 10.2.3)
RETRY_AFTER_STATUSES = frozenset({429, 503})


def backoff_delay(
    retry_times: int, base: float, cap: float, rng: Callable[[], float] = random.random
) -> float:
    """Seconds to wait before retry number ``retry_times`` (1 for the first retry).

    Exponential with upward jitter: ``base * 2 ** (retry_times - 1)`` times a random factor in
    ``[1, 1 + JITTER)``, never more than ``cap``. The jitter only adds, so ``base * 2 ** (n - 1)`` (or
    ``cap``) is a guaranteed minimum gap, while retries of requests that failed together spread out.
    """
    if base <= 0 or cap <= 0:
        return 0.0
    exponent = max(0, retry_times - 1)
    # 2**1024 overflows a float; anything that large is over any sensible cap anyway
    nominal = cap if exponent >= 1000 else base * 2.0**exponent
    return min(cap, nominal * (1.0 + JITTER * rng()))


def parse_retry_after(value: bytes | str | None, now: float | None = None) -> float | None:
    """Seconds to wait according to a ``Retry-After`` header value, or ``None`` if it is absent or invalid.

    Accepts delay-seconds (``"120"``, leniently ``"1.5"``) and an HTTP date (``"Wed, 21 Oct 2015 07:28:00
    GMT"``, compared with ``now``, unix time). A date in the past gives ``0.0``.
    """
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("latin-1")
        except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
            return None
    text = value.strip()
    if not text:
        return None
    if text.isascii() and text.replace(".", "", 1).isdigit():
        seconds = float(text)
        return seconds if math.isfinite(seconds) else None
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None:  # pragma: no cover - older Pythons returned None for garbage
        return None
    if when.tzinfo is None:  # RFC 9110 dates are GMT; a date without zone is read as such
        when = when.replace(tzinfo=timezone.utc)
    now = time.time() if now is None else now
    return max(0.0, when.timestamp() - now)


def retry_delay(
    retry_times: int,
    base: float,
    cap: float,
    *,
    status: int | None = None,
    retry_after: bytes | str | None = None,
    now: float | None = None,
    rng: Callable[[], float] = random.random,
) -> float:
    """The delay of a retry: ``Retry-After`` (on 429/503, capped by ``cap``) if given and valid, else
    :func:`backoff_delay`."""
    if status in RETRY_AFTER_STATUSES:
        hinted = parse_retry_after(retry_after, now=now)
        if hinted is not None:
            return min(cap, hinted) if cap > 0 else hinted
    return backoff_delay(retry_times, base, cap, rng)
