"""Every setting's default by name (``scrapy_dist.defaults.SCHEDULER_LEASE_SECONDS``), as scrapy-redis's
``defaults`` module offers them: the public face of :data:`scrapy_dist.settings.table.TABLE`."""

from __future__ import annotations

from typing import Any

from scrapy_dist.settings.table import DEFAULTS, default_value


def __getattr__(name: str) -> Any:
    return default_value(name)


def __dir__() -> list[str]:
    return sorted(DEFAULTS)
