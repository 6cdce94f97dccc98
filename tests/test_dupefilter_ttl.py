"""Fingerprints that expire (DUPEFILTER_TTL) and fingerprints that are forgotten, against a real Redis.

Time is injected (the scripts take ``now``) rather than slept: the bloom filter's generations, the exact
filter's expiry and the keys' own Redis expiry are all checked at chosen instants."""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any, cast

import pytest
import redis
import redis.asyncio
from click.testing import CliRunner
from helpers import open_bloom_scheduler, run
from scrapy import Request
from scrapy.utils.request import RequestFingerprinter

from scrapy_dist.cli import main
from scrapy_dist.dupefilter import BloomDupeFilter, SetDupeFilter
from scrapy_dist.dupefilter.bloom import BloomPlan, Generations, fingerprint_hashes
from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.frontier.scheduler import Scheduler
from scrapy_dist.frontier.shard import Frontier, SyncBatch
from scrapy_dist.monitor import filter_figures
from scrapy_dist.redis import scripts
from scrapy_dist.redis.keys import CrawlKeys

KEYS = CrawlKeys("ttl")
TTL = 3000.0  # seconds; G = 4 -> span 1000 s


def _fps(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(20) for _ in range(n)]


def _bloom(
    client: Any, ttl: float | None = TTL, generations: int = 4, capacity: int = 20_000
) -> BloomDupeFilter:
    df = BloomDupeFilter(client, KEYS, None, ttl=ttl, capacity=capacity, error_rate=0.001,
                         generations=generations)
    df.open()
    return df


def _add(df: Any, fps: list[bytes], now: float) -> list[bool]:
    """True where already seen (test-and-set at ``now``)."""
    return df.run_batch("add", [df.fingerprint_tokens(fp) for fp in fps], now=now)


def _start() -> float:
    """A moment just after a generation boundary, near the real clock (the keys' Redis expiry is relative
    to the injected time, so any instant works; near now keeps the numbers readable)."""
    span = TTL / 3
    return (int(time.time() / span) + 1) * span + 1.0


def test_generations_precision_and_live_range() -> None:
    g = Generations(3000, 4)
    assert g.span == 1000 and g.expiry_bounds() == (3000, 4000)
    assert list(g.live(5500)) == [2, 3, 4, 5] and list(g.passed(5500)) == [1, 2, 3, 4, 5, 6]
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ScrapyDistError, match="DUPEFILTER_TTL"):
            Generations(bad, 4)
    with pytest.raises(ScrapyDistError, match="BLOOMFILTER_GENERATIONS"):
        Generations(10, 1)


def test_bloom_forgets_between_ttl_and_ttl_g_over_g_minus_1(redis_client: Any) -> None:
    df = _bloom(redis_client)
    t0 = _start()
    early, late = _fps(200, 1), _fps(200, 2)
    assert _add(df, early, t0) == [False] * 200  # start of generation e
    assert _add(df, late, t0 + 998) == [False] * 200  # end of the same generation
    # remembered for at least TTL after being seen ...
    assert all(_add(df, early, t0 + TTL - 1)) and all(_add(df, late, t0 + TTL - 1))
    # ... those seen at a generation's start are new again at TTL*G/(G-1) (4000 s), those seen at its end
    # just past TTL: both within [TTL, TTL*4/3]
    t_expire = t0 - 1 + 4 * 1000
    assert _add(df, late, t_expire - 0.5) == [True] * 200
    assert _add(df, early, t_expire + 0.5) == [False] * 200
    assert _add(df, late, t_expire + 0.5) == [False] * 200
    assert t_expire + 0.5 - (t0 + 998) > TTL and t_expire + 0.5 - t0 <= TTL * 4 / 3 + 1


def test_generation_keys_expire_in_redis_when_they_stop_being_live(redis_client: Any) -> None:
    df = _bloom(redis_client)
    t0 = _start()
    _add(df, _fps(50, 3), t0)
    e = df.gens.current(t0)
    gen_hash = KEYS.bloom_generation(e)
    blocks = [k for k in redis_client.keys(f"{KEYS.tag}:bloom:g{e}:*")]
    assert blocks and int(redis_client.hget(gen_hash, "n")) == 50
    # expiry: (e + G) * span - now seconds from the (injected) now of the call that created them
    want_ms = ((e + 4) * 1000 - t0) * 1000
    for key in [gen_hash, *blocks]:
        assert abs(redis_client.pttl(key) - want_ms) < 5000, key
    assert int(redis_client.hget(KEYS.bloom, "live")) == 50
    assert redis_client.hget(KEYS.bloom, "ttl") == repr(TTL).encode()


