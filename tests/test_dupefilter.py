"""BloomDupeFilter / SetDupeFilter against a real Redis."""

from __future__ import annotations

import multiprocessing
import os
import random
from pathlib import Path
from typing import Any

import pytest
import redis

from scrapy_dist.dupefilter import CALL_TOKENS, BloomDupeFilter, SetDupeFilter
from scrapy_dist.dupefilter.bloom import WINDOW_BITS, BloomPlan, fingerprint_hashes
from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.redis.keys import CrawlKeys

KEYS = CrawlKeys("df")


def _tokens(fps: list[bytes]) -> list[tuple[int, int]]:
    return [fingerprint_hashes(fp) for fp in fps]


def _seen(df: BloomDupeFilter, fps: list[bytes], batch: int = 500, add: bool = True) -> list[bool]:
    out: list[bool] = []
    toks = _tokens(fps)
    for i in range(0, len(toks), batch):
        out += df.seen_tokens(toks[i : i + batch], add=add)
    return out


def _rand_fps(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(20) for _ in range(n)]


def test_plan_sizes_and_error_budget() -> None:
    plan = BloomPlan(1_000_000, 0.001)
    assert plan.bytes_per_item_at_capacity <= 2.0
    assert plan.false_positive_rate(1_000_000) <= 0.001
    # past the declared capacity the compound rate stays within the target
    assert plan.false_positive_rate(20_000_000) <= 0.001
    # a small crawl allocates a small fraction of the full-capacity bitmap
    assert plan.memory_bytes(10_000) < plan.memory_bytes(1_000_000) / 10
    big = BloomPlan(100_000_000, 0.001)
    assert big.memory_bytes(20_000) < 200_000
    assert all(s.hashes >= 1 and s.bits > 0 for s in big.filters_for(10**9))


@pytest.mark.parametrize("capacity", [20_000, 1_000_000, 100_000_000, 10**9])
def test_layout_4_caps_hashes_at_the_largest_filters_within_memory_and_error(capacity: int) -> None:
    plan = BloomPlan(capacity, 0.001)
    assert plan.scheme == 4
    largest = plan.spec(plan.planned - 1).hashes
    assert largest <= 10
    assert all(s.hashes <= largest for s in plan.filters_for(capacity * 8))
    assert all(plan.spec(i).hashes <= largest - 2 for i in range(plan.planned - 1))
    assert plan.bytes_per_item_at_capacity <= 2.0
    assert plan.false_positive_rate(capacity) <= 0.001
    assert plan.false_positive_rate(capacity * 8) <= 0.001


@pytest.mark.parametrize(("capacity", "items"), [(10**6, 20_000), (10**8, 200_000), (10**8, 2_000_000)])
def test_layout_4_keeps_a_small_crawl_practically_free_of_false_positives(capacity: int, items: int) -> None:
    """Fewer hashes must not cost the small filters their tight error rates: a crawl far below its
    capacity takes a new URL for a duplicate about as rarely as with layout 3 (within 3x, below 1e-5)."""
    new, old = BloomPlan(capacity, 0.001), BloomPlan(capacity, 0.001, scheme=3)
    assert new.false_positive_rate(items) <= max(3 * old.false_positive_rate(items), 1e-9)
    assert new.false_positive_rate(items) < 1e-5


def test_layout_3_plan_is_kept_for_the_crawls_that_recorded_it() -> None:
    old, new = BloomPlan(100_000_000, 0.001, scheme=3), BloomPlan(100_000_000, 0.001)
    assert [s.hashes for s in old.filters_for(10**6)] == [24, 20, 17, 14]
    assert [s.hashes for s in new.filters_for(10**6)] == [8, 8, 8, 8]
    assert [s.hashes for s in new.filters_for(10**8)][3:] == [8, 10, 10]  # the largest, then past capacity
    with pytest.raises(ScrapyDistError, match="layout 2"):
        BloomPlan(1000, 0.01, scheme=2)


def test_a_crawl_recorded_with_layout_3_is_read_with_its_plan(redis_client: Any) -> None:
    fields = {"capacity": 100_000_000, "error_rate": "0.001", "block_bits": 2**31, "hashing": 3}
    redis_client.hset(KEYS.bloom, mapping=fields)
    first = BloomDupeFilter(redis_client, KEYS, None)
    first.open()
    assert first.plan.scheme == 3 and first.plan.spec(0).hashes == 24
    fps = _rand_fps(3000, 7)
    assert _seen(first, fps) == [False] * 3000
    later = BloomDupeFilter(redis_client, KEYS, None)
    later.open()
    assert later.plan.scheme == 3
    assert _seen(later, fps, add=False) == [True] * 3000


