"""Every scrapy-dist setting's default, by name (``defaults.SCHEDULER_LEASE_SECONDS`` ...), made from
:data:`scrapy_dist.settings.TABLE`, where settings are declared. Constructors use them as parameter
defaults; components take typed values from :class:`scrapy_dist.settings.DistSettings`.
"""

from __future__ import annotations

from typing import Any

from scrapy_dist.settings import DEFAULTS


def __getattr__(name: str) -> Any:
    try:
        value = DEFAULTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    # a copy of a mutable default, so a caller cannot change the table
    return type(value)(value) if isinstance(value, (dict, list)) else value


def __dir__() -> list[str]:
    return sorted(DEFAULTS)
