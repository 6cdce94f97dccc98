"""Scrapy's own scheduler, engine and dupefilter tests (tools/compat_check.py runs them): the contracts
they check that scrapy-dist keeps, each tested here against a real Redis.

* ``Scheduler(dupefilter)`` builds without a crawler (``scheduler.crawler is None``); the keys then come
  from the spider's name at ``open()``, and a scheduler built from a crawler before its spider (Scrapy's
  harness) takes the name of the spider it is opened for, as ``process.crawl(Spider, name=...)`` and a
  name set in ``__init__`` do.
* A spider with no name at all is one line and a non-zero exit, not a traceback.
* Duplicate lines are logged where Scrapy's ``RFPDupeFilter`` logs them (``scrapy.dupefilters``), and an
  overridden ``request_fingerprint()`` is used with Scrapy's deprecation warning.
* Start requests are sent in Scrapy's order: the first at once when the worker has room (as Scrapy's engine
  sends it before reading the next), the others after the requests of their priority enqueued otherwise.
* ``DownloaderAwarePriorityQueue`` with ``CONCURRENT_REQUESTS_PER_IP`` is refused, as Scrapy refuses it.
* scrapy-redis's example project (run by tools/compat_check.py): its spiders set ``allowed_domains`` to a
  ``filter`` object, which the seed checks must not exhaust before Scrapy's offsite middleware reads it.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import pytest
from crawlproject import make_project
from helpers import run
from scrapy import Request, Spider
from scrapy.dupefilters import BaseDupeFilter
from scrapy.exceptions import ScrapyDeprecationWarning
from scrapy.utils.misc import build_from_crawler
from scrapy.utils.test import get_crawler

from scrapy_dist.dupefilter import BloomDupeFilter, SetDupeFilter
from scrapy_dist.exceptions import RejectedEntry, ScrapyDistError
from scrapy_dist.frontier.scheduler import Scheduler
from scrapy_dist.settings import DistSettings
from scrapy_dist.settings.values import SettingsError
from scrapy_dist.wire.entrypolicy import check_offsite


async def _crawl_three(sched: Scheduler, spider: Spider) -> list[str]:
    """Open ``sched`` for ``spider`` (rounds driven by hand), send three requests through Redis and take
    them back."""
    await sched.open_async(spider, start=False)
    assert sched.loop is not None
    for i in range(3):
        sched.enqueue_request(Request(f"http://site.test/{i}"))
    await sched.loop.round(lease=10, renew=False)
    urls = [r.url for r in iter(sched.next_request, None)]
    await sched.close_async("shutdown")
    return urls


def test_a_scheduler_built_from_a_dupefilter_alone_takes_its_keys_from_the_spider(
    redis_url: str, redis_client: Any
) -> None:
    sched = Scheduler(BaseDupeFilter(), redis_settings={"REDIS_URL": redis_url})
    assert sched.crawler is None
    urls = run(_crawl_three(sched, Spider(name="alone")))
    assert sorted(urls) == [f"http://site.test/{i}" for i in range(3)]
    assert sched.keys.queue == "{alone}:queue"
    assert redis_client.exists("{alone}:control")  # the crawl joined under the spider's name


def test_a_nameless_spider_class_gets_the_name_given_to_its_instance(redis_url: str) -> None:
    """Scrapy's harness: the scheduler is built before the spider, whose class has no name."""
    crawler = get_crawler(Spider, {"REDIS_URL": redis_url,
                                   "DUPEFILTER_CLASS": "scrapy.dupefilters.BaseDupeFilter"})
    sched = build_from_crawler(Scheduler, crawler)
    assert sched.crawler is crawler
    spider = Spider.from_crawler(crawler, name="named-later")
    assert len(run(_crawl_three(sched, spider))) == 3
    assert sched.keys.spider == "named-later"


@pytest.mark.parametrize("dupefilter", ["scrapy_dist.dupefilter.BloomDupeFilter",
                                        "scrapy_dist.dupefilter.SetDupeFilter"])
