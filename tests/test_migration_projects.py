"""Three scrapy-redis projects (tests/migration_projects/, see its README) switched to scrapy-dist the way a
user switches (``scrapy_redis`` replaced by ``scrapy_dist`` in settings and spiders): ``scrapy-dist
check-migration`` reads each, and each crawls its local site to the pages and items scrapy-redis gives.

The expected pages and items are worked out from the site's link graph by scrapy-redis's rules (a seed is
``dont_filter``: fetched once per push, neither checked against nor recorded in the filter; every other
request once). When ``scrapy_redis`` is importable, the original project also runs on scrapy-redis and the
two runs must agree.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from migration_sites import PagesServer, jobs_board, yellow_pages
from redis_servers import RedisProcess
from zygote import Zygote

from scrapy_dist.demo.site import SiteGraph, SiteServer

PROJECTS = Path(__file__).parent / "migration_projects"
HAS_SCRAPY_REDIS = importlib.util.find_spec("scrapy_redis") is not None
BACKENDS = ["scrapy_dist", "scrapy_redis"] if HAS_SCRAPY_REDIS else ["scrapy_dist"]
#: what every run gets: no delay, closing 2 s after the crawl runs dry (scrapy-redis's own setting)
COMMON = {"DOWNLOAD_DELAY": "0", "MAX_IDLE_TIME_BEFORE_CLOSE": "2", "SCHEDULER_DENY_NETWORKS": "[]",
          "TELNETCONSOLE_ENABLED": "False", "LOG_LEVEL": "INFO"}

pytestmark = pytest.mark.slow


def switched(name: str, tmp_path: Path, backend: str) -> Path:
    """A copy of the project ``name``; for scrapy-dist, every ``scrapy_redis`` replaced by ``scrapy_dist``."""
    dst = tmp_path / backend / name
    shutil.copytree(PROJECTS / name, dst, ignore=shutil.ignore_patterns("__pycache__"))
    if backend == "scrapy_dist":
        for path in dst.rglob("*.py"):
            path.write_text(path.read_text(encoding="utf-8").replace("scrapy_redis", "scrapy_dist"),
                            encoding="utf-8")
    return dst


def crawl(project: Path, spider: str, settings: dict[str, str], args: Iterable[str] = ()) -> None:
    """``scrapy crawl spider`` in ``project``; fails the test on a non-zero exit or an ERROR line."""
    cmd = [sys.executable, "-m", "scrapy", "crawl", spider, *args]
    for k, v in {**COMMON, **settings}.items():
        cmd += ["-s", f"{k}={v}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(project), os.environ.get("PYTHONPATH", "")])}
    out = Zygote.run_cli(cmd, cwd=project, env=env, timeout=120)
    errors = [line for line in out.stderr.splitlines() if "] ERROR:" in line]
    assert out.returncode == 0 and not errors, f"{spider}: exit {out.returncode}\n{out.stderr[-4000:]}"


def items(client: redis.Redis, key: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange(key, 0, -1)]


def path(url: str) -> str:
    return urlsplit(url).path


def fetched(site: SiteServer) -> Counter[str]:
    return site.fetch_counts(status=None)


def with_server(run: Callable[[RedisProcess, str], Any], backend: str) -> Any:
    """``run(server, backend)`` against a fresh redis-server (the projects use its database 0)."""
    server = RedisProcess().start()
    try:
        return run(server, backend)
    finally:
        server.stop()


# -- scrapy-redis's example project ---------------------------------------------------------------------
def closure(graph: SiteGraph, seeds: list[int]) -> set[int]:
    """The pages a link leads to, from the seeds on (a CrawlSpider's Rule callback runs on each once)."""
    linked: set[int] = set()
    todo = list(seeds)
    while todo:
        for j in graph.links_of(todo.pop()):
            if j not in linked:
                linked.add(j)
                todo.append(j)
    return linked


def run_example(tmp_path: Path, backend: str) -> tuple[Counter[str], set[str], Counter[str], set[str]]:
    project = switched("example", tmp_path, backend)

    def run(server: RedisProcess, backend: str) -> tuple[Counter[str], set[str], Counter[str], set[str]]:
        client = redis.Redis.from_url(server.url)
        settings = {"REDIS_URL": server.url}
        args = ["-a", "domain=127.0.0.1"]
        with SiteServer(SiteGraph(60, links=4)) as site:
            client.lpush("mycrawler:start_urls", *[site.page_url(i) for i in range(10)])
            crawl(project, "mycrawler_redis", settings, args)
            crawler = (fetched(site), {path(i["url"]) for i in items(client, "mycrawler_redis:items")})
            assert len(crawler[1]) == client.llen("mycrawler_redis:items")  # no page parsed twice
            site.log.clear()
            client.lpush("myspider:start_urls", *[site.page_url(i) for i in range(50, 55)])
            crawl(project, "myspider_redis", settings, args)
            spider_items = items(client, "myspider_redis:items")
            assert all(i["spider"] == "myspider_redis" and i["crawled"] for i in spider_items)
            return (*crawler, fetched(site), {f"{path(i['url'])} {i['name']}" for i in spider_items})

    return with_server(run, backend)  # type: ignore[no-any-return]


def test_example_project(tmp_path: Path, backend: str = "scrapy_dist") -> None:
    """The RedisCrawlSpider's seeds are pages other pages link to: each is fetched as a seed (its response
    goes to parse_start_url) and again when a Rule finds it (parse_page makes its item).

    Not run on scrapy-redis: on Scrapy 2.19 its spiders hand Scrapy's offsite middlewares the project's
    ``filter`` object as ``allowed_domains``; the first reader exhausts it, and the second then drops every
    link (scrapy-redis 0.9.1 crawls the seeds only). scrapy-dist keeps the domains."""
    graph = SiteGraph(60, links=4)
    seeds = list(range(10))
    linked = closure(graph, seeds)
    assert set(seeds) & linked, "the site must link to some seeds"
    crawl_fetched, crawl_items, spider_fetched, spider_items = run_example(tmp_path, backend)
    assert crawl_items == {f"/page/{i}" for i in linked}
    assert crawl_fetched == Counter({f"/page/{i}": (i in seeds) + (i in linked) for i in set(seeds) | linked})
    assert spider_fetched == Counter({f"/page/{i}": 1 for i in range(50, 55)})
    assert spider_items == {f"/page/{i} page {i}" for i in range(50, 55)}


# -- a job board ----------------------------------------------------------------------------------------
def run_jobs(tmp_path: Path, backend: str) -> tuple[Counter[str], list[dict[str, Any]]]:
    project = switched("jobs_board", tmp_path, backend)

    def run(server: RedisProcess, backend: str) -> tuple[Counter[str], list[dict[str, Any]]]:
        client = redis.Redis.from_url(server.url)
        with PagesServer(jobs_board()) as site:
            client.lpush("start_urls", f"{site.url}/list/city0/1")
            crawl(project, "jobs_redis", {"REDIS_URL": server.url})
            return fetched(site), items(client, "jobs_redis:items")

    return with_server(run, backend)  # type: ignore[no-any-return]


@pytest.mark.parametrize("backend", BACKENDS)
def test_jobs_board(tmp_path: Path, backend: str) -> None:
    """Listing pages reached through the city and pagination blocks only, each job parsed once (a job
    listed twice too); the seed listing page is fetched again when the pagination links to it."""
    site = jobs_board()
    jobs = sorted(p for p in site if p.startswith("/jobs/"))
    lists = sorted(p for p in site if p.startswith("/list/"))
    page_counts, found = run_jobs(tmp_path, backend)
    assert page_counts == Counter({**dict.fromkeys(jobs + lists, 1), "/list/city0/1": 2})
    assert sorted(path(i["url"]) for i in found) == jobs
    by_path = {path(i["url"]): i for i in found}
    first = by_path["/jobs/city0/10.html"]
    fields = (first["title"], first["minmoney"], first["maxmoney"], first["degree"])
    assert fields == ("Engineer 0", 6000, 8000, "本科")


# -- a master and its slave -----------------------------------------------------------------------------
def run_pair(tmp_path: Path, backend: str) -> tuple[Counter[str], list[dict[str, Any]], set[bytes]]:
    master = switched("detail_pair/master", tmp_path, backend)
    slave = switched("detail_pair/slave", tmp_path, backend)

    def run(server: RedisProcess, backend: str) -> tuple[Counter[str], list[dict[str, Any]], set[bytes]]:
        client = redis.Redis.from_url(server.url)
        where = {"REDIS_HOST": "127.0.0.1", "REDIS_PORT": str(server.port)}
        with PagesServer(yellow_pages()) as site:
            crawl(master, "master", where, ["-a", f"site={site.url}/"])
            assert client.llen("detailurl:") == 40
            site.log.clear()
            crawl(slave, "slave186", where)
            rows = [json.loads(r) for r in client.lrange("contacts", 0, -1)]
            return fetched(site), rows, client.smembers("indexExcepturls:")

    return with_server(run, backend)  # type: ignore[no-any-return]


@pytest.mark.parametrize("backend", BACKENDS)
def test_master_and_slave(tmp_path: Path, backend: str) -> None:
    """The master (plain Scrapy) pushes 40 detail pages; the slave fetches each once, stores the 32 with
    a contact block through its own pipeline and records the 8 without one."""
    details = sorted(p for p in yellow_pages() if p.startswith("/info/"))
    page_counts, rows, failed = run_pair(tmp_path, backend)
    assert page_counts == Counter(dict.fromkeys(details, 1))
    ordered = _by_number(details)
    assert sorted(path(r["url"]) for r in rows) == [p for k, p in enumerate(ordered) if k % 5 != 4]
    assert {path(u.decode()) for u in failed} == {p for k, p in enumerate(ordered) if k % 5 == 4}
    first = next(r for r in rows if r["url"].endswith("/info/s168-20000.html"))
    assert (first["name"], first["telphone"], first["phone"]) == ("张三", "0759-7100000", "13800000000")


def _by_number(paths: list[str]) -> list[str]:
    return sorted(paths, key=lambda p: int(p.split("-")[1].split(".")[0]))
