"""Subprocesses of the benchmarks (``scrapy crawl`` workers)."""

from __future__ import annotations

import signal
import subprocess


def interrupt(proc: subprocess.Popen, grace: float) -> None:
    """Stop a crawl as Ctrl-C does (SIGINT: a graceful close), killing it after ``grace`` seconds."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def link_spider(class_name: str, name: str, items_per_page: int) -> str:
    """The source of a spider module: from ``-a seed=URL``, follow every link; each page yields
    ``items_per_page`` items ``{"url": ..., "part": i}`` (``{"url": ...}`` alone when it is 1)."""
    item = '{"url": response.url}' if items_per_page == 1 else '{"url": response.url, "part": part}'
    loop = "" if items_per_page == 1 else f"for part in range({items_per_page}):\n            "
    return f'''import scrapy


class {class_name}(scrapy.Spider):
    name = "{name}"

    def __init__(self, seed=None, **kw):
        super().__init__(**kw)
        self.seed = seed

    async def start(self):
        if self.seed:
            yield scrapy.Request(self.seed)

    def parse(self, response):
        {loop}yield {item}
        for href in response.css("a::attr(href)").getall():
            yield response.follow(href)
'''
