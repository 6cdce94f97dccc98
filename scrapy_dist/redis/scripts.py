"""The one place for Lua: loads ``scrapy_dist/redis/lua/*.lua`` and registers them with a client.

Scripts are plain ``.lua`` files with a header naming KEYS, ARGV and the return value. Fragments (files
of functions, not scripts on their own) are prepended to the scripts that use them, in the order of
:data:`_FRAGMENTS`: ``foreign.lua`` (a key of another Redis type moved aside) to the scripts that repair
what they write, ``dupe.lua`` (the dupefilter's functions) to the scripts that deduplicate, so the
frontier's batched path and the dupefilter's own path run the very same code; ``sync.lua`` is its steps
(``sync_common``, ``sync_check``, ``sync_sweep``, ``sync_enqueue``, ``sync_items``, ``sync_settle``,
``sync_lease``).
redis-py's ``register_script`` gives EVALSHA with a transparent reload on NOSCRIPT. Every key a script
touches is passed in KEYS and shares the crawl's hash tag, so the scripts run unchanged on Redis Cluster.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files
from typing import Any

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
