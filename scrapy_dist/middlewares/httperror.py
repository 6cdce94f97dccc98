"""Scrapy's ``HttpErrorMiddleware`` that can also dead-letter the responses it ignores.

With ``HTTPERROR_DEAD_LETTER = True`` every response filtered out for its status goes to the crawl's
dead-letter list, so an audit lists every URL that never got a usable response, 404s and 403s included; a
response whose retries ran out was dead-lettered by the retry middleware already and is not recorded
twice. Stats are Scrapy's ``httperror/...``, summed crawl-wide by the cluster stats extension.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scrapy.spidermiddlewares.httperror import HttpError
from scrapy.spidermiddlewares.httperror import HttpErrorMiddleware as ScrapyHttpErrorMiddleware
from scrapy.utils.response import response_status_message

from scrapy_dist.middlewares.retry import DeadLetterWriter
from scrapy_dist.settings import DistSettings, defaults
from scrapy_dist.settings.refusal import refusing

if TYPE_CHECKING:
    from collections.abc import Iterable

    from scrapy.crawler import Crawler
    from scrapy.http import Response
    from scrapy.settings import BaseSettings

    # typing.Self requires Python 3.11
    from typing_extensions import Self

__all__ = ["HttpError", "HttpErrorMiddleware"]


class HttpErrorMiddleware(ScrapyHttpErrorMiddleware):
    """Drop-in for ``scrapy.spidermiddlewares.httperror.HttpErrorMiddleware`` (order 50); same settings
    and meta keys, plus ``HTTPERROR_DEAD_LETTER``."""

    dead_letters: DeadLetterWriter | None = None

    def __init__(self, settings: BaseSettings, dead_letter: bool = defaults.HTTPERROR_DEAD_LETTER) -> None:
        super().__init__(settings)
        self.dead_letter = dead_letter

    @classmethod
    @refusing
    def from_crawler(cls, crawler: Crawler) -> Self:
        ds = DistSettings.for_crawler(crawler)
        # Scrapy's HTTPERROR_ALLOW* settings go to Scrapy's middleware as they are
        o = cls(crawler.settings, dead_letter=ds.retries.httperror_dead_letter)
        o.crawler = crawler
        if o.dead_letter:
            o.dead_letters = DeadLetterWriter(crawler)
        return o

    # no ``spider`` parameter: Scrapy 2.19 deprecates it (the supertype still accepts it)
    def process_spider_exception(  # type: ignore[override]
        self, response: Response, exception: Exception
    ) -> Iterable[Any] | None:
        result = super().process_spider_exception(response, exception)
        request = response.request
        if isinstance(exception, HttpError) and self.dead_letters is not None and request is not None:
            self.dead_letters.write(
                request,
                str(response.status),
                status=response.status,
                detail=response_status_message(response.status),
            )
        return result
