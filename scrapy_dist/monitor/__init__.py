"""Reading a running crawl from outside: :func:`read_status` (``scrapy-dist status``), the Prometheus exporter
(``metrics``) and the dashboard. Everything read is untrusted: texts are cut, numbers kept only when finite
and in range, lists capped (the rest summed as ``other``), garbage becomes ``None`` and is counted."""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from redis.exceptions import ResponseError

from scrapy_dist.dupefilter.bloom import SCHEMES, BloomPlan, Generations
from scrapy_dist.exceptions import RejectedEntry, ScrapyDistError
from scrapy_dist.extensions.clusterstats import CLOSED, LOST, RUNNING, parse_worker_hash, worker_state
from scrapy_dist.frontier.layout import ControlState, parse_control, server_time
from scrapy_dist.frontier.orders import busiest_domains, parse_record
from scrapy_dist.frontier.shard import lease_parts
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.redis.scripts import count as untrusted_count
from scrapy_dist.redis.scripts import hash_fields, text
from scrapy_dist.settings import defaults

__all__ = ["ID_LIMIT", "MAX_VALUE", "REASON_LIMIT", "STAT_LIMIT", "TEXT_LIMIT", "bounded_id", "bounded_text",
           "decode_stats", "filter_figures", "finite", "read_status", "top_counts"]

ID_LIMIT = 120  #: longest worker id an answer carries; longer ones are cut, made unique
TEXT_LIMIT = 200  #: Longest free text (a host, a reason, a stat's text value) an answer carries.
MAX_VALUE = float(2**63)  #: largest number kept from Redis (beyond, or not finite: skipped, counted)
STAT_LIMIT = 1000  #: Stats fields an answer carries at most.
REASON_LIMIT = 20  #: reasons listed per answer; the rarer ones are summed as ``other``
WORKER_LIMIT = 200  #: Workers listed (most recently seen first); the summary counts all of them.
LEASE_SCAN_LIMIT = 100_000  #: per-worker lease counts come from a scan of at most this many
#: Stats kept before any other when the stats hash is over :data:`STAT_LIMIT`.
ESSENTIAL_STATS = frozenset({"response_received_count", "item_scraped_count", "item_dropped_count",
                             "scheduler/enqueued", "downloader/response_bytes", "log_count/ERROR",
                             "start_time", "finish_time", "finish_reason"})


def bounded_text(value: Any, limit: int = TEXT_LIMIT) -> str:
    """``value`` as text, cut to ``limit`` characters (ending in ``…`` when cut)."""
    s = text(value)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def bounded_id(value: Any, limit: int = ID_LIMIT) -> str:
    """An id cut to ``limit`` characters, a cut one ending in ``…`` and 8 hex digits of its digest."""
    if len(s := text(value)) <= limit:
        return s
    digest = hashlib.blake2b(s.encode("utf-8", "surrogatepass"), digest_size=4).hexdigest()
    return f"{s[: limit - 9]}…{digest}"


def finite(value: Any) -> float | None:
    """``value`` as a float if it is a finite number within :data:`MAX_VALUE`, else ``None``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    with contextlib.suppress(OverflowError):  # an int too large for a float
        if math.isfinite(number := float(value)) and abs(number) <= MAX_VALUE:
            return number
    return None


def _whole(text: str, digits: int) -> int | None:
    return int(text) if text.isascii() and text.isdigit() and len(text) <= digits else None


def _number(text: str) -> int | float | str | None:
    """A stat's text as a number, the text itself (cut) if no number, ``None`` if a number out of range."""
    if len(text) <= 40:
        with contextlib.suppress(ValueError):
            whole = int(text)
            return whole if abs(whole) <= MAX_VALUE else None
        with contextlib.suppress(ValueError):
            return finite(float(text))
    return bounded_text(text)


