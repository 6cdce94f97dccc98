"""Lua scripts and untrusted replies: ``lua/*.lua`` after their fragments (:data:`_FRAGMENTS`), registered
with a client (EVALSHA), replies read as text. A script in :data:`_LIBRARIES` is also a FUNCTION library
(Redis >= 7, :class:`Library`) whose top level runs once at load; ``<name>_call(keys, argv)`` runs a call."""

from __future__ import annotations

import hashlib
import logging
from functools import cache
from importlib.resources import files
from typing import Any

from redis.exceptions import NoPermissionError, ResponseError

from scrapy_dist.exceptions import RejectedEntry

logger = logging.getLogger(__name__)

_FRAGMENTS = {  #: script name -> fragments prepended to it
    "sync": ("foreign", "dupe", "polite", "sync_common", "sync_check", "sync_sweep", "sync_enqueue",
             "sync_items", "sync_settle", "sync_lease"),
    "dupe_batch": ("foreign", "dupe"), "errors": ("foreign",), "clusterstats": ("foreign",),
    "seeds_take": ("foreign", "seeds_common"), "seeds_adopt": ("seeds_common",)}

_LIBRARIES = frozenset({"sync"})  #: scripts that are also a FUNCTION library (see the module docstring)


@cache
def source(name: str, prelude: str = "", library: bool = False) -> str:
    """The Lua source of script ``name``: ``prelude`` (declarations its caller generates), its fragments, the
    script; ``library``: as a FUNCTION library whose one function is named like it (:func:`library_name`)."""
    lua = files("scrapy_dist.redis") / "lua"
    parts = [prelude] if prelude else []
    parts += [(lua / f"{part}.lua").read_text() for part in (*_FRAGMENTS.get(name, ()), name)]
    if name not in _LIBRARIES:
        return "\n".join(parts)
    # the fragments read KEYS and ARGV as upvalues, which <name>_call sets on every call
    body = "\n".join(["local KEYS, ARGV" + ("" if library else " = KEYS, ARGV"), *parts])
    if not library:
        return f"{body}\nreturn {name}_call(KEYS, ARGV)\n"
    # named by its content: workers of different versions each call their own
    tag = f"scrapy_dist_{name}_{hashlib.sha1(body.encode()).hexdigest()[:16]}"
    return f"#!lua name={tag}\n{body}\nredis.register_function('{tag}', {name}_call)\n"


def library_name(code: str) -> str:
    """The name of a FUNCTION library (and of its one function) from its ``#!lua name=`` line."""
    return code.split("\n", 1)[0].partition("name=")[2].strip()


class Library:
    """Script ``name`` (one of :data:`_LIBRARIES`) for an asyncio client: FCALL of its FUNCTION library,
    loaded on first use and again when the server lost it; EVALSHA when ``functions`` is False or the
    server refuses FUNCTION LOAD or FCALL (Redis < 7, an ACL), for good after the first refusal."""

    def __init__(self, client: Any, name: str, prelude: str = "", functions: bool = True) -> None:
        self.client, self.script = client, client.register_script(source(name, prelude))
        self.code = source(name, prelude, library=True)
        self.function = library_name(self.code)
        #: None: not loaded yet; True: FCALL; False: EVALSHA
        self.functions: bool | None = None if functions else False

    async def __call__(self, keys: list[Any], args: list[Any]) -> Any:
        for _ in range(2):
            if self.functions is None:
                await self._load()
            if not self.functions:
                break
            try:
                return await self.client.fcall(self.function, len(keys), *keys, *args)
            except NoPermissionError:
                self.functions = False
            except ResponseError as exc:
                if "unknown command" in (message := str(exc)).lower():
                    self.functions = False
                elif "Function not found" in message:
                    self.functions = None  # lost by the server: loaded again
                else:
                    raise
        return await self.script(keys=keys, args=args)

    async def _load(self) -> None:
        try:
            await self.client.function_load(self.code, replace=True)
        except ResponseError as exc:  # no FUNCTION here (Redis < 7, an ACL, a proxy): EVALSHA it is
            self.functions = False
            if not isinstance(exc, NoPermissionError) and "unknown command" not in str(exc).lower():
                # anything else (a library Redis would not compile, say) is worth a look
                logger.warning("Could not load the %s FUNCTION library (%s): calling it by EVALSHA instead",
                               self.function, exc)
        else:
            self.functions = True


def register(client: Any, name: str) -> Any:
    """``client.register_script`` for script ``name`` (works for sync, asyncio and cluster clients)."""
    return client.register_script(source(name))


def text(value: Any) -> str:
    """A reply value as text: bytes decoded as UTF-8 (bad bytes replaced), ``None`` as ``""``."""
    if value is None:
        return ""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def count(value: Any) -> int:
    """A counter others may write: a decimal integer of at most 18 digits, else 0 (the scripts heal it)."""
    t = text(value)
    return int(t) if t.isascii() and t.isdigit() and len(t) <= 18 else 0


def hash_fields(raw: Any, what: str) -> dict[str, str]:
    """An ``HGETALL`` reply as text -> text; :class:`RejectedEntry` if it is not a mapping."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise RejectedEntry("not_a_hash", f"{what} hash reply of type {type(raw).__name__}")
    return {text(k): text(v) for k, v in raw.items()}
