"""The conditional-revisit middleware in process (tests/test_revisit_e2e.py runs it in real crawls): off
without REVISIT_CONDITIONAL and without a warning; a 304 to a conditional request is counted, calls the
spider's ``on_not_modified`` (whose errors are logged, not raised) and ends the request quietly; anything
else passes through."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from scrapy import Request, Spider
from scrapy.exceptions import NotConfigured
from scrapy.http import HtmlResponse
from scrapy.utils.test import get_crawler

from scrapy_dist.middlewares import ConditionalRevisitMiddleware, NotModified


class _Spider(Spider):
    name = "pages"

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.unchanged: list[str] = []

    def on_not_modified(self, response: Any) -> None:
        self.unchanged.append(response.url)
        if "boom" in response.url:
            raise ValueError("a bug in the hook")


def _middleware(**settings: Any) -> tuple[ConditionalRevisitMiddleware, Any]:
    crawler = get_crawler(_Spider, {"REVISIT_CONDITIONAL": True, **settings})
    crawler.spider = crawler._create_spider()
    return ConditionalRevisitMiddleware.from_crawler(crawler), crawler


def test_off_without_the_setting_and_says_nothing() -> None:
    with pytest.raises(NotConfigured) as refused:
        ConditionalRevisitMiddleware.from_crawler(get_crawler(_Spider, {}))
    assert refused.value.args == ()  # Scrapy logs a WARNING for a NotConfigured with a message


def test_a_304_to_a_conditional_request_ends_it_and_calls_the_hook(caplog: pytest.LogCaptureFixture) -> None:
    mw, crawler = _middleware()
    conditional = Request("http://site.test/a", headers={"If-None-Match": '"v1"'})
    mw.process_request(conditional)
    with pytest.raises(NotModified):
        mw.process_response(conditional, HtmlResponse(conditional.url, status=304, request=conditional))
    assert crawler.spider.unchanged == ["http://site.test/a"]
    stats = crawler.stats.get_stats()
    assert stats["revisit/conditional"] == 1 and stats["revisit/not_modified"] == 1
    broken = Request("http://site.test/boom", headers={"If-Modified-Since": "Mon, 23 Nov 2026 10:00:00 GMT"})
    with caplog.at_level(logging.ERROR), pytest.raises(NotModified):
        mw.process_response(broken, HtmlResponse(broken.url, status=304, request=broken))
    assert "on_not_modified(<304 http://site.test/boom>) raised" in caplog.text


def test_everything_else_passes_through() -> None:
    mw, crawler = _middleware()
    plain = Request("http://site.test/b")
    mw.process_request(plain)
    unconditional_304 = HtmlResponse(plain.url, status=304, request=plain)
    assert mw.process_response(plain, unconditional_304) is unconditional_304  # not ours to end
    conditional = Request("http://site.test/c", headers={"If-None-Match": '"v2"'})
    fresh = HtmlResponse(conditional.url, status=200, body=b"<html></html>", request=conditional)
    assert mw.process_response(conditional, fresh) is fresh
    assert mw.process_exception(conditional, OSError("reset")) is None
    assert crawler.spider.unchanged == []


def test_conditional_revisits_without_the_middleware_warn_once(caplog: Any) -> None:
    from scrapy_dist.frontier.engine import Revisits

    crawler = get_crawler(settings_dict={"REVISIT_CONDITIONAL": True})
    Revisits.from_crawler(crawler)
    assert caplog.text.count("REVISIT_CONDITIONAL is on but") == 1
    caplog.clear()
    crawler = get_crawler(settings_dict={"REVISIT_CONDITIONAL": True, "DOWNLOADER_MIDDLEWARES": {
        "scrapy_dist.middlewares.ConditionalRevisitMiddleware": 580}})
    Revisits.from_crawler(crawler)
    assert "REVISIT_CONDITIONAL is on but" not in caplog.text
