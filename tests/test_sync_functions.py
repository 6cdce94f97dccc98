"""The sync script as a FUNCTION library (FCALL, Redis >= 7) and as EVALSHA answer and write the same, bit
for bit; FCALL reloads a library the server lost and falls back to EVALSHA where FUNCTION is refused
(Redis 6.2, an ACL). The FCALL path is tested on a Redis >= 7 started by path (Debian's
/usr/bin/redis-server, or ``$REDIS7_SERVER``), whatever server the other fixtures use."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
import redis.asyncio.cluster
from redis_servers import free_port, redis_server_binary, server_version

from scrapy_dist.dupefilter import BloomDupeFilter
from scrapy_dist.dupefilter.bloom import fingerprint_hashes
from scrapy_dist.frontier.shard import Frontier, SyncBatch, sync_prelude
from scrapy_dist.redis import scripts
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.settings import SchedulerSettings

KEYS = CrawlKeys("fn")


def _redis7_binary() -> str | None:
    for candidate in (os.environ.get("REDIS7_SERVER"), "/usr/bin/redis-server", redis_server_binary()):
        if candidate and shutil.which(candidate) and (server_version(candidate) or (0,)) >= (7,):
            return candidate
    return None


@pytest.fixture(scope="module")
def redis7() -> Iterator[int]:
    """The port of a Redis >= 7 server of this module's own."""
    binary = _redis7_binary()
    if binary is None:
        pytest.skip("no Redis >= 7 server here")
    tmp = tempfile.mkdtemp(prefix="scrapy-dist-redis7-")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", tmp, "--save", "",
         "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield port
    client.close()
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(tmp, ignore_errors=True)


def _dump(client: redis.Redis) -> dict[bytes, Any]:
    """Every key with its type and content: the server's state, to compare two runs."""
    out: dict[bytes, Any] = {}
    for key in sorted(client.scan_iter(count=1000)):
        kind = client.type(key)
        if kind == b"zset":
            out[key] = client.zrange(key, 0, -1, withscores=True)
        elif kind == b"hash":
            out[key] = sorted(client.hgetall(key).items())
        elif kind == b"list":
            out[key] = client.lrange(key, 0, -1)
        elif kind == b"set":
            out[key] = sorted(client.smembers(key))
        else:
            out[key] = client.get(key)
    return out


def _entries(round_: int, n: int) -> list[tuple[Any, ...]]:
    out = []
    for i in range(n):
        url = b"http://h%d.example/%d/%d" % (i % 5, round_, i)
        out.append((*fingerprint_hashes(url), float(i % 3), b"\x01" + url, f"h{i % 5}.example", "0 2 0"))
    return out


async def _rounds(port: int, functions: bool, politeness: str) -> list[Any]:
    """A few rounds of a worker's sync calls (enqueue with dupes, ack, renew, delay, reject, dead letter,
    lease) on a fresh database; the answers."""
    sync_client = redis.Redis(port=port)
    sync_client.flushall()
    df = BloomDupeFilter(sync_client, KEYS, None, capacity=10_000, error_rate=0.01)
    df.open()
    client = redis.asyncio.Redis(port=port)
    f = Frontier(client, KEYS, "w1", df, SchedulerSettings(politeness=politeness), limits_bound="0 0",
                 functions=functions)
    answers, leased = [], []
    try:
        for r in range(6):
            now = 1_000.0 + r
            batch = SyncBatch(
                enqueue=_entries(r, 12) + _entries(max(0, r - 1), 3), ack=leased[:2], renew=leased[2:3],
                delay=[(1.0, b"\x01delayed%d" % r, now + 0.5, "h1.example", "0 2 0")],
                reject=[(leased[3], '{"reason": "test"}')] if len(leased) > 3 else [],
                dead=['{"url": "http://a.example/dead"}'] if r == 2 else [], lease=5,
            )
            result = await f.sync(batch, now=now)
            leased = [m for m, _ in result.leased]
            answers.append(result)
        answers.append(f._script.functions)
    finally:
        await client.aclose()
        sync_client.close()
    return answers


