"""DistSettings: parsing, validation, aliases, derived values, suggestions, the doc and the stats list."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
from scrapy.settings import Settings
from scrapy.utils.test import get_crawler

from scrapy_dist.frontier.orders import DomainLimits
from scrapy_dist.redis.connection import resolve_target
from scrapy_dist.redis.keys import crawl_keys
from scrapy_dist.settings import DistSettings, defaults, mask_url
from scrapy_dist.settings.table import DOC_PATH, STATS, TABLE, render_doc
from scrapy_dist.settings.values import SettingsError

ONE_LINE = re.compile(
    r"^scrapy-dist: (?P<name>[A-Z_]+(?:\[[^]=]+\])*)=(?P<value>[^\n]*?): "
    r"(?P<problem>[^;\n]+); (?P<expected>[^\n]+)$"
)
PACKAGE = Path(__file__).resolve().parents[1] / "scrapy_dist"


def refusal(settings: dict[str, Any], environ: dict[str, str] | None = None) -> str:
    with pytest.raises(SettingsError) as info:
        DistSettings.from_settings(settings, environ=environ or {})
    text = str(info.value)
    assert ONE_LINE.match(text), text
    return text


@pytest.mark.parametrize(
    ("name", "value", "problem"),
    [
        ("REDIS_URL", "127.0.0.1:6380", "no scheme"),
        ("REDIS_URL", "localhost:6379", "no scheme"),
        ("REDIS_URL", "redis:/host", "malformed: the scheme must be followed by //"),
        ("REDIS_URL", "redis://host:abc/0", "the port is not a number from 1 to 65535"),
        ("REDIS_URL", "redis://host:0/0", "the port is not a number from 1 to 65535"),
        ("REDIS_URL", "redis://host:6379/x", "database 'x' is not a number"),
        ("REDIS_URL", "http://example.com/", "scheme http:// is not Redis"),
        ("REDIS_URL", "unix://relative/sock", "no socket path"),
        ("SCHEDULER_LEASE_SECONDS", "abc", "not a number"),
        ("SCHEDULER_LEASE_SECONDS", "-5", "out of range"),
        ("SCHEDULER_LEASE_SECONDS", 0, "out of range"),
        ("SCHEDULER_LEASE_SECONDS", "nan", "not a finite number"),
        ("BLOOMFILTER_ERROR_RATE", 2, "out of range"),
        ("BLOOMFILTER_CAPACITY", 10**400, "out of range"),
        ("BLOOMFILTER_BLOCK_BITS", 10_000, "not a multiple of 4,096"),
        ("BLOOMFILTER_CAPACITY", "1.5", "not an integer"),
        ("REDIS_PARAMS", "{bad", "not a JSON object"),
        ("REDIS_PARAMS", "[1]", "not a dict but a list"),
        ("SCHEDULER_PERSIST", "maybe", "not a boolean"),
        ("SCHEDULER_POLITENESS", "global", "unknown value"),
        ("ERRORMONITOR_ACTION", "explode", "unknown value"),
        ("REDIS_PORT", "70000", "out of range"),
        ("REDIS_DB", "-1", "out of range"),
        ("REDIS_DB", "one", "not an integer"),
        ("REDIS_CLUSTER", "sometimes", "not a boolean"),
        ("ERRORMONITOR_HTTP_ERRORS", "5xx,abc", "'abc' is not a status"),
        ("DOMAIN_LIMITS", '{"a.com": {"delay": -1}}', "out of range"),
        ("SCHEDULER_ALLOWED_SCHEMES", "", "not a list of URL schemes"),
        ("SCHEDULER_QUEUE_CLASS", "nope.Queue", "cannot be imported"),
        # a queue object (scrapy-redis's Base(server, spider, key) and its subclasses) is not an order: it
        # got past the start and failed in the scheduler with a traceback storm
        ("SCHEDULER_QUEUE_CLASS", "datetime.date", "not a queue order"),
        ("SCHEDULER_QUEUE_CLASS", "json.JSONDecoder", "not a queue order"),
        ("REDIS_ITEMS_SERIALIZER", "json.dumpz", "cannot be imported"),
    ],
)
def test_a_bad_value_is_one_line_naming_setting_value_problem_and_expectation(
    name: str, value: Any, problem: str
) -> None:
    text = refusal({name: value})
    match = ONE_LINE.match(text)
    assert match is not None
    assert match["name"] == name or name == "DOMAIN_LIMITS", text
    assert match["problem"].startswith(problem), text
    assert match["expected"].startswith("expected"), text


def test_long_values_are_shortened_and_passwords_masked() -> None:
    text = refusal({"BLOOMFILTER_CAPACITY": 10**400})
    assert len(text) < 200
    assert "..." in text
    text = refusal({"REDIS_URL": "http://user:s3cret@host/"})
    assert "s3cret" not in text
    assert "user:***@host" in text


def test_every_numeric_setting_is_checked() -> None:
    for spec in TABLE:
        if spec.kind in ("int", "float"):
            text = refusal({spec.name: "abc"})
            assert text.startswith(f"scrapy-dist: {spec.name}=abc: not a"), text


def test_values_from_the_command_line_are_converted() -> None:
    s = Settings()
    s.setdict(
        {
            "SCHEDULER_PERSIST": "False",
            "SCHEDULER_LEASE_SECONDS": "30",
            "REDIS_PARAMS": '{"socket_timeout": 3}',
            "SCHEDULER_ALLOWED_SCHEMES": "HTTP,https,ftp",
            "ERRORMONITOR_MAX_ERRORS": "None",
            "BLOOMFILTER_CAPACITY": "1e6",
            "ERRORMONITOR_ACTION": "Pause",
        },
        priority="cmdline",
    )
    ds = DistSettings.from_settings(s, environ={})
    assert ds.scheduler.persist is False
    assert ds.scheduler.lease_seconds == 30.0
    assert dict(ds.connection.params) == {"socket_timeout": 3}
    assert ds.scheduler.allowed_schemes == ("http", "https", "ftp")
    assert ds.monitoring.max_errors is None
    assert ds.dupefilter.capacity == 1_000_000
    assert ds.monitoring.action == "pause"


def test_defaults_come_from_the_table() -> None:
    ds = DistSettings.from_settings({}, environ={})
    assert ds.scheduler.lease_seconds == defaults.SCHEDULER_LEASE_SECONDS == 60.0
    assert ds.dupefilter.capacity == defaults.BLOOMFILTER_CAPACITY
    assert ds.scheduler.persist is True
    for spec in TABLE:
        assert getattr(defaults, spec.name) == spec.default
    with pytest.raises(AttributeError):
        _ = defaults.NOT_A_SETTING
    defaults.ERRORMONITOR_HTTP_ERRORS.append(404)  # a copy: the table is not changed
    assert defaults.ERRORMONITOR_HTTP_ERRORS == ["5xx", 429]


def test_derived_values_are_computed_once_here() -> None:
    ds = DistSettings.from_settings({"CONCURRENT_REQUESTS": 40}, environ={})
    assert ds.scheduler.prefetch == 80
    assert ds.seeds.batch_size == 40
    ds = DistSettings.from_settings({"CONCURRENT_REQUESTS": 2, "SCHEDULER_PREFETCH": 0}, environ={})
    assert ds.scheduler.prefetch == 16
    ds = DistSettings.from_settings({"SCHEDULER_PREFETCH": 5, "REDIS_START_URLS_BATCH_SIZE": 3}, environ={})
    assert (ds.scheduler.prefetch, ds.seeds.batch_size) == (5, 3)
    assert DistSettings.from_settings({}, environ={}).seeds.kind == "list"
    assert DistSettings.from_settings({"REDIS_START_URLS_AS_SET": True}, environ={}).seeds.kind == "set"
    assert DistSettings.from_settings({"REDIS_START_URLS_AS_ZSET": "1"}, environ={}).seeds.kind == "zset"


def test_settings_that_exclude_each_other_are_refused() -> None:
    text = refusal({"REDIS_START_URLS_AS_SET": True, "REDIS_START_URLS_AS_ZSET": True})
    assert "REDIS_START_URLS_AS_ZSET" in text
    ds = DistSettings.from_settings({"SCHEDULER_SHARDS": 4, "SCHEDULER_POLITENESS": "cluster"}, environ={})
    assert (ds.scheduler.shards, ds.scheduler.politeness) == (4, "cluster")  # routed by domain
    assert DistSettings.from_settings({"SCHEDULER_SHARDS": 4}, environ={}).scheduler.shards == 4
    assert "RETRY_BACKOFF_BASE" in refusal({"RETRY_BACKOFF_BASE": 10, "RETRY_BACKOFF_MAX": 5})


def test_idle_alias() -> None:
    ds = DistSettings.from_settings({"MAX_IDLE_TIME_BEFORE_CLOSE": "7"}, environ={})
    assert ds.scheduler.idle_before_close == 7.0
    ds = DistSettings.from_settings(
        {"MAX_IDLE_TIME_BEFORE_CLOSE": 7, "SCHEDULER_IDLE_BEFORE_CLOSE": 3}, environ={}
    )
    assert ds.scheduler.idle_before_close == 3.0
    assert any("MAX_IDLE_TIME_BEFORE_CLOSE is ignored" in w for w in ds.warnings)
    assert refusal({"MAX_IDLE_TIME_BEFORE_CLOSE": "soon"}).startswith(
        "scrapy-dist: MAX_IDLE_TIME_BEFORE_CLOSE=soon: not a number"
    )


def test_near_miss_names_get_a_suggestion_and_ours_or_scrapys_do_not() -> None:
    ds = DistSettings.from_settings(
        {
            "REDIS_ULR": "redis://x/0",
            "SCHEDULER_PERISST": False,
            "SCHEDULER_DEBUG": True,
            "DOWNLOAD_DELAY": 1,
            "REDIS_URL": "redis://h:1/0",
            "RETRY_TIMES": 3,
        },
        environ={},
    )
    assert ds.warnings == (
        "scrapy-dist: unknown setting REDIS_ULR; did you mean REDIS_URL?",
        "scrapy-dist: unknown setting SCHEDULER_PERISST; did you mean SCHEDULER_PERSIST?",
    )


def test_connection_settings_nobody_reads_say_where_the_value_goes() -> None:
    """REDIS_PASSWORD & co. were silently ignored (no close match), or REDIS_USER got 'did you mean
    REDIS_CLUSTER?'."""
    ds = DistSettings.from_settings(
        {"REDIS_URL": "redis://h:1/0", "REDIS_PASSWORD": "s3cret", "REDIS_USER": "crawler",
         "REDIS_SSL": True},
        environ={},
    )
    assert len(ds.warnings) == 3, ds.warnings
    for name in ("REDIS_PASSWORD", "REDIS_USER", "REDIS_SSL"):
        [line] = [w for w in ds.warnings if f"setting {name}:" in w]
        assert "REDIS_URL" in line and "REDIS_PARAMS" in line and "did you mean" not in line
    assert "s3cret" not in " ".join(ds.warnings)  # the value is not logged