def decode_stats(raw: Mapping[Any, Any] | None, limit: int = STAT_LIMIT) -> tuple[dict[str, Any], int]:
    """The crawl-wide stats hash with numbers as numbers, sorted by name, and how many fields were skipped
    (numbers out of range, overlong names, fields beyond ``limit``; :data:`ESSENTIAL_STATS` kept first)."""
    fields = hash_fields(raw, "stats")
    names = sorted(k for k in fields if len(k) <= TEXT_LIMIT)
    skipped = len(fields) - len(names)
    if len(names) > limit:
        first = [k for k in names if k in ESSENTIAL_STATS]
        rest = [k for k in names if k not in ESSENTIAL_STATS][: limit - len(first)]
        skipped += len(names) - len(first) - len(rest)
        names = sorted(first + rest)
    values = {name: _number(fields[name]) for name in names}
    out = {name: value for name, value in values.items() if value is not None}
    return out, skipped + len(values) - len(out)


def top_counts(counts: Mapping[str, int] | Iterable[tuple[str, int]], limit: int = REASON_LIMIT,
               text_limit: int = 100) -> list[tuple[str, int]]:
    """The ``limit`` largest counts (names cut to ``text_limit``), the rest summed as ``other``."""
    merged: Counter[str] = Counter()
    for name, n in counts.items() if isinstance(counts, Mapping) else counts:
        merged[bounded_text(name, text_limit)] += n
    top = dict(merged.most_common(limit))
    if rest := sum(merged.values()) - sum(top.values()):
        top["other"] = top.get("other", 0) + rest
    return list(top.items())


def dead_reasons(client: Any, keys: CrawlKeys, sample: int) -> Counter[str]:
    """The newest ``sample`` dead letters (0: all) counted by reason (cut to 60 characters)."""
    reasons: Counter[str] = Counter()
    for raw in client.lrange(keys.deadletter, 0, sample - 1) or []:
        try:
            reasons[parse_record(raw).reason[:60]] += 1
        except RejectedEntry:
            reasons["unreadable"] += 1
    return reasons


def window_totals(raw: dict[Any, Any], now: float) -> dict[str, Any]:
    """Totals of the error monitor's window (``{spider}:errors``) as of ``now`` (server time)."""
    fields = hash_fields(raw, "errors")
    bucket_s = window = 0.0
    with contextlib.suppress(ValueError):
        bucket_s, window = float(fields.get("_bucket", "")), float(fields.get("_window", ""))
    if not (0 < bucket_s <= 86400 and 0 < window <= 10**7):  # also False for NaN
        bucket_s = window = 0.0
    totals: Counter[str] = Counter()
    for field, value in fields.items() if bucket_s > 0 else ():
        bucket_text, sep, name = field.partition("|")
        bucket, count = _whole(bucket_text, 15), _whole(value, 15)
        if not sep or bucket is None or count is None:
            continue
        # a bucket ahead of now is garbage (the error monitor's script deletes it), not fresh for ever
        if now - window < (bucket + 1) * bucket_s and bucket <= now // bucket_s + 1:
            totals[name] += count
    attempts, errors = totals.get("attempts", 0), totals.get("errors", 0)
    reasons = dict(top_counts((k[2:], n) for k, n in totals.items() if k.startswith("r:")))
    return {"window": window or None, "attempts": attempts, "errors": errors,
            "error_rate": round(errors / attempts, 4) if attempts else None, "http": totals.get("http", 0),
            "download": totals.get("download", 0), "spider": totals.get("spider", 0), "reasons": reasons}


def leases_by_worker(lease_keys: Iterable[Any], meta_values: Iterable[Any] = ()) -> Counter[str]:
    """Leases per worker id: from the tags of lease keys and lease meta values (``"<score> <worker>"``)."""
    out: Counter[str] = Counter()
    for key in lease_keys:
        if (tagged := lease_parts(key if isinstance(key, bytes) else text(key).encode())[2]) is not None:
            out[text(tagged)] += 1
    for value in meta_values:
        out[text(value).partition(" ")[2]] += 1
    return out


