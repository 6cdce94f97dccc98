"""The demo's Redis side in process: joining a named Redis (one line if it does not answer) and cleaning
up after a run (its keys deleted, the client closed, a server the demo did not start kept running)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from scrapy_dist.demo.site import open_redis, release_run
from scrapy_dist.exceptions import RedisUnavailable


def test_a_run_on_a_named_redis_is_joined_and_cleaned_up(redis_url: str, redis_client: Any,
                                                         tmp_path: Path) -> None:
    client, url, embedded, started = open_redis(redis_url, tmp_path, loading_timeout=5)
    assert (url, embedded, started) == (redis_url, None, False)
    redis_client.set("demo-1-ab:{demo}:queue", "x")
    redis_client.set("other:{demo}:queue", "kept")
    assert release_run(client, "demo-1-ab:", started_redis=False) is False  # not ours to stop
    assert redis_client.keys("*") == [b"other:{demo}:queue"]


def test_a_redis_that_does_not_answer_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(RedisUnavailable) as err:
        open_redis("redis://127.0.0.1:1/0", tmp_path, loading_timeout=1)
    assert "\n" not in str(err.value) and "127.0.0.1:1" in str(err.value)
