"""scrapy-dist's exceptions, all under :class:`ScrapyDistError`."""

from __future__ import annotations

from scrapy.exceptions import IgnoreRequest


class ScrapyDistError(Exception):
    """Root of every scrapy-dist exception."""


class RedisUnavailable(ScrapyDistError):
    """Redis could not be reached; the message names the (masked) URL and the setting to change."""


class UnserializableRequest(ScrapyDistError):
    """A request cannot be written in the wire format; ``key`` names the offending field or meta key."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


class RejectedEntry(ScrapyDistError):
    """Untrusted data read from Redis (a queue entry, a seed) failed validation; ``reason`` is a short slug
    (``not_utf8``, ...) used in stats (``.../rejected/<reason>``) and rejection records."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


class ReleasedAtClose(ScrapyDistError, IgnoreRequest):
    """A leased request still waiting in the downloader at close: given back, not fetched."""


class FrontierScriptError(ScrapyDistError):
    """A frontier Lua script answered with an unexpected result."""


class ShardingRefused(ScrapyDistError):
    """A worker cannot join a sharded frontier as configured (``SCHEDULER_SHARDS``)."""


class FrontierStateError(FrontierScriptError):
    """The sync script refused to write: a value it read from Redis (``key``) is unusable."""

    def __init__(self, reason: str, key: str) -> None:
        super().__init__(f"The frontier refused to write: {key!r} holds an unusable value ({reason}); "
                         "nothing was written. Repair or delete that key (SCHEDULER_FLUSH_ON_START clears "
                         "the crawl)")
        self.reason, self.key = reason, key