def worker_rows(members: list[tuple[Any, float]], details: list[dict[Any, Any]], leases: Counter[str] | None,
                now: float, default_interval: float) -> list[dict[str, Any]]:
    """One JSON-ready row per worker, running first, then lost, then closed, most recently seen first."""
    rows: list[dict[str, Any]] = []
    for (member, last_seen), raw in zip(members, details, strict=True):
        info = parse_worker_hash(raw)  # an HGETALL reply, or {} for a key of another type
        wid, seen = bounded_id(member), float(last_seen)
        if not math.isfinite(seen):  # ZADD accepts +inf: such a worker is never "seen" at any real time
            seen = 0.0
        interval = "" if info.interval is None else repr(info.interval)
        state = worker_state({"state": info.state, "interval": interval}, seen, now, default_interval)
        inflight = None if info.inflight is None else info.inflight + (info.prefetched or 0)
        if leases is not None:
            inflight = leases.get(text(member), 0)
        running = state == RUNNING
        row: dict[str, Any] = {
            "id": wid, "host": info.host or bounded_text(wid.split(":", 1)[0]), "pid": info.pid,
            "state": state, "last_seen": round(seen, 3), "seen_ago": round(min(max(0, now - seen), 1e10), 1),
            "started": info.started, "pages": info.pages, "items": info.items, "errors": info.errors,
            "leases": inflight,
            # of its leases: handed to the engine / prefetched, per its last heartbeat (running only)
            "in_flight": info.inflight if running else None,
            "prefetched": info.prefetched if running else None,
            "pages_per_min": (info.pages_per_min or 0.0) if running else 0.0,
            "finish_reason": info.finish_reason or None}
        if info.garbage:
            row["garbage"] = list(info.garbage)
        rows.append(row)
    return sorted(rows, key=lambda r: ((RUNNING, LOST, CLOSED).index(r["state"]), -r["last_seen"]))


def crawl_state(control: ControlState, running: int, started: list[float | None], now: float | None) -> str:
    """One word for the whole crawl: paused, running, closing (reason), closed (reason) or stopped. A close
    decision taken before all ``started`` (the running workers' start times) is ignored, as they do."""
    if control.paused:
        return "paused"
    if control.close and not running:
        return f"closed ({control.close})"
    if control.close and any(control.close_reason(s or 0.0, now) for s in started):
        return f"closing ({control.close})"
    return "running" if running else "stopped"