def test_scrapy_redis_settings_we_do_not_apply_are_named() -> None:
    ds = DistSettings.from_settings(
        {"SCHEDULER_QUEUE_KEY": "%(spider)s:requests", "REDIS_ENCODING": "latin1",
         "REDIS_DECODE_RESPONSES": True}, environ={}
    )
    assert len(ds.warnings) == 3 and any("REDIS_DECODE_RESPONSES" in w for w in ds.warnings)
    assert all("scrapy-redis setting scrapy-dist does not apply" in w for w in ds.warnings)


@pytest.mark.parametrize(
    ("name", "order"),
    [("SpiderQueue", "FifoQueue"), ("SpiderStack", "LifoQueue"), ("SpiderPriorityQueue", "PriorityQueue"),
     ("FifoQueue", "FifoQueue"), ("LifoQueue", "LifoQueue"), ("PriorityQueue", "PriorityQueue")],
)
def test_scrapy_redis_queue_names_under_scrapy_dist_keep_their_order(name: str, order: str) -> None:
    """scrapy-redis's example settings name SpiderQueue, SpiderStack and SpiderPriorityQueue; a project
    switched by replacing scrapy_redis with scrapy_dist was refused ('cannot be imported')."""
    from scrapy.utils.misc import load_object

    from scrapy_dist.frontier import orders as queue

    for path in (f"scrapy_redis.queue.{name}", f"scrapy_dist.frontier.orders.{name}"):
        ds = DistSettings.from_settings({"SCHEDULER_QUEUE_CLASS": path}, environ={})
        assert ds.scheduler.queue_class == path
        assert (queue.ALIASES.get(path) or load_object(path)) is getattr(queue, order)


