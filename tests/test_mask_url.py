"""Passwords with unencoded '#', '/', '?' (or '@') in REDIS_URL are masked in every message."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scrapy_dist.redis.connection import mask_url


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("redis://:pa#ss@h:1/0", "redis://:***@h:1/0"),
        ("redis://u:p/ss@h:1/0", "redis://u:***@h:1/0"),
        ("redis://u:p?ss@h:1/0", "redis://u:***@h:1/0"),
        ("redis://:a#b/c?d@h/0", "redis://:***@h/0"),
        ("redis://:p@ss@h/0", "redis://:***@h/0"),
        ("redis://:pw@h/0?password=q#z", "redis://:***@h/0?password=***"),
        ("unix://:pw@/tmp/x.sock?db=0", "unix://:***@/tmp/x.sock?db=0"),
        ("redis://h:1/0", "redis://h:1/0"),
        ("unix:///tmp/x.sock?db=0", "unix:///tmp/x.sock?db=0"),
        ("redis://user@h/0", "redis://user@h/0"),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked


_PASSWORD = st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="@"), min_size=6)


@settings(max_examples=300, deadline=None)
@given(password=_PASSWORD, user=st.sampled_from(["", "bob"]))
def test_no_password_survives_masking(password: str, user: str) -> None:
    assert password not in mask_url(f"redis://{user}:{password}@redis.internal:6379/0")
    # In the query an unencoded '&' ends the value for every parser, so it cannot be part of a password.
    query_password = password.replace("&", "%26")
    assert query_password not in mask_url(f"redis://h/0?password={query_password}")