@pytest.mark.parametrize("politeness", ["process", "cluster"])
def test_fcall_and_evalsha_answer_and_write_the_same(redis7: int, politeness: str) -> None:
    by_path = {}
    for functions in (True, False):
        answers = asyncio.run(_rounds(redis7, functions, politeness))
        by_path[functions] = answers, _dump(redis.Redis(port=redis7))
    (fcall, fcall_state), (evalsha, evalsha_state) = by_path[True], by_path[False]
    assert fcall[-1] is True and evalsha[-1] is False  # the path each took
    assert fcall[:-1] == evalsha[:-1]
    assert fcall_state == evalsha_state
    assert sum(len(a.leased) for a in fcall[:-1]) > 10 and any(not all(a.new) for a in fcall[:-1])


def test_a_library_the_server_lost_is_loaded_again(redis7: int) -> None:
    async def go() -> list[Any]:
        client = redis.asyncio.Redis(port=redis7)
        await client.flushall()
        f = Frontier(client, KEYS, "w1", None)
        out = [await f.sync(SyncBatch(enqueue=[("", "", 0.0, b"\x01a", "", "")], lease=0))]
        await client.function_flush()  # a restart without persistence, a failover to a node without it
        out.append(await f.sync(SyncBatch(lease=1)))
        out.append(f._script.functions)
        await client.aclose()
        return out

    first, second, functions = asyncio.run(go())
    assert first.queued == 1 and len(second.leased) == 1 and functions is True
    listed = redis.Redis(port=redis7).function_list()
    libraries = [dict(zip(lib[::2], lib[1::2], strict=True)) for lib in listed]
    name = scripts.library_name(scripts.source("sync", sync_prelude(), library=True))
    assert [lib[b"library_name"] for lib in libraries] == [name.encode()]
    assert name.startswith("scrapy_dist_sync_") and len(name) == len("scrapy_dist_sync_") + 16


def test_a_user_without_function_rights_gets_evalsha(redis7: int) -> None:
    admin = redis.Redis(port=redis7)
    admin.acl_setuser(
        "nofn", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-function", "-fcall"],
    )

    async def go() -> list[Any]:
        client = redis.asyncio.Redis(port=redis7, username="nofn", password="pw")
        await client.flushall()
        f = Frontier(client, KEYS, "w1", None)
        out = [await f.sync(SyncBatch(enqueue=[("", "", 0.0, b"\x01a", "", "")], lease=1))]
        out.append(f._script.functions)
        await client.aclose()
        return out

    try:
        result, functions = asyncio.run(go())
    finally:
        admin.acl_deluser("nofn")
    assert len(result.leased) == 1 and functions is False


