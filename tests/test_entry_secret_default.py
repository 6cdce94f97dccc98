"""Unsigned queue entries: the embedded Redis signs with a secret of its own, kept with its private files;
a worker on a shared Redis without a secret says once, at start, what that means and how to set one."""

from __future__ import annotations

import logging
import stat
from pathlib import Path
from typing import Any

import pytest
import redis
import scrapy
from crawlproject import make_project
from scrapy.utils.test import get_crawler

from scrapy_dist.redis.embedded import EmbeddedRedis
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.redis.target import SECRET_FILE
from scrapy_dist.settings import DistSettings
from scrapy_dist.wire import entrypolicy
from scrapy_dist.wire.codec import DEFAULT_POLICY, EntryPolicy, encode_request


def test_the_embedded_redis_keeps_one_secret_of_its_own(tmp_path: Path) -> None:
    directory = tmp_path / "embedded"
    settings = {"REDIS_EMBEDDED_DIR": str(directory)}
    first = EntryPolicy.from_dist(DistSettings.from_settings(settings)).secret
    assert first is not None and len(first) == 64
    again = EntryPolicy.from_dist(DistSettings.from_settings(settings)).secret
    assert again == first  # every process of the project: the same
    mode = (directory / SECRET_FILE).stat().st_mode
    assert stat.S_IMODE(mode) == 0o600
    mine = DistSettings.from_settings({**settings, "SCHEDULER_ENTRY_SECRET": "mine"})
    assert EntryPolicy.from_dist(mine).secret == b"mine"
    shared = DistSettings.from_settings({"REDIS_URL": "redis://localhost:1/0"})
    assert EntryPolicy.from_dist(shared).secret is None


def test_a_worker_on_a_shared_redis_without_a_secret_warns_once(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("SCRAPY_DIST_SECRET", raising=False)
    monkeypatch.setattr(entrypolicy, "_warned_unsigned", [])
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            entrypolicy.entry_policy(get_crawler(settings_dict={"REDIS_URL": redis_url}))
        signed = {"REDIS_URL": redis_url, "SCHEDULER_ENTRY_SECRET": "s"}
        entrypolicy.entry_policy(get_crawler(settings_dict=signed))
    lines = [r.getMessage() for r in caplog.records if "SCHEDULER_ENTRY_SECRET" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "proxy" in lines[0] and "SCRAPY_DIST_SECRET=" in lines[0] and "REDIS_URL" in lines[0]


@pytest.mark.slow
def test_an_unsigned_entry_cannot_route_a_crawl_on_the_embedded_redis(
    tmp_path: Path, site_factory: Any
) -> None:
    site = site_factory(pages=5)
    directory = tmp_path / "embedded"
    server = EmbeddedRedis(directory)
    url, _ = server.ensure_running()
    try:
        client = redis.Redis.from_url(url)
        keys = CrawlKeys("nofollow")
        planted = encode_request(
            scrapy.Request("http://93.184.216.34/x", meta={"proxy": site.url}),
            scrapy.Spider(name="nofollow"), DEFAULT_POLICY,
        )
        client.zadd(keys.queue, {(1).to_bytes(6, "big") + planted: 0})
        project = make_project(tmp_path / "project", {"REDIS_EMBEDDED_DIR": str(directory)})
        project.crawl("nofollow")
        assert project.wait_all(60) == [0], project.logs()[-3000:]
        assert site.fetch_counts(status=None) == {}  # the site, as the planted proxy, was never asked
        rejected = client.lrange(keys.queue_rejected, 0, -1)
        assert len(rejected) == 1 and b"meta_not_allowed" in rejected[0], rejected
        assert "No SCHEDULER_ENTRY_SECRET" not in project.logs()
    finally:
        server.shutdown(save=False)


def test_a_planted_secret_file_is_refused_not_followed(tmp_path: Path) -> None:
    from scrapy_dist.exceptions import RedisUnavailable

    directory = tmp_path / "embedded"
    directory.mkdir(mode=0o700)
    theirs = tmp_path / "theirs"
    theirs.write_text("a" * 64)
    (directory / SECRET_FILE).symlink_to(theirs)
    with pytest.raises(RedisUnavailable, match="remove it"):
        EntryPolicy.from_dist(DistSettings.from_settings({"REDIS_EMBEDDED_DIR": str(directory)}))