def test_dedupe_stays_exact_across_a_rotation_while_two_workers_insert(redis_url: str) -> None:
    """Two workers insert overlapping fingerprints while their calls cross a generation boundary: every
    fingerprint is new exactly once over both (nothing is lost or doubled by the rotation)."""
    fps = _fps(3000, 4)
    t0 = _start() + 1000 - 30  # 30 s before the next boundary
    results: dict[str, list[tuple[bytes, bool]]] = {}

    def worker(name: str, order: list[bytes]) -> None:
        client = redis.Redis.from_url(redis_url)
        df = _bloom(client)
        out = []
        for i in range(0, len(order), 100):
            chunk = order[i : i + 100]
            now = t0 + i / len(order) * 60  # the boundary is crossed half way
            out += list(zip(chunk, _add(df, chunk, now), strict=True))
        results[name] = out
        client.close()

    rng = random.Random(5)
    a, b = fps[:], fps[:]
    rng.shuffle(a)
    rng.shuffle(b)
    threads = [threading.Thread(target=worker, args=(n, o)) for n, o in (("A", a), ("B", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    new = [fp for r in results.values() for fp, seen in r if not seen]
    assert len(new) == len(set(new)) == len(fps)
    client = redis.Redis.from_url(redis_url)
    gens = sorted(k for k in client.keys(f"{KEYS.tag}:bloom:g*") if k.count(b":") == 2)
    assert len(gens) == 2  # both sides of the boundary were written


def test_worker_adopts_the_recorded_ttl(redis_client: Any, caplog: Any) -> None:
    _bloom(redis_client, ttl=TTL)
    later = _bloom(redis_client, ttl=None)
    assert later.gens is not None and later.gens.ttl == TTL
    assert "DUPEFILTER_TTL=None" in caplog.text


def test_a_clock_far_off_the_servers_is_refused_in_one_line(redis_client: Any) -> None:
    df = _bloom(redis_client, ttl=30.0)  # span 10 s
    toks = [df.fingerprint_tokens(fp) for fp in _fps(3, 6)]
    mode, keys, params = df.script_args(3, now=time.time() - 3600)  # this worker believes it is an hour ago
    client = redis_client
    script = client.register_script(scripts.source("dupe_batch"))
    pairs = [str(x) for t in toks for x in t]
    answer = script(keys=keys, args=["add", mode, "", len(params), *params, *pairs])
    assert answer[0] == -2 and answer[1] == b"bloom_clock"
    assert not client.keys(f"{KEYS.tag}:bloom:g*")  # nothing written


def test_exact_filter_expires_each_fingerprint_at_ttl(redis_client: Any) -> None:
    df = SetDupeFilter(redis_client, KEYS, None, ttl=100.0)
    fps = _fps(20, 7)
    t0 = 1_000_000.0
    assert _add(df, fps[:10], t0) == [False] * 10
    assert _add(df, fps[:10], t0 + 99.9) == [True] * 10
    assert _add(df, fps[:10], t0 + 100.0) == [False] * 10  # exactly TTL: new again, remembered anew
    assert _add(df, fps[:10], t0 + 199.9) == [True] * 10
    # expired entries are dropped from memory by later calls (a bounded number each)
    assert _add(df, fps[10:], t0 + 100.0) == [False] * 10
    _add(df, fps[10:11], t0 + 500)
    assert redis_client.zcard(KEYS.fingerprints_ttl) == 1
    assert df.run_batch("check", [df.fingerprint_tokens(fps[10])], now=t0 + 500) == [True]


def test_set_filter_ttl_in_the_sync_script(redis_url: str, redis_client: Any) -> None:
    df = SetDupeFilter(redis_client, KEYS, None, ttl=50.0)
    fp = _fps(1, 8)[0]

    async def go() -> list[list[bool]]:
        f = Frontier(redis.asyncio.Redis.from_url(redis_url), KEYS, "w1", df)
        out = []
        for now in (1000, 1049, 1050):
            got = await f.sync(SyncBatch(enqueue=[(fp, "", 0, b"", "", "")]), now=now)
            out.append(got.new)
        await f.redis.aclose()
        return out

    assert run(go()) == [[True], [False], [True]]


def test_bloom_ttl_in_the_sync_script(redis_url: str, redis_client: Any) -> None:
    df = _bloom(redis_client)
    t1, t2 = fingerprint_hashes(_fps(1, 9)[0])
    t0 = _start()

    async def go() -> list[list[bool]]:
        f = Frontier(redis.asyncio.Redis.from_url(redis_url), KEYS, "w1", df)
        out = []
        for now in (t0, t0 + TTL - 1, t0 + 4000):
            got = await f.sync(SyncBatch(enqueue=[(t1, t2, 0, b"", "", "")]), now=now)
            out.append(got.new)
        await f.redis.aclose()
        return out

    assert run(go()) == [[True], [False], [True]]


# -- forgetting --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["bloom", "bloom-ttl", "set", "set-ttl"])
def test_forget_makes_a_fingerprint_new_exactly_once(redis_client: Any, kind: str) -> None:
    ttl = TTL if kind.endswith("ttl") else None
    df: Any = _bloom(redis_client, ttl=ttl) if kind.startswith("bloom") else SetDupeFilter(
        redis_client, KEYS, None, ttl=ttl
    )
    now = _start()
    fps = _fps(30, 10)
    _add(df, fps, now)
    df.run_batch("forget", [df.fingerprint_tokens(fp) for fp in fps[:10]], now=now)
    checked = df.run_batch("check", [df.fingerprint_tokens(fp) for fp in fps], now=now)
    assert checked == [False] * 10 + [True] * 20
    assert _add(df, fps, now + 1) == [False] * 10 + [True] * 20
    assert _add(df, fps, now + 2) == [True] * 30  # admitted once, remembered again
    assert redis_client.scard(KEYS.forgotten) == 0


def test_dead_letter_section_forgets_in_the_same_call(redis_url: str, redis_client: Any) -> None:
    df = _bloom(redis_client, ttl=None)
    fp = _fps(1, 11)[0]
    t1, t2 = fingerprint_hashes(fp)

    async def go() -> tuple[list[bool], list[bool]]:
        f = Frontier(redis.asyncio.Redis.from_url(redis_url), KEYS, "w1", df)
        await f.sync(SyncBatch(enqueue=[(t1, t2, 0, b"", "", "")]))
        await f.sync(SyncBatch(dead=['{"u": "x"}'], forget=[(t1, t2)]))
        again = await f.sync(SyncBatch(enqueue=[(t1, t2, 0, b"", "", "")]))
        twice = await f.sync(SyncBatch(enqueue=[(t1, t2, 0, b"", "", "")]))
        await f.redis.aclose()
        return again.new, twice.new

    assert run(go()) == ([True], [False])
    assert redis_client.llen(KEYS.deadletter) == 1


def test_forget_command_for_urls_file_and_fingerprints(
    redis_url: str, redis_client: Any, tmp_path: Any
) -> None:
    keys = CrawlKeys("books")
    bloom = BloomDupeFilter(redis_client, keys, RequestFingerprinter(), capacity=10_000)
    bloom.open()
    exact = SetDupeFilter(redis_client, keys, RequestFingerprinter())
    urls = [f"https://books.example/p/{i}" for i in range(6)]
    reqs = [Request(u) for u in urls]
    bloom.seen_tokens([bloom.tokens(r) for r in reqs])
    exact.seen_tokens([exact.tokens(r) for r in reqs])
    listed = tmp_path / "urls.txt"
    listed.write_text(f"{urls[1]}\n\n{urls[2]}\n")
    hexfp = RequestFingerprinter().fingerprint(reqs[3]).hex()
    result = CliRunner().invoke(
        main, ["--redis-url", redis_url, "forget", "books", urls[0], "--file", str(listed),
               "--fingerprint", hexfp],
    )
    assert result.exit_code == 0, result.output
    assert "forgot 4 fingerprints of 'books' (bloom and exact filter)" in result.output
    again = [bloom.tokens(r) for r in reqs]
    assert bloom.seen_tokens(again) == [False] * 4 + [True] * 2
    assert exact.seen_tokens([exact.tokens(r) for r in reqs]) == [False] * 4 + [True] * 2


@pytest.mark.parametrize("args, message", [
    (["books"], "name URLs"),
    (["books", "not a url"], "not a URL"),
    (["books", "--fingerprint", "zz"], "not a hexadecimal fingerprint"),
])
def test_forget_command_mistakes_are_one_line(redis_url: str, args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["--redis-url", redis_url, "forget", *args])
    assert result.exit_code != 0 and message in result.output
    assert "Traceback" not in result.output


def test_forget_on_a_bloom_key_of_another_type_is_one_line(redis_url: str, redis_client: Any) -> None:
    keys = CrawlKeys("books")
    redis_client.set(keys.bloom, "someone else's")
    result = CliRunner().invoke(main, ["--redis-url", redis_url, "forget", "books", "https://books.example/"])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "{books}:bloom is a string" in lines[0], result.output
    assert redis_client.get(keys.bloom) == b"someone else's"  # left for the operator to look at


# -- through the scheduler -----------------------------------------------------------------------------

async def _opened(redis_url: str, **settings: Any) -> Scheduler:
    return cast("Scheduler", await open_bloom_scheduler(redis_url, "ttl", **settings))


@pytest.mark.parametrize("forget", [True, False])
def test_deadletter_forget_lets_the_next_run_fetch_the_url_again(redis_url: str, forget: bool) -> None:
    async def go() -> int:
        first = await _opened(redis_url, DEADLETTER_FORGET=forget)
        assert first.loop is not None
        for url in ("http://site.test/dead", "http://site.test/ok"):
            first.enqueue_request(Request(url))
        await first.loop.round(lease=0, renew=False)
        first.dead_letter('{"u": "http://site.test/dead"}', Request("http://site.test/dead"))
        await first.loop.round(lease=0, renew=False)
        await first.redis.aclose()
        second = await _opened(redis_url)  # the next run finds both links again
        assert second.loop is not None
        for url in ("http://site.test/dead", "http://site.test/ok"):
            second.enqueue_request(Request(url))
        await second.loop.round(lease=0, renew=False)
        await second.redis.aclose()
        return int(second.stats.get_value("dupefilter/filtered", 0))

    assert run(go()) == (1 if forget else 2)  # duplicates in the second run
    client = redis.Redis.from_url(redis_url)
    assert client.llen(CrawlKeys("ttl").deadletter) == 1
    queued = int(client.hget(CrawlKeys("ttl").queue_tails, "count") or 0)
    # the forgotten URL was queued again in the second run; without DEADLETTER_FORGET it stays seen
    assert queued == (3 if forget else 2)


def test_dupefilter_ttl_setting_reaches_the_filters(redis_url: str) -> None:
    async def go() -> tuple[Any, Any]:
        sched = await _opened(redis_url, DUPEFILTER_TTL=3600, BLOOMFILTER_GENERATIONS=7)
        await sched.redis.aclose()
        recorded = redis.Redis.from_url(redis_url).hmget(CrawlKeys("ttl").bloom, ["ttl", "generations"])
        return sched.df.gens, recorded

    gens, recorded = run(go())
    assert (gens.ttl, gens.count) == (3600, 7) and recorded == [b"3600.0", b"7"]


def test_a_busy_generation_grows_in_small_steps_not_by_doubling() -> None:
    plan = Generations(3000, 4).plan(3_000_000, 0.001, 2**31)
    assert plan.capacity == 1_000_000
    last = plan.spec(plan.planned - 1)
    step = plan.spec(plan.planned)
    assert round(last.capacity / 4) == step.capacity
    # a span 25% busier than planned costs ~1.7x the memory of a full generation (doubling: ~3x), 10% ~1.3x
    assert plan.memory_bytes(1_250_000) < 1.75 * plan.memory_bytes(1_000_000)
    assert plan.memory_bytes(1_100_000) < 1.35 * plan.memory_bytes(1_000_000)
    assert plan.false_positive_rate(plan.max_items) <= 0.001 / 4
    classic = BloomPlan(1_000_000, 0.001 / 4)
    assert classic.memory_bytes(1_250_000) > 2.5 * classic.memory_bytes(1_000_000)


def test_status_reads_the_live_items_of_the_generations() -> None:
    figures = filter_figures({b"capacity": b"3000000", b"error_rate": b"0.001", b"ttl": b"86400.0",
                              b"generations": b"4", b"live": b"1200000", b"hashing": b"3"}, 0)
    assert figures is not None and figures["items"] == 1_200_000 and figures["ttl"] == 86400
    assert figures["generations"] == 4 and 0 < figures["fpr_estimate"] < 0.001
    garbage = filter_figures({b"capacity": b"3000000", b"error_rate": b"0.001", b"ttl": b"86400.0",
                              b"live": b"lots"}, 0)
    assert garbage is not None and garbage["kind"] == "garbage"


def test_hostile_forgotten_and_generation_contents(redis_client: Any) -> None:
    """A string at {spider}:forgotten is ignored (dedupe goes on); a garbage count in a generation's hash
    is recounted from its blocks and written back with the generation's expiry (refusing it stopped the
    crawl); a ZSET score is a number, so the exact filter's entries cannot be garbage."""
    df = _bloom(redis_client)
    now = _start()
    redis_client.set(KEYS.forgotten, "not a set")
    fps = _fps(5, 12)
    assert _add(df, fps, now) == [False] * 5
    df.run_batch("forget", [df.fingerprint_tokens(fps[0])], now=now)
    assert _add(df, fps, now) == [True] * 5
    assert redis_client.get(KEYS.forgotten) == b"not a set"
    more = _fps(400, 14)
    assert _add(df, more, now) == [False] * 400
    gen_hash = KEYS.bloom_generation(df.gens.current(now))
    for i, garbage in enumerate(("9" * 30, "-4", "0")):
        redis_client.hset(gen_hash, "n", garbage)
        assert _add(df, [*more[:10], *_fps(1, 20 + i)], now) == [True] * 10 + [False]
        assert 405 * 0.85 < int(redis_client.hget(gen_hash, "n")) < 408 * 1.15
        assert redis_client.pttl(gen_hash) > 0  # still goes when the generation stops being live
    assert all(_add(df, more + fps, now))
    assert 405 * 0.85 < int(redis_client.hget(KEYS.bloom, "live")) < 408 * 1.15


def test_forget_command_says_when_the_crawl_remembers_nothing(redis_url: str) -> None:
    result = CliRunner().invoke(main, ["--redis-url", redis_url, "forget", "empty", "https://e.example/"])
    assert result.exit_code == 0 and "nothing to forget" in result.output


def test_forget_command_moves_a_key_of_the_wrong_type_aside_and_says_so(
    redis_url: str, redis_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    redis_client.set(CrawlKeys("junk").fingerprints, "not a set")
    with caplog.at_level(logging.WARNING):
        result = CliRunner().invoke(main, ["--redis-url", redis_url, "forget", "junk", "https://e.example/"])
    assert result.exit_code == 0 and "Traceback" not in result.output
    assert "forgot 1 fingerprints of 'junk'" in result.output
    assert any("Repaired garbage in {junk}:fingerprints" in r.getMessage() for r in caplog.records)
    assert redis_client.get("{junk}:fingerprints:garbage") == b"not a set"


@pytest.mark.parametrize("garbage", ["0.001", "nan", "-5", "1e300", "soon"])
def test_a_recorded_ttl_no_worker_could_use_is_rewritten_with_a_warning(
    redis_client: Any, caplog: Any, garbage: str
) -> None:
    _bloom(redis_client, ttl=None)
    redis_client.hset(KEYS.bloom, "ttl", garbage)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        later = _bloom(redis_client, ttl=None)  # a worker started after the write
    assert later.gens is None
    assert redis_client.hget(KEYS.bloom, "ttl") == b"0.0"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "ttl" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    fps = _fps(5, 11)
    assert _add(later, fps, time.time()) == [False] * 5  # it deduplicates: no bloom_clock refusal
    assert _add(later, fps, time.time()) == [True] * 5


def test_a_ttl_whose_generations_span_a_moment_is_refused_at_start() -> None:
    with pytest.raises(ScrapyDistError, match="DUPEFILTER_TTL"):
        Generations(0.001, 4)
