"""The crawl-wide state of one crawl, read from Redis for ``scrapy-dist status`` (and for scripts).

:func:`read_status` costs three or four round trips (a time check, two pipelines, and an ``HSCAN`` of the
lease index while it is small) and returns plain, JSON-ready data, summed over a sharded frontier's
shards; the helpers that turn raw replies into figures are pure functions of their input and ``now``.
Everything read is untrusted: control and worker hashes go through their one parser each, and garbage
figures become ``None``, listed under ``"garbage"``, so ``status`` never crashes or stalls on them. The
dupefilter's figures (:func:`filter_figures`): items, fill and estimated false-positive rate of the bloom
filter (with ``DUPEFILTER_TTL``, over its live generations) or of the exact fingerprint SET / ZSET, summed
over the shards; garbage gives ``{"kind": "garbage"}``, never an exception.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from typing import Any

from redis.exceptions import ResponseError

from scrapy_dist.dupefilter.bloom import SCHEMES, BloomPlan, Generations
from scrapy_dist.exceptions import RejectedEntry, ScrapyDistError
from scrapy_dist.extensions.clusterstats import CLOSED, LOST, RUNNING, parse_worker_hash, worker_state
from scrapy_dist.frontier.layout import ControlState, parse_control
from scrapy_dist.frontier.orders import busiest_domains
from scrapy_dist.frontier.shard import lease_parts
from scrapy_dist.monitor import bounded_id, bounded_text, decode_hash, decode_stats, top_counts
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.redis.scripts import count as untrusted_count
from scrapy_dist.redis.scripts import hash_fields, text
from scrapy_dist.settings import defaults

#: Workers listed (most recently seen first); the summary counts all of them.
WORKER_LIMIT = 200
#: The lease index is scanned for per-worker lease counts only while it is at most this big.
LEASE_SCAN_LIMIT = 100_000



def window_totals(raw: dict[Any, Any], now: float) -> dict[str, Any]:
    """Totals of the error monitor's window (``{spider}:errors``) as of ``now`` (server time).

    Returns ``{"window": seconds or None, "attempts", "errors", "error_rate", "http", "download", "spider",
    "reasons": {reason: count}}``."""
    fields = decode_hash(raw)
    try:
        bucket_s = float(fields.get("_bucket", ""))
        window = float(fields.get("_window", ""))
    except ValueError:
        bucket_s = window = 0.0
    if not (0 < bucket_s <= 86400 and 0 < window <= 10**7):  # also False for NaN
        bucket_s = window = 0.0
    totals: Counter[str] = Counter()
    if bucket_s > 0:
        for field, value in fields.items():
            bucket, sep, name = field.partition("|")
            if not sep or not (bucket.isascii() and bucket.isdigit() and len(bucket) <= 15):
                continue
            # a bucket ahead of now is garbage (the error monitor's script deletes it), not fresh for ever
            fresh = now - window < (int(bucket) + 1) * bucket_s and int(bucket) <= now // bucket_s + 1
            if fresh and value.isascii() and value.isdigit() and len(value) <= 15:
                totals[name] += int(value)
    attempts, errors = totals.get("attempts", 0), totals.get("errors", 0)
    reasons = dict(top_counts((k[2:], n) for k, n in totals.items() if k.startswith("r:")))
    return {
        "window": window or None,
        "attempts": attempts,
        "errors": errors,
        "error_rate": round(errors / attempts, 4) if attempts else None,
        "http": totals.get("http", 0),
        "download": totals.get("download", 0),
        "spider": totals.get("spider", 0),
        "reasons": reasons,
    }


def leases_by_worker(lease_keys: Iterable[Any], meta_values: Iterable[Any] = ()) -> Counter[str]:
    """Count leases per worker id: from the tags of lease keys
    (:func:`scrapy_dist.frontier.shard.lease_parts`) and from lease meta values (``"<score> <worker id>"``:
    leases filed without a tag)."""
    out: Counter[str] = Counter()
    for key in lease_keys:
        tagged = lease_parts(key if isinstance(key, bytes) else text(key).encode())[2]
        if tagged is not None:
            out[text(tagged)] += 1
    for value in meta_values:
        out[text(value).partition(" ")[2]] += 1
    return out


def worker_rows(
    members: list[tuple[Any, float]],
    details: list[dict[Any, Any]],
    leases: Counter[str] | None,
    now: float,
    default_interval: float,
) -> list[dict[str, Any]]:
    """One JSON-ready row per worker, running first, then lost, then closed, most recently seen first."""
    rows: list[dict[str, Any]] = []
    for (member, last_seen), raw in zip(members, details, strict=True):
        try:
            info = parse_worker_hash(raw)
        except RejectedEntry:
            info = parse_worker_hash({})
        wid = bounded_id(member)
        seen = float(last_seen)
        if not math.isfinite(seen):  # ZADD accepts +inf: such a worker is never "seen" at any real time
            seen = 0.0
        state = worker_state(
            {"state": info.state, "interval": "" if info.interval is None else repr(info.interval)},
            seen, now, default_interval,
        )
        if leases is not None:
            inflight: int | None = leases.get(text(member), 0)
        elif info.inflight is not None:
            inflight = info.inflight + (info.prefetched or 0)
        else:
            inflight = None
        running = state == RUNNING
        row: dict[str, Any] = {
            "id": wid,
            "host": info.host or bounded_text(wid.split(":", 1)[0]),
            "pid": info.pid,
            "state": state,
            "last_seen": round(seen, 3),
            "seen_ago": round(min(max(0.0, now - seen), 1e10), 1),
            "started": info.started,
            "pages": info.pages,
            "items": info.items,
            "errors": info.errors,
            "leases": inflight,
            # of its leases: handed to the engine / prefetched, per its last heartbeat (running only)
            "in_flight": info.inflight if running else None,
            "prefetched": info.prefetched if running else None,
            "pages_per_min": (info.pages_per_min or 0.0) if state == RUNNING else 0.0,
            "finish_reason": info.finish_reason or None,
        }
        if info.garbage:
            row["garbage"] = list(info.garbage)
        rows.append(row)
    order = {RUNNING: 0, LOST: 1, CLOSED: 2}
    rows.sort(key=lambda r: (order[r["state"]], -r["last_seen"]))
    return rows


def crawl_state(control: ControlState, running: int, started: list[float | None] | None = None,
                now: float | None = None) -> str:
    """One word for the whole crawl: paused, running, closing (reason), closed (reason) or stopped (no
    worker running).

    ``started``: start times of the running workers. A close decision taken before all of them started
    (the previous run's ``finished``) is one they ignore, as :meth:`ControlState.close_reason` does: the
    crawl is running, not closing."""
    if control.paused:
        return "paused"
    if control.close and running:
        starts = started if started is not None else [None] * running
        if any(control.close_reason(s or 0.0, now) for s in starts):
            return f"closing ({control.close})"
        return "running"
    if control.close:
        return f"closed ({control.close})"
    return "running" if running else "stopped"


def _first_score(reply: Any) -> float | None:
    """The score of a one-member ``ZRANGE ... WITHSCORES`` reply, if it is a finite number."""
    if not (isinstance(reply, list) and reply and isinstance(reply[0], (list, tuple)) and len(reply[0]) == 2):
        return None
    try:
        score = float(reply[0][1])
    except (TypeError, ValueError):
        return None
    return score if math.isfinite(score) else None


def due_figures(client: Any, shards: list[CrawlKeys], now: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """When things come due, in one pipelined round trip; garbage counts as 0 / no time.

    Scheduled revisits (the delayed meta field ``revisits`` of each shard, see lua/sync_settle.lua) and how
    soon the delayed set's next entry (revisit or retry) comes due: ``{"scheduled": n, "next_in": seconds
    or None}``; and when the first and the last lease runs out (a lease that ran out goes back to the queue
    at the next sync of any worker): ``{"first_in": seconds or None, "last_in": seconds or None}``."""
    p = client.pipeline(transaction=False)
    for shard in shards:
        p.hget(shard.delayed_meta, "revisits")
        p.zrange(shard.delayed, 0, 0, withscores=True)
        p.zrange(shard.leases, 0, 0, withscores=True)
        p.zrange(shard.leases, -1, -1, withscores=True)
    replies = _replies(p, [None, [], [], []] * len(shards))
    scheduled = 0
    due: list[float] = []
    first: list[float] = []
    last: list[float] = []
    for i in range(0, len(replies), 4):
        raw = replies[i]
        held = text(raw)
        if held.isascii() and held.isdigit() and len(held) <= 15:
            scheduled += int(held)
        for found, reply in ((due, replies[i + 1]), (first, replies[i + 2]), (last, replies[i + 3])):
            score = _first_score(reply)
            if score is not None:
                found.append(score)

    def seconds(scores: list[float], pick: Any) -> float | None:
        return round(min(max(0.0, pick(scores) - now), 1e10), 1) if scores else None

    return ({"scheduled": scheduled, "next_in": seconds(due, min)},
            {"first_in": seconds(first, min), "last_in": seconds(last, max)})


def lease_breakdown(leased: int, workers: list[dict[str, Any]]) -> dict[str, int | None]:
    """The crawl's leases split by what holds them, from the running workers' last heartbeats:
    ``in_flight`` (handed to an engine), ``prefetched`` (leased ahead of demand: all that a paused worker
    holds) and ``other`` (the rest: leases of lost workers, waiting to expire, or taken since the last
    heartbeat). ``None`` figures when a running worker did not report them."""
    running = [w for w in workers if w["state"] == RUNNING]
    if any(w.get("in_flight") is None or w.get("prefetched") is None for w in running):
        return {"leased": leased, "in_flight": None, "prefetched": None, "other": None}
    in_flight = min(leased, sum(w["in_flight"] for w in running))
    prefetched = min(leased - in_flight, sum(w["prefetched"] for w in running))
    return {"leased": leased, "in_flight": in_flight, "prefetched": prefetched,
            "other": leased - in_flight - prefetched}


def _replies(pipe: Any, fallbacks: list[Any]) -> list[Any]:
    """A pipeline's replies, a key of the wrong type (``WRONGTYPE``: garbage written by someone) giving
    its fallback instead of an exception. Connection errors still raise."""
    from redis.exceptions import ResponseError

    out = pipe.execute(raise_on_error=False)
    for i, reply in enumerate(out):
        if isinstance(reply, ResponseError):
            out[i] = fallbacks[i]
        elif isinstance(reply, Exception):
            raise reply
    return out


def _valid_members(members: Any) -> bool:
    return isinstance(members, list) and all(isinstance(m, (tuple, list)) and len(m) == 2 for m in members)


def _domains(client: Any, shards: list[CrawlKeys], now: float, limit: int) -> list[dict[str, Any]]:
    """The busiest domains over every shard (a sharded crawl with crawl-wide politeness keeps each
    domain's state on its own shard)."""
    from redis.exceptions import ResponseError

    rows: list[dict[str, Any]] = []
    for keys in shards:
        try:
            found = busiest_domains(client, keys, now, limit)
        except (ValueError, TypeError, ArithmeticError, ScrapyDistError, ResponseError):
            continue  # garbage in the politeness keys: the rest of the status is still worth showing
        rows += [{**row, "domain": bounded_text(row["domain"])} for row in found]
    rows.sort(key=lambda r: (r["backlog"], r["in_flight"]), reverse=True)
    return rows[:limit]


def _scan_leases(client: Any, shards: list[CrawlKeys]) -> Counter[str] | None:
    """Leases per worker: the lease keys' tags and the lease meta HASH (None if a key holds another type)."""
    try:
        return leases_by_worker(
            [k for shard in shards for k, _ in client.zscan_iter(shard.leases, count=1000)],
            [v for shard in shards for _, v in client.hscan_iter(shard.lease_meta, count=1000)],
        )
    except ResponseError:
        return None


def read_status(
    client: Any,
    keys: CrawlKeys,
    *,
    default_interval: float = defaults.CLUSTERSTATS_INTERVAL,
    worker_limit: int = WORKER_LIMIT,
    lease_scan_limit: int = LEASE_SCAN_LIMIT,
    domain_limit: int = 10,
) -> dict[str, Any]:
    """Everything ``scrapy-dist status`` shows about the crawl of ``keys.spider``, as JSON-ready data.

    Per-worker lease counts come from a scan of the lease index while it holds at most
    ``lease_scan_limit`` leases (0: never scan; the workers' heartbeats then give them)."""
    sec, usec = client.time()
    now = int(sec) + int(usec) / 1e6
    p = client.pipeline(transaction=False)
    p.zcard(keys.queue)
    p.zcard(keys.leases)
    p.zcard(keys.delayed)
    p.llen(keys.deadletter)
    p.type(keys.start_urls)
    p.llen(keys.start_urls_processing)
    p.llen(keys.start_urls_rejected)
    p.llen(keys.queue_rejected)
    p.hgetall(keys.bloom)
    p.scard(keys.fingerprints)
    p.hgetall(keys.control)
    p.hgetall(keys.stats)
    p.hgetall(keys.errors)
    p.zrevrange(keys.workers, 0, worker_limit - 1, withscores=True)
    p.zcard(keys.workers)
    p.zcard(keys.leases)
    p.hget(keys.queue_tails, "count")  # requests queued (queue members may be chunks of several)
    p.zcard(keys.fingerprints_ttl)  # SetDupeFilter with DUPEFILTER_TTL
    (queued, inflight, delayed, dead, seeds_type, processing, seeds_rejected, queue_rejected, bloom,
     fingerprints, control_raw, stats_raw, errors_raw, members, n_workers, n_leases, counted,
     expiring) = _replies(p, [0, 0, 0, 0, "none", 0, 0, 0, {}, 0, {}, {}, {}, [], 0, 0, None, 0])
    if not _valid_members(members):
        members = []
    if queued:
        queued = max(int(queued), untrusted_count(counted))

    try:
        control = parse_control(control_raw)
    except RejectedEntry:
        control = ControlState(problems=("control hash unreadable",))
    shards = keys.shards(control.shards or 1)
    seeds_type = text(seeds_type)
    p = client.pipeline(transaction=False)
    count = {"list": p.llen, "set": p.scard, "zset": p.zcard}.get(seeds_type)
    if count is not None:
        count(keys.start_urls)
    for member, _ in members:
        p.hgetall(keys.worker(text(member)))
    for shard in shards[1:]:
        p.zcard(shard.queue)
        p.zcard(shard.leases)
        p.zcard(shard.delayed)
        p.llen(shard.queue_rejected)
        p.hgetall(shard.bloom)
        p.scard(shard.fingerprints)
        p.zcard(shard.leases)
        p.hget(shard.queue_tails, "count")
    fallbacks: list[Any] = [0] if count is not None else []
    fallbacks += [{}] * len(members) + [0, 0, 0, 0, {}, 0, 0, None] * len(shards[1:])
    replies = _replies(p, fallbacks)
    seeds_waiting = int(replies.pop(0)) if count is not None else 0
    filters = [filter_figures(bloom, int(fingerprints) + int(expiring))]
    for _ in shards[1:]:  # replies of the last shard are last: take them from the end
        s_queued, s_inflight, s_delayed, s_rejected, s_bloom, s_fps, s_leases, s_counted = replies[-8:]
        del replies[-8:]
        if s_queued:
            queued = int(queued) + max(int(s_queued), untrusted_count(s_counted))
        inflight = int(inflight) + int(s_inflight)
        delayed = int(delayed) + int(s_delayed)
        queue_rejected = int(queue_rejected) + int(s_rejected)
        n_leases = int(n_leases) + int(s_leases)
        filters.insert(1, filter_figures(s_bloom, int(s_fps)))
    leases = None
    if int(n_leases) <= lease_scan_limit:
        leases = _scan_leases(client, shards)

    workers = worker_rows(members, replies, leases, now, default_interval)
    states = Counter(w["state"] for w in workers)
    errors = window_totals(errors_raw, now)
    stats, stats_skipped = decode_stats(stats_raw)
    revisits, expiry = due_figures(client, shards, now)
    return {
        "spider": keys.spider,
        "time": round(now, 3),
        "state": crawl_state(control, states[RUNNING],
                             [w["started"] for w in workers if w["state"] == RUNNING], now),
        # "inflight": every lease (kept for scripts); "leases": what holds them
        "frontier": {"queued": int(queued), "inflight": int(inflight), "delayed": int(delayed)},
        "revisits": revisits,
        # what holds the leases, and when the first and the last run out (back in the queue then)
        "leases": {**lease_breakdown(int(inflight), workers), **expiry},
        "shards": len(shards),
        "deadletter": int(dead),
        "seeds": {
            "key": keys.start_urls,
            "type": seeds_type if seeds_type != "none" else None,
            "waiting": seeds_waiting,
            "processing": int(processing),
            "rejected": int(seeds_rejected),
        },
        "rejected": {"seeds": int(seeds_rejected), "queue": int(queue_rejected)},
        "filter": combine_filters(filters),
        "control": {
            "paused": control.paused,
            "paused_by": control.paused_by or None,
            "close": control.close or None,
            "close_at": control.close_at,
        },
        "rates": {
            "pages_per_min": round(sum(w["pages_per_min"] for w in workers), 1),
            "error_rate": errors["error_rate"],
        },
        "errors": errors,
        "workers_summary": {
            "running": states[RUNNING],
            "lost": states[LOST],
            "closed": states[CLOSED],
            "total": int(n_workers),
        },
        "workers": workers,
        "domains": _domains(client, shards, now, domain_limit),
        "garbage": {
            "control": list(control.problems),
            "workers": sum(1 for w in workers if w.get("garbage")),
            # stats fields skipped: numbers not finite or out of range, overlong names, over the limit
            "stats": stats_skipped,
        },
        "stats": stats,
    }


# -- the dupefilter's figures ------------------------------------------------------------------------------
def filter_figures(bloom: dict[Any, Any], fingerprints: int) -> dict[str, Any] | None:
    """Fill and estimated false-positive rate of the crawl's dupefilter (bloom hash or fingerprint SET);
    ``{"kind": "garbage"}`` if the bloom hash holds parameters no filter could have."""
    try:
        return _filter_figures(bloom, fingerprints)
    except (ValueError, TypeError, ArithmeticError, ScrapyDistError):
        return {"kind": "garbage", "items": None, "fill": None, "fpr_estimate": None}


def _filter_figures(bloom: dict[Any, Any], fingerprints: int) -> dict[str, Any] | None:
    b = hash_fields(bloom, "bloom")
    if b.get("capacity"):
        cap = b["capacity"]
        if not (cap.isascii() and cap.isdigit() and len(cap) <= 14 and 0 < int(cap) <= 10**13):
            raise ValueError("capacity")
        if not 0 < float(b.get("error_rate") or "nan") < 1:
            raise ValueError("error_rate")
        n_text = b.get("n") or "0"
        if not (n_text.isascii() and n_text.isdigit() and len(n_text) <= 19):
            raise ValueError("n")
        scheme = next((x for x in SCHEMES if b.get("hashing") == str(x)), 3)  # an estimate: 3 if unknown
        plan = BloomPlan(int(b["capacity"]), float(b["error_rate"]),
                         int(b.get("block_bits") or defaults.BLOOMFILTER_BLOCK_BITS), scheme=scheme)
        n = int(b.get("n") or 0)
        if float(b.get("ttl") or 0) > 0:
            return _generation_figures(b, plan)
        return {
            "kind": "bloom",
            "items": n,
            "capacity": plan.capacity,
            "error_rate": plan.error_rate,
            "fill": round(n / plan.capacity, 6),
            "fpr_estimate": plan.false_positive_rate(n),
            "memory_bytes": plan.memory_bytes(n) if n else 0,
        }
    if fingerprints:
        return {"kind": "set", "items": fingerprints, "fill": None, "fpr_estimate": 0.0}
    return None


def _generation_figures(b: dict[str, str], base: BloomPlan) -> dict[str, Any]:
    """Figures of a bloom filter with ``DUPEFILTER_TTL``: ``live`` items over its generations, each
    generation's chain holding about 1/G of them (an estimate: the counts per generation are not read)."""
    gens = Generations(float(b["ttl"]), int(b.get("generations") or 4))
    live_text = b.get("live") or "0"
    if not (live_text.isascii() and live_text.isdigit() and len(live_text) <= 19):
        raise ValueError("live")
    live = int(live_text)
    plan = gens.plan(base.capacity, base.error_rate, base.block_bits, base.scheme)
    per = live // gens.count
    return {
        "kind": "bloom", "items": live, "capacity": base.capacity, "error_rate": base.error_rate,
        "fill": round(live / base.capacity, 6), "ttl": gens.ttl, "generations": gens.count,
        "fpr_estimate": min(1.0, gens.count * plan.false_positive_rate(per)),
        "memory_bytes": gens.count * plan.memory_bytes(per) if per else 0,
    }


def combine_filters(figures: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The filter figures of a sharded frontier (one filter per shard) as one: items, capacity and memory
    summed; the false-positive estimate is the worst shard's (a URL is looked up in one shard only)."""
    present = [f for f in figures if f is not None]
    if any(f["kind"] == "garbage" for f in present):
        return {"kind": "garbage", "items": None, "fill": None, "fpr_estimate": None, "shards": len(figures)}
    if len(present) <= 1:
        return present[0] if present else None
    items = sum(f["items"] for f in present)
    out = {**present[0], "items": items, "fpr_estimate": max(f["fpr_estimate"] for f in present)}
    if present[0]["kind"] == "bloom":
        capacity = sum(f["capacity"] for f in present)
        out.update(capacity=capacity, fill=round(items / capacity, 6),
                   memory_bytes=sum(f["memory_bytes"] for f in present))
    out["shards"] = len(figures)
    return out