def test_a_refused_fcall_falls_back_to_evalsha(redis7: int) -> None:
    """FUNCTION LOAD allowed (someone else loaded it, say) but FCALL refused: EVALSHA from then on."""
    admin = redis.Redis(port=redis7)
    admin.acl_setuser("nofcall", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-fcall"])

    async def go() -> Any:
        client = redis.asyncio.Redis(port=redis7, username="nofcall", password="pw")
        await client.flushall()
        f = Frontier(client, KEYS, "w1", None)
        result = await f.sync(SyncBatch(enqueue=[("", "", 0.0, b"\x01a", "", "")], lease=1))
        await client.aclose()
        return result, f._script.functions

    try:
        result, functions = asyncio.run(go())
    finally:
        admin.acl_deluser("nofcall")
    assert len(result.leased) == 1 and functions is False


def test_the_fixture_server_takes_the_path_its_version_has(redis_url: str) -> None:
    """Redis 6.2 has no FUNCTION: EVALSHA; Redis >= 7: FCALL (the suite's server, whichever it is)."""
    async def go() -> Any:
        client = redis.asyncio.Redis.from_url(redis_url)
        f = Frontier(client, KEYS, "w1", None)
        result = await f.sync(SyncBatch(enqueue=[("", "", 0.0, b"\x01a", "", "")], lease=1))
        version = (await client.info("server"))["redis_version"]
        await client.aclose()
        return result, f._script.functions, int(version.split(".")[0])

    result, functions, major = asyncio.run(go())
    assert len(result.leased) == 1
    assert functions is (major >= 7)


def test_script_errors_are_not_taken_for_a_refused_function(redis7: int) -> None:
    """An error the script itself raises is the caller's, on either path (never a silent fallback)."""
    async def go(functions: bool) -> Any:
        client = redis.asyncio.Redis(port=redis7)
        f = Frontier(client, KEYS, "w1", None, functions=functions)
        try:
            with pytest.raises(redis.ResponseError):
                # a section count that is not a number breaks the script's argument parsing
                await f._script(keys=f._fixed_keys + [KEYS.forgotten, KEYS.fingerprints], args=["x"])
            return f._script.functions
        finally:
            await client.aclose()

    assert asyncio.run(go(True)) is True
    assert asyncio.run(go(False)) is False


def test_on_a_cluster_the_library_is_on_every_primary(cluster: Any) -> None:
    """Shards in three slots (one per master): each call finds its library, also after every master lost
    it (FCALL on Redis >= 7, EVALSHA on 6.2: the same answers)."""
    cluster.flushall()
    shard_keys = KEYS.shards(3)

    async def go() -> list[Any]:
        client = redis.asyncio.cluster.RedisCluster.from_url(cluster.url)
        try:
            fs = [Frontier(client, k, "w1", None, heartbeat=i == 0) for i, k in enumerate(shard_keys)]
            out = [await f.sync(SyncBatch(enqueue=[("", "", 0.0, b"\x01a", "", "")], lease=0)) for f in fs]
            if fs[0]._script.functions:
                await client.function_flush()  # every primary
            out += [await f.sync(SyncBatch(lease=1)) for f in fs]
            return [out, [f._script.functions for f in fs]]
        finally:
            await client.aclose()

    (answers, functions) = asyncio.run(go())
    assert [a.queued for a in answers[:3]] == [1, 1, 1]
    assert [len(a.leased) for a in answers[3:]] == [1, 1, 1]
    major = int(redis.Redis(port=cluster.nodes[0].port).info("server")["redis_version"].split(".")[0])
    assert functions == [major >= 7] * 3


def test_a_workers_limits_are_clamped_by_its_own_bound_whatever_another_worker_sent(redis7: int) -> None:
    """Limits a worker sends for a domain are clamped to the largest delay and jitter its own settings give
    any domain (head 'limits_bound'), call after call of the one library, even when a worker with another
    bound sent the same limits string just before (the library keeps parsed limits between calls, one
    table per bound)."""
    redis.Redis(port=redis7).flushall()
    bounds = {"w1": "1 0.25", "w2": "10 1", "w3": ""}
    calls = [("w1", "a.test", b"1 2 0.25"), ("w2", "b.test", b"5 2 0.5"), ("w1", "c.test", b"1 2 0.25"),
             ("w3", "d.test", b"5 2 0.5"), ("w2", "e.test", b"5 2 0.5"), ("w1", "f.test", b"1 2 0.25")]

    async def go() -> list[bool | None]:
        client = redis.asyncio.Redis(port=redis7)
        try:
            polite = SchedulerSettings(politeness="cluster")
            workers = {w: Frontier(client, KEYS, w, None, polite, limits_bound=b) for w, b in bounds.items()}
            for worker, domain, _ in calls:
                entry = ("", "", 0, b"\x01" + domain.encode(), domain, "5 2 0.5")
                await workers[worker].sync(SyncBatch(enqueue=[entry], lease=1), now=1_700_000_000.0)
            return [f._script.functions for f in workers.values()]
        finally:
            await client.aclose()

    assert asyncio.run(go()) == [True] * 3  # one library, called by FCALL
    info = redis.Redis(port=redis7)
    for _, domain, limits in calls:
        assert info.hget(KEYS.domain_info, f"p:{domain}").split(b" ", 2)[2] == limits, domain
