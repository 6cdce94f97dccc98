"""Key names are an interface (users type them into redis-cli, other tools read them): exact strings, and
every key one Lua script touches shares a Redis Cluster hash slot."""

from __future__ import annotations

import dataclasses

import pytest
from redis.crc import key_slot
from scrapy.settings import Settings

from scrapy_dist.redis.keys import FRONTIER_KEY_NAMES, CrawlKeys, crawl_keys
from scrapy_dist.settings import DistSettings


def slot(key: str) -> int:
    return key_slot(key.encode())


def test_per_crawl_key_names_are_exact() -> None:
    k = CrawlKeys("books")
    assert k.tag == "{books}"
    assert k.queue == "{books}:queue"
    assert k.queue_rejected == "{books}:queue:rejected"
    assert k.leases == "{books}:leases"
    assert k.lease_meta == "{books}:leases:meta"
    assert k.seq == "{books}:seq"
    assert k.delayed == "{books}:delayed"
    assert k.delayed_meta == "{books}:delayed:meta"
    assert k.deadletter == "{books}:deadletter"
    assert k.bloom == "{books}:bloom"
    assert k.bloom_block(0, 0) == "{books}:bloom:0:0"
    assert k.bloom_block(2, 17) == "{books}:bloom:2:17"
    assert k.fingerprints == "{books}:fingerprints"
    assert k.workers == "{books}:workers"
    assert k.worker("host:12:ab") == "{books}:worker:host:12:ab"
    assert k.stats == "{books}:stats"
    assert k.control == "{books}:control"
    assert k.errors == "{books}:errors"
    assert k.cookies == "{books}:cookies"


def test_seed_and_item_keys_keep_the_plain_scrapy_redis_names() -> None:
    k = CrawlKeys("books")
    assert k.start_urls == "books:start_urls"
    assert k.start_urls_rejected == "books:start_urls:rejected"
    assert k.start_urls_processing == "{books:start_urls}:processing"
    assert k.items == "books:items"


def test_prefix_goes_in_front_of_every_key() -> None:
    k = CrawlKeys("books", prefix="shop:")
    assert k.queue == "shop:{books}:queue"
    assert k.bloom_block(1, 3) == "shop:{books}:bloom:1:3"
    assert k.start_urls == "shop:books:start_urls"
    assert k.start_urls_processing == "{shop:books:start_urls}:processing"
    assert k.items == "shop:books:items"


def test_templates_accept_name_and_spider_placeholders() -> None:
    k = CrawlKeys("books", start_urls_template="seeds:%(spider)s", items_template="out:%(name)s")
    assert k.start_urls == "seeds:books"
    assert k.items == "out:books"


@pytest.mark.parametrize("prefix", ["", "p:", "{x}"])
def test_all_per_crawl_keys_share_one_hash_slot(prefix: str) -> None:
    k = CrawlKeys("books", prefix=prefix)
    per_crawl = [
        *k.frontier_keys(),
        k.queue_rejected,
        k.deadletter,
        k.bloom_block(3, 9),
        k.worker("w1"),
        k.errors,
        k.cookies,
    ]
    # The {spider} hash tag decides the slot (the first {...} of the key), whatever the prefix...
    # ...unless the prefix itself carries braces, which then becomes the tag for all of them alike.
    assert {slot(key) for key in per_crawl} == {slot(k.queue)}
    if "{" not in prefix:
        assert slot(k.queue) == slot("books")


def test_seed_processing_list_shares_the_seeds_key_slot() -> None:
    for k in (CrawlKeys("books"), CrawlKeys("books", prefix="shop:")):
        assert slot(k.start_urls_processing) == slot(k.start_urls)


def test_different_spiders_get_disjoint_keys() -> None:
    a, b = CrawlKeys("a"), CrawlKeys("b")
    assert not set(a.frontier_keys()) & set(b.frontier_keys())


def test_frontier_keys_lists_every_frontier_key_once() -> None:
    k = CrawlKeys("books")
    keys = k.frontier_keys()
    assert len(keys) == len(set(keys)) == len(FRONTIER_KEY_NAMES)
    assert set(keys) == {getattr(k, name) for name in FRONTIER_KEY_NAMES}
    # The frontier's core keys are always among them (others may add their own).
    assert {
        "{books}:queue",
        "{books}:leases",
        "{books}:leases:meta",
        "{books}:seq",
        "{books}:delayed",
        "{books}:delayed:meta",
        "{books}:bloom",
        "{books}:fingerprints",
        "{books}:workers",
        "{books}:stats",
        "{books}:control",
    } <= set(keys)
    assert all(key.startswith("{books}:") for key in keys)


def test_crawl_keys_reads_the_settings() -> None:
    settings = Settings(
        {
            "REDIS_KEY_PREFIX": "t1:",
            "REDIS_START_URLS_KEY": "%(name)s:seeds",
            "REDIS_ITEMS_KEY": "%(spider)s:scraped",
        }
    )
    k = crawl_keys(DistSettings.from_settings(settings), "books")
    assert k.queue == "t1:{books}:queue"
    assert k.start_urls == "t1:books:seeds"
    assert k.items == "t1:books:scraped"


def test_crawl_keys_defaults_from_an_empty_dict() -> None:
    k = crawl_keys(DistSettings.from_settings({}), "books")
    assert k == CrawlKeys("books")
    assert k.start_urls == "books:start_urls"
    assert k.items == "books:items"


def test_crawl_keys_is_immutable() -> None:
    k = CrawlKeys("books")
    with pytest.raises(dataclasses.FrozenInstanceError):
        k.spider = "other"  # type: ignore[misc]
