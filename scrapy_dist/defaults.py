"""Every setting's default by name (``scrapy_dist.defaults.SCHEDULER_LEASE_SECONDS``), as scrapy-redis's
``defaults`` module offers them: the public face of :data:`scrapy_dist.settings.table.TABLE`."""

from __future__ import annotations

from scrapy_dist.settings.table import default_value as __getattr__  # noqa: F401
from scrapy_dist.settings.table import defaults as _defaults

__dir__ = _defaults.__dir__