# -- which Redis --------------------------------------------------------------------------------
def test_redis_order_settings_then_environment_then_embedded() -> None:
    env = {"REDIS_URL": "redis://env-host:1/0"}
    ds = DistSettings.from_settings({"REDIS_URL": "redis://set-host:2/0"}, environ=env)
    assert (ds.connection.url, ds.connection.source) == ("redis://set-host:2/0", "REDIS_URL")
    ds = DistSettings.from_settings({"REDIS_HOST": "h"}, environ=env)
    assert (ds.connection.url, ds.connection.source) == (None, "REDIS_HOST/REDIS_PORT")
    ds = DistSettings.from_settings({}, environ=env)
    assert (ds.connection.url, ds.connection.source) == (
        "redis://env-host:1/0",
        "REDIS_URL environment variable",
    )
    assert DistSettings.from_settings({}, environ={}).connection.source == "embedded"
    text = refusal({}, environ={"REDIS_URL": "env-host:6379"})
    assert "(environment variable)" in text


def test_workers_honour_the_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://:pw@env-host:6390/2")
    target = resolve_target(Settings())
    assert target.url == "redis://:pw@env-host:6390/2"
    assert target.setting == "REDIS_URL environment variable"


def test_which_redis_is_logged_once_masked(caplog: pytest.LogCaptureFixture) -> None:
    url = "redis://u:p#w/d?x@logged-once:6391/0"
    with caplog.at_level(logging.INFO, logger="scrapy_dist.redis.connection"):
        for _ in range(3):
            resolve_target({"REDIS_URL": url})
    lines = [r.getMessage() for r in caplog.records if "Using Redis at" in r.getMessage()]
    assert lines == ["Using Redis at redis://u:***@logged-once:6391/0 (from REDIS_URL)"]


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("redis://user:secret@host:6379/0", "redis://user:***@host:6379/0"),
        ("redis://:se#cret@host/0", "redis://:***@host/0"),
        ("redis://u:a/b?c#d@host:1/0", "redis://u:***@host:1/0"),
        ("rediss://u:p@ss@host/0", "rediss://u:***@host/0"),
        ("unix://:pw@/tmp/redis.sock?db=1", "unix://:***@/tmp/redis.sock?db=1"),
        ("redis://host/0?password=x&db=1", "redis://host/0?password=***&db=1"),
        ("redis://host:6379/0", "redis://host:6379/0"),
        ("not a url", "not a url"),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked


# -- one instance per crawler -------------------------------------------------------------------
def test_for_crawler_reads_once_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    crawler = get_crawler(settings_dict={"SCHEDULER_PERISST": True, "SCHEDULER_LEASE_SECONDS": 9})
    crawler.settings.freeze()
    with caplog.at_level(logging.WARNING):
        first = DistSettings.for_crawler(crawler)
        assert DistSettings.for_crawler(crawler) is first
    assert first.scheduler.lease_seconds == 9.0
    assert [r.getMessage() for r in caplog.records if "PERISST" in r.getMessage()] == [
        "scrapy-dist: unknown setting SCHEDULER_PERISST; did you mean SCHEDULER_PERSIST?"
    ]


def test_for_crawler_raises_the_one_line_and_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    crawler = get_crawler(settings_dict={"SCHEDULER_LEASE_SECONDS": "abc"})
    with caplog.at_level(logging.ERROR), pytest.raises(SettingsError) as info:
        DistSettings.for_crawler(crawler)
    assert str(info.value) == (
        "scrapy-dist: SCHEDULER_LEASE_SECONDS=abc: not a number; expected a positive number"
    )
    assert not caplog.records  # the component that asked decides (it refuses the crawl's start)


def test_components_build_from_the_settings_object() -> None:
    ds = DistSettings.from_settings(
        {"REDIS_KEY_PREFIX": "p:", "DOWNLOAD_DELAY": 2, "DOMAIN_LIMITS": {"*.a.com": {"delay": 5}}},
        environ={},
    )
    assert crawl_keys(ds, "s").queue == "p:{s}:queue"
    limits = DomainLimits.from_dist(ds)
    assert limits.for_domain("x.a.com").delay == 5.0
    assert limits.for_domain("b.com").delay == 2.0


