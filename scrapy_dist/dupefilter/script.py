"""The dupefilter's own script calls and a worker's memory of the fingerprints it sent.

:class:`DupeScript` runs ``lua/dupe_batch.lua`` (test-and-set, test or forget a batch of fingerprints)
outside the frontier's ``sync`` call: under Scrapy's scheduler (``request_seen``), for ``contains``,
``forget`` and the benchmarks; it chunks, pipelines and retries, and the filter says which keys and params
to pass. :class:`RecentFingerprints` lets the scheduler skip a fingerprint this process sent a moment ago
(a menu link on every page); a forget clears it at the next sync, and otherwise it is bounded in time.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any

from redis.exceptions import NoScriptError

from scrapy_dist.dupefilter.bloom import BloomParameterError
from scrapy_dist.exceptions import FrontierScriptError, FrontierStateError, ScrapyDistError
from scrapy_dist.redis import connection, scripts
from scrapy_dist.redis.scripts import text
from scrapy_dist.utils import RateLimitedLog

logger = logging.getLogger(__name__)

#: fingerprints per script call: short calls let other clients' commands run between them, and the calls
#: of one batch are pipelined, so a smaller call costs no round trip
CALL_TOKENS = 48


def refusal(reason: Any, detail: Any) -> ScrapyDistError:
    """The error for a script's ``{-2, reason, detail}`` answer (nothing was written), in one line."""
    reason = reason.decode() if isinstance(reason, bytes) else str(reason)
    detail = detail.decode(errors="replace") if isinstance(detail, bytes) else str(detail)
    if reason == "bloom_clock":
        return ScrapyDistError(
            f"{detail}: this machine's clock is more than DUPEFILTER_TTL/(BLOOMFILTER_GENERATIONS-1)"
            " seconds off the Redis server's; set it right (NTP)"
        )
    if reason.startswith("bloom"):
        return BloomParameterError(
            f"{detail} field n: refused by the filter ({reason}): not a count within the filter's bound"
            f" ({'the bound' if reason == 'bloom_bound' else 'garbage'})"
        )
    return FrontierStateError(reason, detail)