def test_an_insert_into_the_small_filters_writes_8_bits(redis_client: Any) -> None:
    df = BloomDupeFilter(redis_client, KEYS, None)  # the default capacity: a small crawl's first filters
    df.open()
    assert redis_client.hget(KEYS.bloom, "hashing") == b"4"
    redis_client.config_resetstat()
    _seen(df, _rand_fps(2000, 8))
    setbits = int(redis_client.info("commandstats").get("cmdstat_setbit", {}).get("calls", 0))
    assert 2000 * 6 < setbits <= 2000 * 8


def test_no_false_negatives_and_fpr_within_bounds(redis_client: Any) -> None:
    df = BloomDupeFilter(redis_client, KEYS, None, capacity=20_000, error_rate=0.01)
    df.open()
    inserted = _rand_fps(20_000, 1)
    _seen(df, inserted)
    assert all(_seen(df, inserted, add=False)), "an inserted fingerprint was reported unseen"
    unseen = _rand_fps(20_000, 2)
    fpr = sum(_seen(df, unseen, add=False)) / len(unseen)
    assert fpr <= 0.01 * 1.2, fpr
    n = int(redis_client.hget(KEYS.bloom, "n"))
    assert n == df.n and 20_000 - 2 * fpr * 20_000 <= n <= 20_000  # checks did not insert


def test_growth_past_the_first_block_and_filter(redis_client: Any) -> None:
    df = BloomDupeFilter(redis_client, KEYS, None, capacity=3_000, error_rate=0.01, block_bits=8192)
    df.open()
    fps = _rand_fps(9_000, 3)  # three times the declared capacity
    new = _seen(df, fps)
    assert sum(new) <= 0.01 * len(fps)  # only false positives may be "seen" on first insert
    assert all(_seen(df, fps))
    blocks = [k for k in redis_client.keys(KEYS.bloom + ":*")]
    filters = {k.decode().split(":")[-2] for k in blocks}
    assert len(filters) >= 2  # grew past the declared capacity into a new filter
    assert sum(1 for k in blocks if k.decode().split(":")[-2] == "0") >= 2  # and past the first block
    assert max(redis_client.strlen(k) for k in blocks) <= 8192 // 8  # blocks respect the block size
    assert int(redis_client.hget(KEYS.bloom, "n")) == df.n


