"""A plain :class:`scrapy.Spider` (no scrapy-redis or scrapy-dist base class): every contestant crawls
with the very same spider, only the scheduler and dupefilter settings differ."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import scrapy
from scrapy.http import Response


class BenchSpider(scrapy.Spider):
    """Starts at ``start_url`` (``-a start_url=...``), follows every link, yields one small item a page."""

    name = "bench"

    def __init__(self, start_url: str = "http://127.0.0.1:8080/page/0", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.start_url = start_url

    async def start(self) -> AsyncIterator[scrapy.Request]:
        yield scrapy.Request(self.start_url)

    def parse(self, response: Response) -> Iterator[Any]:
        yield {"url": response.url, "title": response.css("title::text").get()}
        for href in response.css("a::attr(href)").getall():
            yield response.follow(href)