class DupeScript:
    """``dupe_batch.lua`` on one client."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self._repaired = RateLimitedLog(logger)
        self.script = scripts.register(redis, "dupe_batch")
        redis.script_load(self.script.script)  # the pipelined calls below are plain EVALSHA

    def run(self, df: Any, op: str, tokens: list[tuple[Any, Any]], now: float | None = None) -> list[bool]:
        """``op`` ("add", "check" or "forget") over ``tokens`` for filter ``df``: script calls of at most
        :data:`CALL_TOKENS` fingerprints each, pipelined in one round trip (one per call on Redis
        Cluster). Each fingerprint's test-and-set is atomic, and the calls run in order, so a fingerprint
        twice in a batch is new only the first time. True where the fingerprint was already seen. (One
        call per batch would hold Redis for the whole batch, and land in its slow log, arguments and all.)
        """
        chunks = [
            [x if isinstance(x, bytes) else str(x) for pair in tokens[i : i + CALL_TOKENS] for x in pair]
            for i in range(0, len(tokens), CALL_TOKENS)
        ]
        flags: list[str | None] = [None] * len(chunks)
        for _ in range(64):
            todo = [i for i, f in enumerate(flags) if f is None]
            if not todo:
                return [f == "0" for chunk in flags for f in chunk or ""]
            pending = sum(len(chunks[i]) // 2 for i in todo) if op == "add" else 0
            mode, keys, params = df.script_args(pending, now)
            head = [op, mode, "" if now is None else repr(now), len(params), *params]
            answers = self.calls(keys, [[*head, *chunks[i]] for i in todo])
            for i, answer in zip(todo, answers, strict=True):
                if answer is None:  # Redis had lost the script: loaded again, run again
                    continue
                if answer[0] == -2:  # refused, nothing written (dupe.lua: garbage, past the bound, ...)
                    raise refusal(answer[1], answer[2])
                got, n = answer[0], answer[1]
                for raw in answer[2] if len(answer) > 2 and isinstance(answer[2], list) else ():
                    key = text(raw)
                    self._repaired.log(
                        logging.WARNING, "Repaired garbage in %s (written by someone else?) before writing",
                        key, key=key,
                    )
                df.observe(int(n))
                if got != -1:  # -1: the chain grew past the keys passed (another worker): again with more
                    flags[i] = got.decode() if isinstance(got, bytes) else got
        raise FrontierScriptError("bloom filter chain did not settle")  # pragma: no cover

    def calls(self, keys: list[str], argvs: list[list[Any]]) -> list[Any]:
        """Answers of one script call per ``argvs`` entry, in order: pipelined (not as a transaction) in
        one round trip, or on Redis Cluster one call after the other. None for a pipelined call Redis
        refused with NOSCRIPT (a restart or SCRIPT FLUSH), once the script is loaded again."""
        if len(argvs) == 1 or connection.is_cluster(self.redis):
            # redis-py reloads the script by itself; its cluster pipelines refuse EVALSHA, so a cluster
            # client makes one round trip per call (all the keys are on one node anyway)
            return [self.script(keys=keys, args=args) for args in argvs]
        pipe = self.redis.pipeline(transaction=False)
        for args in argvs:
            pipe.evalsha(self.script.sha, len(keys), *keys, *args)
        answers = pipe.execute(raise_on_error=False)
        for answer in answers:
            if isinstance(answer, Exception) and not isinstance(answer, NoScriptError):
                raise answer
        if any(isinstance(a, NoScriptError) for a in answers):
            self.redis.script_load(self.script.script)
        return [None if isinstance(a, NoScriptError) else a for a in answers]


# -- the fingerprints this worker sent ---------------------------------------------------------------------
#: most fingerprints remembered per generation (the memory is cleared when one is full)
RECENT_LIMIT = 500_000
#: seconds a sent fingerprint is trusted when the filter remembers forever: long, since a shorter memory
#: makes a worker send its menus' links again and again (docs/continuous.md)
RECENT_MAX_AGE = 600.0


class RecentFingerprints:
    """Fingerprint tokens this process sent, each trusted for at most ``max_age`` seconds (``0``: none
    is kept). Methods take ``now`` (``time.monotonic()``), so tests need no sleeps."""

    def __init__(self, max_age: float = RECENT_MAX_AGE, limit: int = RECENT_LIMIT) -> None:
        self.max_age = max_age
        self.limit = limit
        self._current: set[Hashable] = set()
        self._previous: set[Hashable] = set()
        self._since: float | None = None

    def _rotate(self, now: float) -> None:
        if self._since is None:
            self._since = now
            return
        age = now - self._since
        if age >= self.max_age:  # both generations are too old
            self.clear()
            self._since = now
        elif age >= self.max_age / 2:
            self._previous, self._current = self._current, set()
            self._since = now

    def seen(self, token: Hashable, now: float) -> bool:
        """Whether ``token`` was sent recently enough to be certainly known crawl-wide; remembers it if not
        (the caller sends it)."""
        if self.max_age <= 0:
            return False
        self._rotate(now)
        if token in self._current or token in self._previous:
            return True
        self.add(token, now)
        return False

    def add(self, token: Hashable, now: float) -> None:
        """Remember ``token`` as sent at ``now``."""
        if self.max_age <= 0:
            return
        self._rotate(now)
        if len(self._current) >= self.limit:
            self.clear()
            self._since = now
        self._current.add(token)

    def discard(self, token: Hashable) -> None:
        """Forget ``token`` (its URL was made new again by this worker)."""
        self._current.discard(token)
        self._previous.discard(token)

    def clear(self) -> None:
        """Forget everything (after an outage: what was sent may not have arrived)."""
        self._current.clear()
        self._previous.clear()

    def __len__(self) -> int:
        return len(self._current) + len(self._previous)