def test_keys_follow_a_name_given_after_the_scheduler_was_built(
    redis_url: str, redis_client: Any, dupefilter: str
) -> None:
    """Scrapy's harness builds the scheduler from the crawler, then the spider under another name: the
    crawl (queue, filter, control) lives under the final name, as ``process.crawl(Spider, name=...)``."""

    class Named(Spider):
        name = "classname"

    crawler = get_crawler(Named, {"REDIS_URL": redis_url, "DUPEFILTER_CLASS": dupefilter})
    sched = build_from_crawler(Scheduler, crawler)
    spider = Named.from_crawler(crawler, name="final")
    assert len(run(_crawl_three(sched, spider))) == 3
    assert sched.keys.spider == "final" and sched.df.keys.spider == "final"
    names = {k.decode().split("}")[0] for k in redis_client.keys("*")}
    assert names == {"{final"}


def test_a_spider_without_any_name_is_one_line(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    sched = Scheduler(BaseDupeFilter(), redis_settings={"REDIS_URL": redis_url})
    nameless = Spider.__new__(Spider)  # Scrapy refuses to build one; a custom __init__ may not
    with pytest.raises(ScrapyDistError) as info:  # no crawler to refuse the start of: the caller decides
        run(sched.open_async(nameless, start=False))
    assert str(info.value) == "scrapy-dist: Spider has no name: the crawl's Redis keys are built from it"


@pytest.mark.parametrize("cls", [BloomDupeFilter, SetDupeFilter])
def test_duplicates_are_logged_where_scrapy_logs_them(
    cls: type, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    crawler = get_crawler(Spider, {"REDIS_URL": redis_url, "BLOOMFILTER_CAPACITY": 1000})
    spider = Spider.from_crawler(crawler, name="dupes")
    crawler.spider = spider
    df = build_from_crawler(cls, crawler)
    with caplog.at_level(logging.DEBUG, logger="scrapy.dupefilters"):
        df.log(Request("http://site.test/a"), spider)
        df.log(Request("http://site.test/a"), spider)
    assert [(r.name, r.getMessage()) for r in caplog.records if r.name.endswith("dupefilters")] == [
        ("scrapy.dupefilters", "Filtered duplicate request: <GET http://site.test/a> - no more duplicates"
         " will be shown (see DUPEFILTER_DEBUG to show all duplicates)"),
    ]
    assert crawler.stats.get_value("dupefilter/filtered") == 2


def test_an_overridden_request_fingerprint_is_used_with_scrapys_warning(redis_url: str) -> None:
    class LowerCase(SetDupeFilter):
        def request_fingerprint(self, request: Request) -> str:
            return hashlib.sha1(request.url.lower().encode()).hexdigest()

    crawler = get_crawler(Spider, {"REDIS_URL": redis_url})
    crawler.spider = Spider.from_crawler(crawler, name="legacy")
    with pytest.warns(ScrapyDeprecationWarning, match=r"Overriding RFPDupeFilter\.request_fingerprint\(\)"):
        df = build_from_crawler(LowerCase, crawler)
    df.open()
    assert not df.request_seen(Request("http://site.test/index.html"))
    assert df.request_seen(Request("http://site.test/INDEX.html"))  # the override decided
    assert not build_from_crawler(SetDupeFilter, crawler).legacy_fingerprint


def test_downloader_aware_queue_with_per_ip_concurrency_is_refused_in_one_line() -> None:
    settings = {"SCHEDULER_PRIORITY_QUEUE": "scrapy.pqueues.DownloaderAwarePriorityQueue",
                "CONCURRENT_REQUESTS_PER_IP": 1}
    with pytest.raises(SettingsError) as err:
        DistSettings.coerce(settings)
    assert isinstance(err.value, ValueError)  # as Scrapy's own refusal
    assert str(err.value) == (
        "scrapy-dist: SCHEDULER_PRIORITY_QUEUE=scrapy.pqueues.DownloaderAwarePriorityQueue:"
        " DownloaderAwarePriorityQueue does not support CONCURRENT_REQUESTS_PER_IP;"
        " set CONCURRENT_REQUESTS_PER_IP = 0 or use the default priority queue"
    )


def test_allowed_domains_given_as_an_iterator_are_read_once_and_kept() -> None:
    spider = Spider(name="example")
    spider.allowed_domains = filter(None, ["shop.test", "", "other.test"])  # type: ignore[assignment]
    check_offsite("http://www.shop.test/a", spider)
    assert spider.allowed_domains == ["shop.test", "other.test"]  # still there for Scrapy's offsite
    with pytest.raises(RejectedEntry):
        check_offsite("http://elsewhere.test/", spider)  # the second seed is checked as the first


def test_an_iterator_allowed_domains_still_restricts_the_crawl_after_scrapy_read_it(redis_url: str) -> None:
    """scrapy-redis's example spiders, in Scrapy's order: the offsite middleware reads ``allowed_domains``
    when the spider opens, seeds are checked after. The seed check found the filter exhausted, set ``[]``,
    and the middleware then let every host through (the example crawled far outside ``-a domain=``)."""
    from scrapy.downloadermiddlewares.offsite import OffsiteMiddleware

    from scrapy_dist.spiders import RedisSpider

    class Example(RedisSpider):
        name = "example"

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            domain = kwargs.pop("domain", "")
            self.allowed_domains = filter(None, domain.split(","))  # type: ignore[assignment]
            super().__init__(*args, **kwargs)

    crawler = get_crawler(Example, {"REDIS_URL": redis_url})
    offsite = OffsiteMiddleware.from_crawler(crawler)
    spider = crawler.spider = Example.from_crawler(crawler, domain="shop.test,other.test")
    offsite.spider_opened(spider)
    with pytest.raises(RejectedEntry):
        check_offsite("http://elsewhere.test/", spider)  # a seed outside the domains
    check_offsite("http://www.other.test/", spider)
    assert offsite.should_follow(Request("http://www.shop.test/a"), spider)
    assert not offsite.should_follow(Request("http://elsewhere.test/a"), spider)


ORDER_SPIDER = """
import scrapy
from scrapy import signals


class Order(scrapy.Spider):
    name = "order"

    def __init__(self, site="", **kw):
        super().__init__(**kw)
        self.site = site
        self.sent = []

    @classmethod
    def from_crawler(cls, crawler, *args, **kwargs):
        spider = super().from_crawler(crawler, *args, **kwargs)
        crawler.signals.connect(spider.reached, signal=signals.request_reached_downloader)
        return spider

    def reached(self, request, spider):
        self.sent.append(int(request.url.rsplit("/", 1)[1]))

    def closed(self, reason):
        self.logger.info("ORDER %s", self.sent)

    def page(self, num, priority=0):
        return scrapy.Request(f"{self.site}/page/{num}", priority=priority)

    async def start(self):
        yield self.page(1)
        for request in (self.page(2, priority=1), self.page(5)):
            self.crawler.engine._slot.scheduler.enqueue_request(request)
        yield self.page(6)
        yield self.page(3, priority=1)
        yield self.page(4, priority=1)

    def parse(self, response):
        return None
"""


@pytest.mark.slow
def test_start_requests_are_sent_in_scrapys_order(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    """Scrapy's own engine test: one download at a time; the first start request is sent at once, then
    priority 1 before 0, and within a priority the requests enqueued by other means before start requests."""
    site = site_factory(pages=10, links=0)
    project = make_project(tmp_path, {"REDIS_URL": redis_url, "CONCURRENT_REQUESTS": 1}, spiders=ORDER_SPIDER)
    project.crawl("order", args={"site": site.url})
    assert project.wait_all(60) == [0], project.logs()[-3000:]
    assert "ORDER [1, 2, 3, 4, 5, 6]" in project.logs(), project.logs()[-3000:]


RENAMED = """
import sys
from scrapy import Spider
from scrapy.crawler import CrawlerProcess


class Named(Spider):
    name = "classname"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if getattr(self, "rename", None):
            self.name = self.rename

    async def start(self):
        return
        yield


process = CrawlerProcess({
    "SCHEDULER": "scrapy_dist.scheduler.Scheduler",
    "DUPEFILTER_CLASS": "scrapy_dist.dupefilter.BloomDupeFilter",
    "REDIS_URL": sys.argv[1], "LOG_LEVEL": "WARNING", "TELNETCONSOLE_ENABLED": False,
})
process.crawl(Named, name="given")
process.crawl(Named, rename="initname")
process.start()
"""


@pytest.mark.slow
def test_names_given_to_process_crawl_or_set_in_init_name_the_keys(redis_url: str, redis_client: Any) -> None:
    """``process.crawl(Spider, name=...)`` and a name set in ``__init__``: each crawl lives under its final
    name, as Scrapy names it."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", RENAMED, redis_url], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert {k.decode().split("}")[0] + "}" for k in redis_client.keys("*")} == {"{given}", "{initname}"}