def due_figures(client: Any, shards: list[CrawlKeys], now: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """Scheduled revisits and when the next comes due; when the first and the last lease run out."""
    p = client.pipeline(transaction=False)
    for shard in shards:
        p.hget(shard.delayed_meta, "revisits").zrange(shard.delayed, 0, 0, withscores=True)
        p.zrange(shard.leases, 0, 0, withscores=True).zrange(shard.leases, -1, -1, withscores=True)
    replies = _replies(p, [None, [], [], []] * len(shards))
    scheduled = sum(_whole(text(reply), 15) or 0 for reply in replies[0::4])
    # the first delayed, first leased and last leased score of each shard (ZADD accepts +inf: not one)
    due, first, last = ([r[0][1] for r in replies[j::4] if r and math.isfinite(r[0][1])] for j in (1, 2, 3))

    def seconds(scores: list[float], pick: Any) -> float | None:
        return round(min(max(0.0, pick(scores) - now), 1e10), 1) if scores else None
    return ({"scheduled": scheduled, "next_in": seconds(due, min)},
            {"first_in": seconds(first, min), "last_in": seconds(last, max)})


def lease_breakdown(leased: int, workers: list[dict[str, Any]]) -> dict[str, int | None]:
    """The crawl's leases by holder, per the running workers' heartbeats: ``in_flight`` (handed to an engine),
    ``prefetched`` and ``other`` (lost workers', or newer); ``None`` when a running worker did not say."""
    running = [w for w in workers if w["state"] == RUNNING]
    if any(w.get("in_flight") is None or w.get("prefetched") is None for w in running):
        return {"leased": leased, "in_flight": None, "prefetched": None, "other": None}
    in_flight = min(leased, sum(w["in_flight"] for w in running))
    prefetched = min(leased - in_flight, sum(w["prefetched"] for w in running))
    return {"leased": leased, "in_flight": in_flight, "prefetched": prefetched,
            "other": leased - in_flight - prefetched}


def _replies(pipe: Any, fallbacks: list[Any]) -> list[Any]:
    """A pipeline's replies, a key of the wrong type (garbage) giving its fallback; other errors raise."""
    out = pipe.execute(raise_on_error=False)
    for i, reply in enumerate(out):
        if isinstance(reply, ResponseError):
            out[i] = fallbacks[i]
        elif isinstance(reply, Exception):
            raise reply
    return out


def _domains(client: Any, shards: list[CrawlKeys], now: float, limit: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for keys in shards:
        try:
            found = busiest_domains(client, keys, now, limit)
        except (ValueError, TypeError, ArithmeticError, ScrapyDistError, ResponseError):
            continue  # garbage in the politeness keys: the rest of the status is still worth showing
        rows += [{**row, "domain": bounded_text(row["domain"])} for row in found]
    rows.sort(key=lambda r: (r["backlog"], r["in_flight"]), reverse=True)
    return rows[:limit]


def read_status(client: Any, keys: CrawlKeys, *, default_interval: float = defaults.CLUSTERSTATS_INTERVAL,
                worker_limit: int = WORKER_LIMIT, lease_scan_limit: int = LEASE_SCAN_LIMIT,
                domain_limit: int = 10, dead_sample: int = 0) -> dict[str, Any]:
    """Everything ``scrapy-dist status`` shows about the crawl, as JSON-ready data. Per-worker lease counts
    come from a scan of the leases while at most ``lease_scan_limit`` (0: never; else from heartbeats);
    ``dead_sample``: the newest dead letters counted by reason (``dead_reasons``), if any."""
    now = server_time(client)
    p = client.pipeline(transaction=False)
    p.llen(keys.deadletter).type(keys.start_urls)
    p.llen(keys.start_urls_processing).llen(keys.start_urls_rejected).hgetall(keys.control).hgetall(keys.stats).hgetall(keys.errors)
    p.zrevrange(keys.workers, 0, worker_limit - 1, withscores=True).zcard(keys.workers)
    p.zcard(keys.fingerprints_ttl)  # SetDupeFilter with DUPEFILTER_TTL
    (dead, seeds_type, processing, seeds_rejected, control_raw, stats_raw, errors_raw, members, n_workers,
     expiring) = _replies(p, [0, "none", 0, 0, {}, {}, {}, [], 0, 0])
    control = parse_control(control_raw)
    shards = keys.shards(control.shards or 1)
    seeds_type = text(seeds_type)
    p = client.pipeline(transaction=False)
    if (count := {"list": p.llen, "set": p.scard, "zset": p.zcard}.get(seeds_type)) is not None:
        count(keys.start_urls)
    for member, _ in members:
        p.hgetall(keys.worker(text(member)))
    for shard in shards:
        p.zcard(shard.queue).zcard(shard.leases).zcard(shard.delayed).llen(shard.queue_rejected)
        p.hgetall(shard.bloom).scard(shard.fingerprints).hget(shard.queue_tails, "count")
    fallbacks: list[Any] = [0] if count is not None else []
    replies = _replies(p, fallbacks + [{}] * len(members) + [0, 0, 0, 0, {}, 0, None] * len(shards))
    seeds_waiting = int(replies.pop(0)) if count is not None else 0
    details, per_shard = replies[: len(members)], replies[len(members):]
    queues, leased, delays, rejects, blooms, fingerprints, tails = (per_shard[j::7] for j in range(7))
    # queue members may be chunks of several requests: the tails count them
    queued = sum(max(int(n), untrusted_count(tail)) for n, tail in zip(queues, tails, strict=True) if n)
    inflight, delayed, queue_rejected = (sum(int(n) for n in column) for column in (leased, delays, rejects))
    filters = [filter_figures(bloom, int(n) + (int(expiring) if i == 0 else 0))
               for i, (bloom, n) in enumerate(zip(blooms, fingerprints, strict=True))]
    leases = None
    if inflight <= lease_scan_limit:
        with contextlib.suppress(ResponseError):  # a key of another type: no per-worker counts
            tagged = [k for s in shards for k, _ in client.zscan_iter(s.leases, count=1000)]
            meta = [v for s in shards for _, v in client.hscan_iter(s.lease_meta, count=1000)]
            leases = leases_by_worker(tagged, meta)
    workers = worker_rows(members, details, leases, now, default_interval)
    states = Counter(w["state"] for w in workers)
    errors = window_totals(errors_raw, now)
    stats, stats_skipped = decode_stats(stats_raw)
    revisits, expiry = due_figures(client, shards, now)
    started = [w["started"] for w in workers if w["state"] == RUNNING]
    status = {
        "spider": keys.spider, "time": round(now, 3),
        "state": crawl_state(control, len(started), started, now),
        # "inflight": every lease (kept for scripts); "leases": what holds them, and when they run out
        "frontier": {"queued": queued, "inflight": inflight, "delayed": delayed},
        "revisits": revisits,
        "leases": {**lease_breakdown(inflight, workers), **expiry},
        "shards": len(shards),
        "deadletter": int(dead),
        "seeds": {"key": keys.start_urls, "type": seeds_type if seeds_type != "none" else None,
                  "waiting": seeds_waiting, "processing": int(processing), "rejected": int(seeds_rejected)},
        "rejected": {"seeds": int(seeds_rejected), "queue": queue_rejected},
        "filter": combine_filters(filters),
        "control": {"paused": control.paused, "paused_by": control.paused_by or None,
                    "close": control.close or None, "close_at": control.close_at},
        "rates": {"pages_per_min": round(sum(w["pages_per_min"] for w in workers), 1),
                  "error_rate": errors["error_rate"]},
        "errors": errors,
        "workers_summary": {"running": states[RUNNING], "lost": states[LOST], "closed": states[CLOSED],
                            "total": int(n_workers)},
        "workers": workers,
        "domains": _domains(client, shards, now, domain_limit),
        "garbage": {"control": list(control.problems), "workers": sum(1 for w in workers if w.get("garbage")),
                    "stats": stats_skipped},
        "stats": stats,
    }
    if dead_sample:
        status["dead_reasons"] = dict(top_counts(dead_reasons(client, keys, dead_sample), REASON_LIMIT, 60))
    return status


def filter_figures(bloom: dict[Any, Any], fingerprints: int) -> dict[str, Any] | None:
    """Fill and estimated false-positive rate of the dupefilter (``garbage``: parameters no filter has)."""
    try:
        if not (b := hash_fields(bloom, "bloom")).get("capacity"):
            figures = {"kind": "set", "items": fingerprints, "fill": None, "fpr_estimate": 0.0}
            return figures if fingerprints else None
        capacity, n = _whole(b["capacity"], 14), _whole(b.get("n") or "0", 19)
        if capacity is None or not 0 < capacity <= 10**13 or n is None:
            raise ValueError("capacity or n")
        if not 0 < float(b.get("error_rate") or "nan") < 1:
            raise ValueError("error_rate")
        scheme = next((x for x in SCHEMES if b.get("hashing") == str(x)), 3)  # an estimate: 3 if unknown
        block_bits = int(b.get("block_bits") or defaults.BLOOMFILTER_BLOCK_BITS)
        base = BloomPlan(capacity, float(b["error_rate"]), block_bits, scheme=scheme)
        out = {"kind": "bloom", "items": n, "capacity": base.capacity, "error_rate": base.error_rate}
        if float(b.get("ttl") or 0) <= 0:
            return {**out, "fill": round(n / base.capacity, 6), "fpr_estimate": base.false_positive_rate(n),
                    "memory_bytes": base.memory_bytes(n) if n else 0}
        # with DUPEFILTER_TTL: each generation is estimated to hold 1/G of the live items
        gens = Generations(float(b["ttl"]), int(b.get("generations") or 4))
        if (live := _whole(b.get("live") or "0", 19)) is None:
            raise ValueError("live")
        plan, per = gens.plan(capacity, base.error_rate, block_bits, scheme), live // gens.count
        return {**out, "items": live, "fill": round(live / base.capacity, 6), "ttl": gens.ttl,
                "generations": gens.count,
                "fpr_estimate": min(1.0, gens.count * plan.false_positive_rate(per)),
                "memory_bytes": gens.count * plan.memory_bytes(per) if per else 0}
    except (ValueError, TypeError, ArithmeticError, ScrapyDistError):
        return {"kind": "garbage", "items": None, "fill": None, "fpr_estimate": None}


def combine_filters(figures: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """One filter's figures from each shard's: sums, and the worst shard's false-positive estimate."""
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
