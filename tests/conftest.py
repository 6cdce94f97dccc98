"""Shared fixtures: a real redis-server per test session, a clean database per test, N more servers on
demand, and a generated local website for end-to-end crawls. Every test talks to a real redis-server."""

from __future__ import annotations

import compileall
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis_cluster import LocalCluster, SentinelGroup
from redis_servers import RedisProcess

import scrapy_dist
from scrapy_dist.demo.site import SiteGraph, SiteServer

_db_numbers = itertools.cycle(range(1, 64))


def pytest_configure(config: pytest.Config) -> None:
    """Compile scrapy-dist's bytecode and the test modules' rewritten bytecode once, before the test
    processes start: with PYTHONDONTWRITEBYTECODE set (as in CI's image), every ``scrapy``/``scrapy-dist``
    process a test starts would compile the whole package from source again, and each xdist process would
    rewrite the asserts of every test module as it collects them."""
    if not hasattr(config, "workerinput"):  # the controller, not an xdist worker
        compileall.compile_dir(Path(scrapy_dist.__file__).parent, quiet=1)
        _write_rewritten_tests(config)


def _write_rewritten_tests(config: pytest.Config) -> None:
    """Writes what pytest's assert-rewriting import hook would cache for each test module that has no
    valid cache yet; the processes then read it (pytest reads its cache even where it may not write one).
    These are pytest's own functions but not its public API: if they change, each process rewrites the
    modules itself, as it would anyway."""
    try:
        from _pytest.assertion.rewrite import (
            PYC_TAIL,
            _read_pyc,
            _rewrite_test,
            _write_pyc,
            assertstate_key,
            get_cache_dir,
            try_makedirs,
        )
        state = config.stash[assertstate_key]
    except (ImportError, KeyError):
        return
    here = Path(__file__).parent
    for source in [here / "conftest.py", *sorted(here.rglob("test_*.py"))]:
        pyc = get_cache_dir(source) / (source.name[:-3] + PYC_TAIL)
        if _read_pyc(source, pyc, state.trace) is None and try_makedirs(pyc.parent):
            source_stat, code = _rewrite_test(source, config)
            _write_pyc(state, code, source_stat, pyc)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisProcess]:
    server = RedisProcess().start()
    yield server
    server.stop()


def _empty_db_url(server: RedisProcess) -> str:
    db = next(_db_numbers)
    client = redis.Redis(port=server.port, db=db)
    client.flushdb()
    client.close()
    return f"redis://127.0.0.1:{server.port}/{db}"


@pytest.fixture
def redis_url(redis_server: RedisProcess) -> str:
    """URL of a database of the session server that is empty when the test starts."""
    return _empty_db_url(redis_server)


@pytest.fixture
def other_redis_url(redis_server: RedisProcess, redis_url: str) -> str:
    """Another empty database of the same server, for a second crawl run beside the first."""
    return _empty_db_url(redis_server)


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def redis_servers() -> Iterator[Callable[..., list[RedisProcess]]]:
    """Factory: ``redis_servers(n, extra_args=[...])`` starts n more servers, stopped after the test."""
    started: list[RedisProcess] = []

    def start(n: int, extra_args: list[str] | None = None) -> list[RedisProcess]:
        new = [RedisProcess(extra_args=extra_args).start() for _ in range(n)]
        started.extend(new)
        return new

    yield start
    for s in started:
        s.stop()


@pytest.fixture
def site_factory() -> Iterator[Callable[..., SiteServer]]:
    """Factory: ``site_factory(pages=300, links=10, ...)`` serves a generated site on 127.0.0.1."""
    servers: list[SiteServer] = []

    def make(pages: int = 300, links: int = 10, **kw: object) -> SiteServer:
        server_kw = {k: kw.pop(k) for k in ("slow_delay", "flaky_failures", "delay") if k in kw}
        srv = SiteServer(SiteGraph(pages, links, **kw), **server_kw).start()  # type: ignore[arg-type]
        servers.append(srv)
        return srv

    yield make
    for s in servers:
        s.stop()


@pytest.fixture
def site(site_factory: Callable[..., SiteServer]) -> SiteServer:
    return site_factory()


# -- Redis Cluster and Sentinel (tests/redis_cluster.py) -------------------------------------------

@pytest.fixture
def redis_cluster() -> Iterator[Callable[..., LocalCluster]]:
    """Factory: ``redis_cluster(masters=3, replicas=0, node_timeout_ms=1000, extra_args=None)`` starts a
    real local Redis Cluster (same redis-server binary as the other fixtures; ``extra_args`` go to every
    node); every node is stopped after the test."""
    started: list[LocalCluster] = []

    def start(
        masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000, extra_args: list[str] | None = None
    ) -> LocalCluster:
        cluster = LocalCluster(masters, replicas, node_timeout_ms, extra_args).start()
        started.append(cluster)
        return cluster

    yield start
    for c in started:
        c.stop()


@pytest.fixture
def redis_sentinels() -> Iterator[Callable[..., SentinelGroup]]:
    """Factory: ``redis_sentinels(replicas=1, sentinels=3)`` starts a master, its replicas and Sentinels
    watching it as ``mymaster``; all stopped after the test."""
    started: list[SentinelGroup] = []

    def start(replicas: int = 1, sentinels: int = 3, **kw: Any) -> SentinelGroup:
        group = SentinelGroup(replicas, sentinels, **kw).start()
        started.append(group)
        return group

    yield start
    for g in started:
        g.stop()


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """One 3-master cluster per test module, for tests that do not break it (each empties it first with
    ``cluster.flushall()``)."""
    c = LocalCluster(masters=3).start()
    yield c
    c.stop()