def test_an_insert_sets_k_distinct_bits_inside_one_window(redis_client: Any) -> None:
    df = BloomDupeFilter(redis_client, KEYS, None, capacity=50_000, error_rate=0.001)
    df.open()
    assert df.seen_tokens(_tokens(_rand_fps(1, 6))) == [False]
    first = df.plan.spec(0)
    blocks = [redis_client.get(KEYS.bloom_block(0, b)) for b in range(first.blocks)]
    assert all(len(b) == first.block_windows * WINDOW_BITS // 8 for b in blocks)  # allocated whole
    ones = [(b, i * 8 + bit) for b, data in enumerate(blocks) for i, byte in enumerate(data)
            for bit in range(8) if byte & (0x80 >> bit)]
    assert len(ones) == first.hashes  # k bits, all distinct
    assert len({b for b, _ in ones}) == 1 and len({pos // WINDOW_BITS for _, pos in ones}) == 1


def test_memory_per_url_at_capacity(redis_client: Any) -> None:
    """At most 2 bytes per URL at a CI-sized capacity, by Redis's own MEMORY USAGE of the filled filter's
    keys. A capacity whose filter is a few large keys: at one cut into a few dozen small keys, what the
    allocator adds per key (more with jemalloc, Redis 7's default build, than with libc) would decide the
    figure."""
    capacity = 150_000
    df = BloomDupeFilter(redis_client, KEYS, None, capacity=capacity, error_rate=0.001)
    df.open()
    _seen(df, _rand_fps(capacity, 7))
    used = sum(redis_client.memory_usage(k, samples=0) or 0 for k in redis_client.keys(KEYS.bloom + "*"))
    assert used / capacity <= 2.0, used / capacity
    assert used >= df.plan.memory_bytes(capacity)  # the planned bitmaps really are allocated
    unseen = _rand_fps(20_000, 8)
    assert sum(_seen(df, unseen, add=False)) / len(unseen) <= 0.0012 * 1.5  # a small sample: some slack


def _evalsha_calls(client: Any) -> int:
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_a_big_batch_is_short_calls_in_one_round_trip(redis_client: Any) -> None:
    """A batch is cut into script calls of CALL_TOKENS fingerprints (each brief: Redis serves other
    workers in between and keeps them out of its slow log), pipelined, answered in the batch's order; a
    fingerprint twice in the batch is new only the first time, across call boundaries too."""
    df = BloomDupeFilter(redis_client, KEYS, None, capacity=50_000, error_rate=0.0001)
    df.open()
    fresh = _tokens(_rand_fps(3 * CALL_TOKENS + 17, 9))
    batch = fresh + fresh[: CALL_TOKENS + 5]
    calls = _evalsha_calls(redis_client)
    seen = df.seen_tokens(batch)
    assert _evalsha_calls(redis_client) - calls == -(-len(batch) // CALL_TOKENS)
    assert seen == [False] * len(fresh) + [True] * (CALL_TOKENS + 5)
    assert int(redis_client.hget(KEYS.bloom, "n")) == len(fresh)


def test_a_big_batch_survives_redis_forgetting_the_script(redis_client: Any) -> None:
    df = BloomDupeFilter(redis_client, KEYS, None, capacity=50_000, error_rate=0.0001)
    df.open()
    first, second = _tokens(_rand_fps(300, 10)), _tokens(_rand_fps(300, 11))
    assert df.seen_tokens(first) == [False] * 300
    redis_client.script_flush()  # as after a restart without persistence of the script cache
    assert df.seen_tokens(first + second) == [True] * 300 + [False] * 300
    assert df.seen_tokens(second, add=False) == [True] * 300


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hashing", "2", "layout 2"),
        ("capacity", "lots", "invalid parameters"),
        ("error_rate", "1.5", "invalid parameters"),
        ("block_bits", "100", "invalid parameters"),
    ],
)
def test_refuses_a_filter_recorded_with_other_or_invalid_parameters(
    redis_client: Any, field: str, value: str, message: str
) -> None:
    redis_client.hset(KEYS.bloom, field, value)
    df = BloomDupeFilter(redis_client, KEYS, None, capacity=5_000, error_rate=0.01)
    with pytest.raises(ScrapyDistError, match=message) as info:
        df.open()
    assert "SCHEDULER_FLUSH_ON_START" in str(info.value)


def test_adopts_the_parameters_recorded_by_the_first_worker(redis_client: Any) -> None:
    first = BloomDupeFilter(redis_client, KEYS, None, capacity=5_000, error_rate=0.01)
    first.open()
    later = BloomDupeFilter(redis_client, KEYS, None, capacity=9_999, error_rate=0.05)
    later.open()
    assert (later.plan.capacity, later.plan.error_rate) == (5_000, 0.01)


def _race(url: str, fps: list[bytes], out: Any) -> None:
    client = redis.Redis.from_url(url)
    df = BloomDupeFilter(client, KEYS, None, capacity=50_000, error_rate=0.001)
    df.open()
    # batches of 1,000: each goes as pipelined calls of CALL_TOKENS, racing the other process's calls
    out.put([i for i, seen in enumerate(_seen(df, fps, batch=1000)) if not seen])


def test_two_processes_racing_admit_each_url_once(redis_url: str) -> None:
    fps = _rand_fps(10_000, 4)
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_race, args=(redis_url, fps, q)) for _ in range(2)]
    for p in procs:
        p.start()
    admitted = [q.get(timeout=60), q.get(timeout=60)]
    for p in procs:
        p.join(10)
    both = set(admitted[0]) & set(admitted[1])
    assert not both, f"{len(both)} URLs admitted by both processes"
    # every URL admitted by exactly one of them, but for the filter's own false positives
    assert len(set(admitted[0]) | set(admitted[1])) >= 10_000 - 20


def test_set_dupefilter_is_exact_and_stores_raw_fingerprints(redis_client: Any) -> None:
    df = SetDupeFilter(redis_client, KEYS, None)
    fps = _rand_fps(1_000, 5)
    toks = [(fp, "") for fp in fps]
    assert df.seen_tokens(toks) == [False] * 1000
    assert df.seen_tokens(toks) == [True] * 1000
    members = redis_client.smembers(KEYS.fingerprints)
    assert len(members) == 1000 and all(len(m) == 20 for m in members)


@pytest.mark.slow
def test_scrapy_default_scheduler_with_bloom_dupefilter(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    from crawlproject import make_project

    site = site_factory(pages=200)
    project = make_project(tmp_path, {"REDIS_URL": redis_url})
    project.settings.pop("SCHEDULER")  # Scrapy's own scheduler, our dupefilter
    project.crawl(args={"seed": site.page_url(0)})
    assert project.wait_all(120) == [0], project.logs()[-3000:]
    counts = site.fetch_counts()
    assert len(counts) == 200
    assert max(counts.values()) == 1, "a page was fetched twice"
    stats = project.stats(0)
    assert stats["dupefilter/filtered"] > 0
    assert int(redis.Redis.from_url(redis_url).hget(KEYS.__class__("links").bloom, "n")) == 200
    assert os.path.exists(tmp_path / "worker-0.log")
