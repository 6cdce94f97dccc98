"""scrapy-redis's small text helpers, for projects switched by replacing ``scrapy_redis`` by ``scrapy_dist``.

Spiders written for scrapy-redis often decode seeds in ``make_request_from_data`` with
``from scrapy_redis.utils import bytes_to_str``; with these here that import keeps working after the switch
instead of failing the spider's import. scrapy-dist's own code does not use them. scrapy-redis's
``TextColor`` (terminal colour codes) is not provided.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["bytes_to_str", "convert_bytes_to_str", "is_dict"]


def bytes_to_str(s: Any, encoding: str = "utf-8") -> Any:
    """``s`` decoded with ``encoding`` if it is bytes, else ``s`` unchanged."""
    return s.decode(encoding) if isinstance(s, (bytes, bytearray)) else s


def is_dict(string_content: Any) -> bool:
    """Whether ``string_content`` parses as JSON (any JSON value, as in scrapy-redis, not only an object)."""
    try:
        json.loads(string_content)
    except (ValueError, TypeError):
        return False
    return True


def convert_bytes_to_str(data: Any, encoding: str = "utf-8") -> Any:
    """``data`` with bytes decoded: a bytes value, or the keys and values of a dict (recursively)."""
    if isinstance(data, (bytes, bytearray)):
        return data.decode(encoding)
    if isinstance(data, dict):
        return {convert_bytes_to_str(k, encoding): convert_bytes_to_str(v, encoding) for k, v in data.items()}
    return data