# -- docs and stats -------------------------------------------------------------------------------
def test_settings_doc_is_in_sync() -> None:
    assert DOC_PATH.read_text(encoding="utf-8") == render_doc(), "run: python -m scrapy_dist.settings.table"
    for spec in TABLE:
        assert f"`{spec.name}`" in render_doc()


def test_every_stat_the_package_writes_is_listed() -> None:
    patterns = [
        re.compile(
            "^" + re.sub(r"<[a-z_]+>", "[^/]+", re.escape(name).replace(r"\<", "<").replace(r"\>", ">")) + "$"
        )
        for name, _ in STATS
    ]
    writes = re.compile(r"(?:(?:inc_value|set_value|_inc)\(|inc_stat\(.*?,)\s*f?\"([a-z_]+/[^\"]+)\"")
    written = set()
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for match in writes.finditer(text):
            written.add(re.sub(r"\{[^}]+\}", "x", match.group(1)))
        for match in re.finditer(r"\"((?:dupefilter|scheduler)/[a-z_/]+)\":", text):
            written.add(match.group(1))
    assert len(written) > 20
    missing = sorted(name for name in written if not any(p.match(name) for p in patterns))
    assert not missing, missing


@pytest.mark.parametrize(
    ("settings", "name", "closest"),
    [
        ({"SCHEDULER": "scrapy_dist.scheduler.Schedular"}, "SCHEDULER", "scrapy_dist.scheduler.Scheduler"),
        ({"SCHEDULER": "scrapy_dist.schedulr.Scheduler"}, "SCHEDULER", "scrapy_dist.scheduler.Scheduler"),
        ({"SCHEDULER": "scrapy_dist.scheduler.Scheduler",
          "DUPEFILTER_CLASS": "scrapy_dist.dupefilters.BloomDupeFilter"},
         "DUPEFILTER_CLASS", "scrapy_dist.dupefilter.BloomDupeFilter"),
        ({"STATS_CLASS": "scrapy_dist.stats.RedisStatsColector"}, "STATS_CLASS",
         "scrapy_dist.stats.RedisStatsCollector"),
        # the scrapy-dist scheduler loads DUPEFILTER_CLASS whatever it names
        ({"SCHEDULER": "scrapy_dist.scheduler.Scheduler",
          "DUPEFILTER_CLASS": "scrapy.dupefilters.RFPDupefilter"}, "DUPEFILTER_CLASS", None),
    ],
)
def test_a_misspelt_class_path_is_one_line_with_the_closest_name(
    settings: dict[str, Any], name: str, closest: str | None
) -> None:
    text = refusal(settings)
    assert text.startswith(f"scrapy-dist: {name}={settings[name]}: cannot be imported"), text
    assert text.endswith(f"did you mean {closest}?" if closest else "like package.module.Name"), text


def test_class_paths_outside_scrapy_dist_are_left_to_scrapy() -> None:
    # without the scrapy-dist scheduler, Scrapy's own components are none of scrapy-dist's business
    DistSettings.from_settings({"SCHEDULER": "scrapy.core.scheduler.Schedular",
                                "DUPEFILTER_CLASS": "scrapy.dupefilters.RFPDupefilter"}, environ={})


