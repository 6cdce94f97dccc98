"""scrapy-redis's contract kept: spider arguments given as strings, seeds that bypass the
dupefilter on a re-push, hooks with scrapy-redis's shapes. Real Redis, real ``scrapy crawl`` processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import redis
import scrapy
from crawlproject import make_project
from helpers import run
from scrapy.utils.test import get_crawler
from test_spiders_e2e import EchoServer, echo  # noqa: F401 (the fixture)

from scrapy_dist.exceptions import RejectedEntry
from scrapy_dist.pipelines import RedisPipeline
from scrapy_dist.seeds import parse_seed, seed_request
from scrapy_dist.settings.values import SettingsError
from scrapy_dist.spiders import SpiderArguments

SPIDERS = '''
import scrapy
from scrapy_dist.spiders import RedisSpider


class Plain(RedisSpider):
    """One item per seed page; follows nothing."""

    name = "plain"

    def parse(self, response):
        yield {"url": response.url, "meta": response.meta.get("job"), "n": response.meta.get("n")}


class Fanout(Plain):
    """make_request_from_data returns a list (scrapy-redis's shape): two requests per seed."""

    name = "fanout"

    def make_request_from_data(self, data):
        url = data.decode()
        other = url.replace("/page/", "/page/1")
        return [scrapy.Request(url, meta={"n": 1}), scrapy.Request(other, meta={"n": 2})]


class Gen(Plain):
    """make_request_from_data as a generator; 'skip' seeds give nothing."""

    name = "gen"

    def make_request_from_data(self, data):
        if b"skip" in data:
            return
        yield scrapy.Request(data.decode())
'''


def _project(tmp_path: Path, redis_url: str, **settings: Any) -> Any:
    return make_project(tmp_path, {"REDIS_URL": redis_url, "SCHEDULER_IDLE_BEFORE_CLOSE": 1,
                                   "FEEDS": {"items.jsonl": {"format": "jsonlines"}}, **settings},
                        spiders=SPIDERS)


def _items(project: Any) -> list[dict[str, Any]]:
    path = project.root / "items.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# -- spider arguments ---------------------------------------------------------------------------------
def test_spider_arguments_are_converted_like_scrapy_redis() -> None:
    class S:
        name = "s"
        redis_key = "%(name)s:jobs"
        redis_batch_size = "10"
        max_idle_time = " 5 "

    args = SpiderArguments.of(S())
    assert args == SpiderArguments("s:jobs", 10, 5.0)
    assert SpiderArguments.of(object()) == SpiderArguments()


@pytest.mark.parametrize(("attr", "value", "problem"), [
    ("redis_batch_size", "ten", "not a whole number"),
    ("redis_batch_size", "0", "not a whole number"),
    ("redis_batch_size", "1.5", "not a whole number"),
    ("max_idle_time", "soon", "not a number of seconds"),
    ("max_idle_time", "-1", "not a number of seconds"),
    ("max_idle_time", "nan", "not a number of seconds"),
    ("redis_key", "", "an empty key"),
    ("redis_key", "   ", "an empty key"),
    ("redis_key", "%(nam)s", "bad %-template"),
])
def test_bad_spider_arguments_are_one_line(attr: str, value: str, problem: str) -> None:
    spider = type("S", (), {"name": "s", attr: value})()
    with pytest.raises(SettingsError) as info:
        SpiderArguments.of(spider)
    line = str(info.value)
    assert line.startswith(f"scrapy-dist: {attr}=") and problem in line and "\n" not in line


def test_string_arguments_crawl_and_max_idle_time_closes_the_worker(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    """Before: '>' not supported between 'str' and 'int' (start_error, 0 pages, exit 0) and a worker that
    never closes. The project's SCHEDULER_IDLE_BEFORE_CLOSE is 0 (never): only -a max_idle_time closes it."""
    site = site_factory(pages=20, links=0)
    redis.Redis.from_url(redis_url).lpush("jobs:plain", *[site.page_url(i) for i in range(12)])
    project = _project(tmp_path, redis_url, SCHEDULER_IDLE_BEFORE_CLOSE=0)
    project.crawl("plain", args={"redis_batch_size": "5", "max_idle_time": "1", "redis_key": "jobs:%(name)s"})
    assert project.wait_all(90) == [0], project.logs()[-3000:]
    assert len(site.fetch_counts()) == 12
    stats = project.stats(0)
    assert stats["finish_reason"] == "finished" and stats["item_scraped_count"] == 12


@pytest.mark.parametrize(("arg", "value", "line"), [
    ("redis_batch_size", "ten", "scrapy-dist: redis_batch_size=ten: not a whole number"),
    ("max_idle_time", "soon", "scrapy-dist: max_idle_time=soon: not a number of seconds"),
    ("redis_key", " ", "scrapy-dist: redis_key=' ': an empty key"),
])
def test_bad_spider_argument_stops_the_crawl_in_one_line(
    tmp_path: Path, redis_url: str, arg: str, value: str, line: str
) -> None:
    project = _project(tmp_path, redis_url)
    project.crawl("plain", args={arg: value})
    assert project.wait_all(60) == [1]
    log = project.logs()
    assert line in log and "Traceback" not in log, log[-3000:]


# -- re-runs and re-pushes ---------------------------------------------------------------------------
@pytest.mark.parametrize(("dedupe", "second_run"), [(False, 10), (True, 0)])
def test_pushing_seeds_again_fetches_them_again_unless_deduplicated(
    tmp_path: Path, redis_url: str, site_factory: Any, dedupe: bool, second_run: int
) -> None:
    """scrapy-redis's periodic crawl: the same 10 URLs pushed before each run. Before: 0 fetched the
    second time (seeds went through the dupefilter); now 10, and 0 with REDIS_START_URLS_DEDUPE."""
    site = site_factory(pages=10, links=0)
    client = redis.Redis.from_url(redis_url)
    urls = [site.page_url(i) for i in range(10)]
    project = _project(tmp_path, redis_url, REDIS_START_URLS_DEDUPE=dedupe)
    fetched = []
    for _ in range(2):
        before = sum(site.fetch_counts().values())
        client.lpush("plain:start_urls", *urls)
        project.crawl("plain")
        assert project.wait_all(90)[-1] == 0, project.logs()[-3000:]
        fetched.append(sum(site.fetch_counts().values()) - before)
    assert fetched == [10, second_run]


def test_a_seed_saying_dont_filter_false_is_deduplicated() -> None:
    seed = parse_seed(b'{"url": "http://example.com/", "dont_filter": false}')
    assert not seed_request(seed).dont_filter
    assert seed_request(parse_seed(b"http://example.com/")).dont_filter
    assert not seed_request(parse_seed(b"http://example.com/"), dedupe=True).dont_filter
    forced = parse_seed(b'{"url": "http://example.com/", "dont_filter": true}')
    assert seed_request(forced, dedupe=True).dont_filter


# -- hooks and shapes ---------------------------------------------------------------------------------
def test_make_request_from_data_may_return_a_list_or_a_generator(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    site = site_factory(pages=20, links=0)
    client = redis.Redis.from_url(redis_url)
    client.lpush("fanout:start_urls", site.page_url(0), site.page_url(1))
    client.lpush("gen:start_urls", site.page_url(2), site.page_url(3) + "?skip")
    project = _project(tmp_path, redis_url)
    project.crawl("fanout")
    assert project.wait_all(90) == [0], project.logs()[-3000:]
    project.crawl("gen")
    assert project.wait_all(90) == [0, 0], project.logs()[-3000:]
    items = _items(project)
    assert sorted((urlsplit(i["url"]).path, i["n"]) for i in items) == [
        ("/page/0", 1), ("/page/1", 1), ("/page/10", 2), ("/page/11", 2), ("/page/2", None),
    ]
    assert project.stats(1).get("seeds/skipped") == 1


def test_readme_json_seed_with_extra_fields_is_form_data(
    tmp_path: Path, redis_url: str, echo: EchoServer  # noqa: F811
) -> None:
    """scrapy-redis's README seed: extra fields become form data (the query of a GET, the body of a
    POST); meta reaches the spider. Before: rejected as unknown_field."""
    client = redis.Redis.from_url(redis_url)
    client.lpush("plain:start_urls", json.dumps(
        {"url": echo.url + "/get", "meta": {"job": "123xsd"}, "url_cookie_key": "fertxsas"}
    ), json.dumps({"url": echo.url + "/post", "method": "post", "q": ["a", "b"]}))
    project = _project(tmp_path, redis_url)
    project.crawl("plain")
    assert project.wait_all(90) == [0], project.logs()[-3000:]
    by_path = {urlsplit(path).path: (method, path, body) for method, path, body, _ in echo.log}
    method, path, _ = by_path["/get"]
    assert method == "GET" and parse_qs(urlsplit(path).query) == {"url_cookie_key": ["fertxsas"]}
    method, _, body = by_path["/post"]
    assert method == "POST" and parse_qs(body.decode()) == {"q": ["a", "b"]}
    assert {i["meta"] for i in _items(project)} == {"123xsd", None}
    assert not client.llen("plain:start_urls:rejected")


@pytest.mark.parametrize("raw", [
    '{"url": "http://example.com/", "n": 1}',
    '{"url": "http://example.com/", "x": {"a": "b"}}',
    '{"url": "http://example.com/", "method": "POST", "body": "a=1", "x": "y"}',
])
def test_bad_form_fields_are_rejected(raw: str) -> None:
    with pytest.raises(RejectedEntry) as info:
        parse_seed(raw.encode())
    assert info.value.reason == "bad_form_field"


def test_item_key_overridden_with_scrapy_redis_signature_gets_the_spider(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Before: TypeError (item_key() missing 1 required positional argument: 'spider')."""

    class Spider(scrapy.Spider):
        name = "books"

    class OldStyle(RedisPipeline):
        def item_key(self, item, spider):  # type: ignore[no-untyped-def,override]
            return f"{spider.name}:items:{item['kind']}"

    class NewStyle(RedisPipeline):
        def item_key(self, item):  # type: ignore[no-untyped-def,override]
            return f"new:{item['kind']}"

    crawler = get_crawler(Spider, {"REDIS_URL": redis_url})
    crawler.spider = crawler._create_spider()

    async def scenario() -> None:
        for cls in (OldStyle, NewStyle):
            pipe = cls.from_crawler(crawler)
            await pipe.open_spider()
            await pipe.process_item({"kind": "a"})
            await pipe.close_spider()

    run(scenario())
    assert redis_client.llen("books:items:a") == 1 and redis_client.llen("new:a") == 1


# -- module-level API -----------------------------------------------------------------------------
def test_get_redis_takes_scrapy_redis_keywords(redis_url: str, redis_client: redis.Redis) -> None:
    from scrapy_dist.redis import connection

    parts = urlsplit(redis_url)
    db = int(parts.path.lstrip("/") or 0)
    redis_client.set("marker", "here")
    clients = [
        connection.get_redis(url=redis_url),
        connection.get_redis(host=parts.hostname, port=parts.port, db=db),
        connection.get_redis(url=redis_url, redis_cls=redis.StrictRedis, socket_timeout=3),
        connection.get_redis(url=redis_url, redis_cls="redis.Redis"),
        connection.get_redis_from_settings({"REDIS_URL": redis_url}),
        connection.from_settings({"REDIS_URL": redis_url}),
    ]
    for client in clients:
        assert client.get("marker") == b"here"
        client.close()
    assert connection.from_settings is connection.get_redis_from_settings
    with pytest.raises(TypeError):
        connection.get_redis({"REDIS_URL": redis_url}, url=redis_url)


def test_redis_stats_collector_keeps_crawl_wide_stats_in_redis(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    """STATS_CLASS as in scrapy-redis: the crawl's stats end up in a Redis hash, with ClusterStats not
    listed in the project's EXTENSIONS (the collector enables it)."""
    from scrapy_dist.redis.keys import CrawlKeys

    site = site_factory(pages=5, links=0)
    client = redis.Redis.from_url(redis_url)
    client.lpush("plain:start_urls", *[site.page_url(i) for i in range(3)])
    project = _project(tmp_path, redis_url, STATS_CLASS="scrapy_dist.stats.RedisStatsCollector",
                       SCHEDULER_PERSIST=True)
    project.crawl("plain")
    assert project.wait_all(90) == [0], project.logs()[-3000:]
    stats = client.hgetall(CrawlKeys("plain").stats)
    assert int(stats[b"response_received_count"]) == 3, stats
    assert project.stats(0)["response_received_count"] == 3  # this worker's, in memory as in Scrapy


# -- the migration table -----------------------------------------------------------------------------
def test_readme_migration_table_is_generated_from_the_code() -> None:
    """Run `python tools/migration_table.py` when this fails."""
    import sys

    from scrapy_dist.settings.table import OURS, SCRAPY_REDIS_IGNORED, TABLE

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import migration_table as migration

    readme = migration.README_PATH.read_text(encoding="utf-8")
    inside = readme.split(migration.START, 1)[1].split(migration.END, 1)[0].strip()
    table = migration.render_table()
    assert inside == table
    rows = table.splitlines()
    first = rows[2]
    assert "localhost:6379" in first and "embedded Redis" in first and "redis-cli -s" in first
    by_name = {row.split("|")[1].strip().split(",")[0]: row for row in rows if row.startswith("| `")}
    for spec in TABLE:
        if spec.status != OURS:
            assert f"`{spec.name}`" in by_name, spec.name
    for name in SCRAPY_REDIS_IGNORED:
        assert "not applied" in by_name[f"`{name}`"]
    persist = by_name["`SCHEDULER_PERSIST`"]
    assert "**changed**" in persist and "scrapy-redis: False" in persist and "WARNING" in persist


def test_get_redis_with_a_client_class_builds_it_as_scrapy_redis_does() -> None:
    from scrapy_dist.redis import connection

    class Recorder:
        def __init__(self, **kw: Any) -> None:
            self.kw = kw

        @classmethod
        def from_url(cls, url: str, **kw: Any) -> tuple[str, dict[str, Any]]:
            return url, kw

    made = connection.get_redis(redis_cls=Recorder, param="foo")
    assert isinstance(made, Recorder) and made.kw == {"param": "foo"}
    assert connection.get_redis(redis_cls=Recorder, url="redis://h", param="foo") == (
        "redis://h", {"param": "foo"})


def test_from_crawler_converts_spider_arguments_in_place() -> None:
    """What scrapy-redis's own test_from_crawler_with_spider_arguments checks."""
    from scrapy.crawler import Crawler

    from scrapy_dist.spiders import RedisSpider

    crawler = Crawler(RedisSpider, {})  # as in `scrapy crawl`: the spider is built before settings freeze
    spider = RedisSpider.from_crawler(crawler, "foo", redis_key="key:%(name)s", redis_batch_size="2000",
                                      max_idle_time="100")
    assert (spider.name, spider.redis_key, spider.redis_batch_size, spider.max_idle_time) == (
        "foo", "key:foo", 2000, 100)
    assert crawler.settings.getfloat("SCHEDULER_IDLE_BEFORE_CLOSE") == 100


def test_a_misspelt_spider_argument_is_warned_with_the_name_it_misses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from scrapy.crawler import Crawler

    from scrapy_dist.spiders import RedisSpider

    RedisSpider.from_crawler(Crawler(RedisSpider, {}), "foo", redis_kye="k", max_idle="3", category="books",
                             redis_key="seeds", redis_batch_size="5")
    lines = [r.getMessage() for r in caplog.records if "spider argument" in r.getMessage()]
    assert lines == [
        "scrapy-dist: spider argument max_idle is not one RedisSpider reads; did you mean max_idle_time?",
        "scrapy-dist: spider argument redis_kye is not one RedisSpider reads; did you mean redis_key?",
    ]


def test_redis_encoding_spider_attribute_other_than_utf8_is_warned(caplog: pytest.LogCaptureFixture) -> None:
    from scrapy.crawler import Crawler

    from scrapy_dist.spiders import RedisSpider

    for encoding, warned in (("latin-1", True), ("utf-8", False), ("UTF8", False)):
        caplog.clear()
        RedisSpider.from_crawler(Crawler(RedisSpider, {}), "foo", redis_encoding=encoding)
        assert any("redis_encoding" in r.getMessage() for r in caplog.records) is warned, encoding


def test_scrapy_redis_idle_before_close_in_the_project_settings_is_warned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """scrapy-redis's SCHEDULER_IDLE_BEFORE_CLOSE was a pop timeout (its RedisSpider waited for seeds for
    ever); here it closes idle workers: one WARNING when the settings of a project switched the
    scrapy-redis way set it, none for a -s of this run, for MAX_IDLE_TIME_BEFORE_CLOSE (the same meaning
    in both), for 0, or in a project that uses scrapy-dist's add-on."""
    from scrapy.crawler import Crawler
    from scrapy.settings import Settings

    from scrapy_dist.spiders import RedisSpider

    class Custom(RedisSpider):
        custom_settings = {"SCHEDULER_IDLE_BEFORE_CLOSE": 30}

    def cmdline(**values: Any) -> Settings:
        settings = Settings()
        settings.setdict(values, priority="cmdline")
        return settings

    cases: list[tuple[type, Any, dict[str, Any], bool]] = [
        (RedisSpider, {"SCHEDULER_IDLE_BEFORE_CLOSE": 10}, {}, True),
        (Custom, {}, {}, True),
        (RedisSpider, {"SCHEDULER_IDLE_BEFORE_CLOSE": 0}, {}, False),
        (RedisSpider, {"MAX_IDLE_TIME_BEFORE_CLOSE": 10}, {}, False),
        (RedisSpider, cmdline(SCHEDULER_IDLE_BEFORE_CLOSE=10), {}, False),
        (RedisSpider, {"SCHEDULER_IDLE_BEFORE_CLOSE": 10}, {"max_idle_time": "10"}, False),
        (RedisSpider, {}, {}, False),
    ]
    # the spider is built before Scrapy applies the add-ons (Crawler.crawl), as here
    cases.append((RedisSpider, {"ADDONS": {"scrapy_dist.Addon": 0}, "SCHEDULER_IDLE_BEFORE_CLOSE": 10}, {},
                  False))
    cases.append((Custom, {"ADDONS": {"scrapy_dist.addon.Addon": 10}}, {}, False))
    for cls, settings, kwargs, warned in cases:
        caplog.clear()
        with caplog.at_level("WARNING"):
            cls.from_crawler(Crawler(cls, settings), "foo", **kwargs)
        lines = [r.getMessage() for r in caplog.records if "SCHEDULER_IDLE_BEFORE_CLOSE" in r.getMessage()]
        assert len(lines) == (1 if warned else 0), (cls, settings, kwargs, lines)
        if warned:
            assert "MAX_IDLE_TIME_BEFORE_CLOSE" in lines[0] and "set it to 0" in lines[0]


def test_scrapy_redis_hooks_a_spider_overrides_are_warned_once_each(caplog: pytest.LogCaptureFixture) -> None:
    # a scrapy-redis RedisSpider's start_requests(), spider_idle(), ... overrides were silently never called
    from scrapy.crawler import Crawler

    from scrapy_dist.spiders import RedisCrawlSpider, RedisSpider

    class Legacy(RedisSpider):
        name = "legacy"

        def start_requests(self) -> Any:
            yield scrapy.Request("http://a.example/")

        def spider_idle(self) -> None:
            pass

    class Modern(Legacy):
        async def start(self) -> Any:  # its own start() may call start_requests(): no warning
            yield scrapy.Request("http://a.example/")

    for cls, warned in ((Legacy, ["start_requests", "spider_idle"]), (Modern, []), (RedisSpider, []),
                        (RedisCrawlSpider, [])):
        caplog.clear()
        cls.from_crawler(Crawler(cls, {}), "x")
        messages = [r.getMessage() for r in caplog.records if "is never called" in r.getMessage()]
        assert len(messages) == len(warned), messages
        assert all(f".{name}() is never called" in m for name, m in zip(warned, messages, strict=True))


def test_make_request_from_data_may_decode_with_redis_encoding_as_in_scrapy_redis() -> None:
    # scrapy-redis's own make_request_from_data decodes with self.redis_encoding, and so do overrides
    # copied from it: without the attribute every seed was rejected as hook_error (AttributeError)
    from scrapy.crawler import Crawler

    from scrapy_dist.spiders import RedisSpider

    class Decoding(RedisSpider):
        name = "decoding"

        def make_request_from_data(self, data: bytes) -> scrapy.Request:
            return scrapy.Request(data.decode(self.redis_encoding))

    spider = Decoding.from_crawler(Crawler(Decoding, {}))
    assert spider.make_request_from_data("http://a.example/é".encode()).url == "http://a.example/%C3%A9"


def test_scrapy_redis_text_helpers_import_after_the_naive_switch() -> None:
    # `from scrapy_redis.utils import bytes_to_str` (common in make_request_from_data overrides) became
    # `scrapy_dist.utils`, which did not exist: the spider's module failed to import
    from scrapy_dist.utils import bytes_to_str, convert_bytes_to_str, is_dict

    assert bytes_to_str(b"foo") == "foo"
    assert bytes_to_str(b"\xc1", "latin1") == "\xc1"
    assert bytes_to_str("already") == "already"
    assert is_dict('{"url": "http://a.example/"}') and is_dict("[1]") and not is_dict("{oops")
    assert not is_dict(None)
    converted = convert_bytes_to_str({b"url": b"http://a.example/", b"n": 1})
    assert converted == {"url": "http://a.example/", "n": 1}


def test_a_spider_reading_self_server_is_told_at_start(caplog: pytest.LogCaptureFixture) -> None:
    # scrapy-redis spiders push follow-up seeds with self.server.lpush(...) in a callback: here every
    # response failed with an AttributeError traceback, and nothing said so at start
    from scrapy.crawler import Crawler

    from scrapy_dist.spiders import RedisSpider

    class Pushing(RedisSpider):
        name = "pushing"

        def parse(self, response: Any) -> Any:
            for href in response.css("a::attr(href)").getall():
                self.server.lpush("detail:start_urls", response.urljoin(href))
            yield {"url": response.url}

    class OwnClient(Pushing):
        @classmethod
        def from_crawler(cls, crawler: Any, *args: Any, **kwargs: Any) -> Any:
            spider = super().from_crawler(crawler, *args, **kwargs)
            spider.server = object()
            return spider

    class Assigns(Pushing):
        def setup(self) -> None:
            self.server = object()

    for cls, warned in ((Pushing, True), (OwnClient, False), (Assigns, False), (RedisSpider, False)):
        caplog.clear()
        with caplog.at_level("WARNING"):
            cls.from_crawler(Crawler(cls, {}), "x")
        lines = [r.getMessage() for r in caplog.records if "self.server" in r.getMessage()]
        assert len(lines) == (1 if warned else 0), (cls, lines)
        if warned:
            assert lines[0].startswith("scrapy-dist: Pushing.parse() reads self.server")
            assert "scrapy_dist.connection.get_redis(crawler.settings)" in lines[0]
