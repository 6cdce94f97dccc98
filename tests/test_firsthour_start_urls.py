"""What docs/quickstart.md says about start requests, checked with two real workers: Scrapy makes the
requests of ``start_urls`` with ``dont_filter=True``, so each worker fetches them, and they do not enter
the dupefilter either (a page linking back to a start URL gets it fetched once more, unless
``SEEDS_RECORD_FINGERPRINT``); every other page is crawled once, crawl-wide; start requests yielded
without ``dont_filter`` are crawled once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from crawlproject import make_project

SPIDERS = '''
import scrapy


class StartUrls(scrapy.Spider):
    name = "starturls"

    def __init__(self, seed="", **kw):
        super().__init__(**kw)
        self.start_urls = [seed]

    def parse(self, response):
        for href in response.css("a::attr(href)").getall():
            yield response.follow(href)


class Filtered(StartUrls):
    name = "filtered"

    async def start(self):
        for url in self.start_urls:
            yield scrapy.Request(url)  # dont_filter left False: the crawl-wide dupefilter sees it
'''


@pytest.mark.slow
@pytest.mark.parametrize(("spider", "record", "seed_fetches"), [
    ("starturls", False, 3),  # each worker, then once more for the first link back to it
    ("starturls", True, 2),  # each worker; recorded, so no link back fetches it again
    ("filtered", False, 1),
])
def test_start_urls_with_two_workers(
    tmp_path: Path, redis_url: str, site_factory: Any, spider: str, record: bool, seed_fetches: int
) -> None:
    site = site_factory(pages=60, links=4)
    assert any(0 in site.graph.links_of(i) for i in range(60)), "the site must link back to the start"
    project = make_project(tmp_path, {"REDIS_URL": redis_url, "SCHEDULER_IDLE_BEFORE_CLOSE": 2,
                                      "SEEDS_RECORD_FINGERPRINT": record}, spiders=SPIDERS)
    for _ in range(2):
        project.crawl(spider, args={"seed": site.page_url(0)})
    assert project.wait_all(90) == [0, 0], project.logs()[-3000:]
    counts = site.fetch_counts(status=None)
    assert len(counts) == 60
    seed_path = "/page/0"
    assert counts[seed_path] == seed_fetches, counts
    assert all(n == 1 for path, n in counts.items() if path != seed_path), counts