@pytest.mark.parametrize("spec", [s for s in TABLE if s.kind in ("int", "float") and s.low is not None],
                         ids=lambda s: s.name)
def test_the_doc_states_the_range_the_code_accepts(spec: Any) -> None:
    row = next(line for line in render_doc().splitlines() if line.startswith(f"| `{spec.name}` |"))
    assert spec.range_words.removeprefix("of ") in row.split("|")[2], row
    others = {"RETRY_BACKOFF_BASE": 0} if spec.name == "RETRY_BACKOFF_MAX" else {}  # MAX >= BASE
    edges = [spec.low] + ([spec.high] if spec.high is not None else [])
    if spec.kind == "int":
        edges = [int(e) for e in edges]
    for edge in edges:  # the edges the doc states are accepted (unless open) ...
        if edge == spec.low and spec.low_open:
            refusal({**others, spec.name: edge})
        else:
            DistSettings.from_settings({**others, spec.name: edge}, environ={})
    beyond = [spec.low - (1 if spec.kind == "int" else spec.low / 2 or 1)]
    if spec.high is not None:
        beyond.append(spec.high + 1 if spec.kind == "int" else spec.high * 1.5)
    noun = "an integer" if spec.kind == "int" else "a"
    for value in beyond:  # ... and what lies beyond them is refused in the doc's words
        assert f"out of range; expected {noun}" in refusal({**others, spec.name: value})


def test_bloom_filter_settings_accept_no_value_the_filter_refuses() -> None:
    from scrapy_dist.dupefilter.bloom import check_parameters
    from scrapy_dist.settings.table import BY_NAME

    capacity, rate, bits = (BY_NAME[f"BLOOMFILTER_{n}"] for n in ("CAPACITY", "ERROR_RATE", "BLOCK_BITS"))
    for value in (capacity.low, capacity.high):
        check_parameters(int(value), rate.default, bits.default)
    for value in (rate.low, rate.high):
        check_parameters(capacity.default, value, bits.default)
    for value in (bits.low, bits.high):
        check_parameters(capacity.default, rate.default, int(value))


@pytest.mark.parametrize(
    ("settings", "start", "end"),
    [
        ({"REDIS_PARAMS": {"socket_timeout": "x"}}, "REDIS_PARAMS['socket_timeout']=x: socket_timeout is 'x'",
         "expected e.g. socket_timeout=5"),
        ({"REDIS_PARAMS": '{"max_connections": 0}'}, "REDIS_PARAMS['max_connections']=0:",
         "expected e.g. max_connections=5"),
        # the value of an unknown option is not shown: it may be a password under a misspelt name
        ({"REDIS_PARAMS": {"passwrd": "s3cret"}}, "REDIS_PARAMS={'passwrd': ...}: 'passwrd' is not a",
         "did you mean password?"),
        ({"REDIS_URL": "unix:///tmp/r.sock?db=z"}, "REDIS_URL=unix:///tmp/r.sock?db=z: bad query", "=5"),
        ({"REDIS_URL": "redis://:pw@h/0?sockettimeout=5"}, "REDIS_URL=redis://:***@h/0?sockettimeout=5:",
         "did you mean socket_timeout?"),
    ],
)
def test_redis_client_options_are_checked_at_start(settings: dict[str, Any], start: str, end: str) -> None:
    text = refusal(settings)
    assert text.startswith(f"scrapy-dist: {start}") and text.endswith(end), text
    assert "s3cret" not in text


def test_client_options_that_some_client_takes_are_accepted() -> None:
    DistSettings.from_settings({"REDIS_PARAMS": {
        "socket_timeout": 30, "socket_connect_timeout": 5.5, "retry_on_timeout": True, "encoding": "utf-8",
        "ssl_cert_reqs": "none", "read_from_replicas": True, "sentinel_kwargs": {"password": "x"},
        "max_connections": 10, "health_check_interval": 0, "redis_cls": "redis.Redis",
    }}, environ={})
    DistSettings.from_settings({"REDIS_URL": "rediss://h:6380/2?ssl_cert_reqs=none&socket_timeout=3"},
                               environ={})
