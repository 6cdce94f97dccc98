"""The dupefilter's figures for ``scrapy-dist status``, the dashboard and the metrics, read from what the
crawl's filter keys hold (untrusted: garbage gives ``{"kind": "garbage"}``, never an exception): items,
fill and estimated false-positive rate of the bloom filter (with ``DUPEFILTER_TTL``, over its live
generations) or of the exact fingerprint SET / ZSET, summed over the shards of a sharded frontier."""

from __future__ import annotations

from typing import Any

from scrapy_dist.dupefilter.bloom import SCHEMES, BloomPlan, Generations
from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.redis.replies import hash_fields
from scrapy_dist.settings import defaults


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
