"""Lua scripts and untrusted replies: loads ``scrapy_dist/redis/lua/*.lua`` (fragments listed in
:data:`_FRAGMENTS` are prepended to the scripts that use them), registers them with a client (EVALSHA,
reloaded on NOSCRIPT; every key in KEYS shares the crawl's hash tag, so they run on Redis Cluster), and
reads untrusted Redis replies as text."""

from __future__ import annotations

from functools import cache
from importlib.resources import files
from typing import Any

from scrapy_dist.exceptions import RejectedEntry

#: script name -> fragments prepended to it
_FRAGMENTS = {
    "sync": (
        "foreign", "dupe", "polite", "sync_common", "sync_check", "sync_sweep", "sync_enqueue", "sync_items",
        "sync_settle", "sync_lease",
    ),
    "dupe_batch": ("foreign", "dupe"),
    "errors": ("foreign",),
    "clusterstats": ("foreign",),
    "seeds_take": ("foreign", "seeds_common"),
    "seeds_adopt": ("seeds_common",),
}


@cache
def source(name: str, prelude: str = "") -> str:
    """The full Lua source of script ``name``: ``prelude`` (declarations its caller generates), then its
    fragments, then the script."""
    lua = files("scrapy_dist.redis") / "lua"
    parts = [prelude] if prelude else []
    parts += [(lua / f"{frag}.lua").read_text() for frag in _FRAGMENTS.get(name, ())]
    parts.append((lua / f"{name}.lua").read_text())
    return "\n".join(parts)


def register(client: Any, name: str, prelude: str = "") -> Any:
    """``client.register_script`` for script ``name`` (works for sync, asyncio and cluster clients)."""
    return client.register_script(source(name, prelude))


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
