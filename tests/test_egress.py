"""SCHEDULER_DENY_NETWORKS is checked on the address each connection uses: in the DNS resolver the download
connects through, with the add-on or with the scheduler alone, for a request's host and for its proxy; a
host or proxy written as an IP address is refused before the download; a DNS failure stays one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
from crawlproject import make_project
from scrapy.resolver import CachingThreadedResolver, dnscache
from twisted.internet import defer
from twisted.internet.error import DNSLookupError

from scrapy_dist.egress import (
    DeniedNetwork,
    DenyingNameResolver,
    DenyingResolver,
    DenyNetworksResolver,
    DenyPolicy,
    install,
    parse_networks,
)
from scrapy_dist.frontier.orders import parse_record
from scrapy_dist.redis.keys import CrawlKeys
from scrapy_dist.settings import defaults
from scrapy_dist.utils import RateLimitedLog

DENY = list(defaults.SCHEDULER_DENY_NETWORKS)

SPIDERS = '''
import socket

import scrapy

_real_gethostbyname = socket.gethostbyname
_real_getaddrinfo = socket.getaddrinfo
#: name -> answers of successive lookups, per lookup function
_answers = {"rebind.test": ["192.0.2.1", "127.0.0.1"]}
_addrinfo = {"rebind.test": ["192.0.2.1"]}
_asked = {}


def _answer(table, name):
    seq = table[name]
    n = _asked[id(table), name] = _asked.get((id(table), name), 0) + 1
    return seq[min(n, len(seq)) - 1]


def gethostbyname(name):
    """rebind.test answers a public address first, then 127.0.0.1: DNS rebinding."""
    if name in _answers:
        return _answer(_answers, name)
    return _real_gethostbyname(name)


def getaddrinfo(host, *args, **kw):
    if host in _addrinfo:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (_answer(_addrinfo, host), 0))]
    return _real_getaddrinfo(host, *args, **kw)


socket.gethostbyname = gethostbyname
socket.getaddrinfo = getaddrinfo


class OpenSpider(scrapy.Spider):
    """Requests the URLs given (``urls``), through ``proxy`` if given."""

    name = "open"

    def __init__(self, urls="", proxy="", **kw):
        super().__init__(**kw)
        self.urls = [u for u in urls.split(",") if u]
        self.proxy = proxy

    async def start(self):
        for url in self.urls:
            yield scrapy.Request(url, meta={"proxy": self.proxy} if self.proxy else {})

    def parse(self, response):
        yield {"url": response.url}
'''


# -- the resolver ---------------------------------------------------------------------------------------


class Rebinding:
    """An IResolverSimple whose answers for one name change from one lookup to the next."""

    def __init__(self, *answers: str) -> None:
        self.answers = list(answers)

    def getHostByName(self, name: str, timeout: Any = ()) -> defer.Deferred[str]:  # noqa: N802
        return defer.succeed(self.answers.pop(0))


def _result(d: defer.Deferred[Any]) -> Any:
    out: list[Any] = []
    d.addBoth(out.append)
    assert out, "the lookup did not finish"
    return out[0]


def test_the_answer_a_connection_uses_is_the_one_checked() -> None:
    policy = DenyPolicy(parse_networks(DENY))
    resolver = DenyingResolver(Rebinding("93.184.216.34", "127.0.0.1", "10.1.2.3"), policy)
    assert _result(resolver.getHostByName("rebind.test")) == "93.184.216.34"
    for _ in range(2):  # the name now answers inside the deny list: refused, whatever said the first answer
        failure = _result(resolver.getHostByName("rebind.test"))
        assert failure.check(DeniedNetwork), failure
        assert "rebind.test resolves to" in str(failure.value)


def test_scrapy_s_cached_answer_is_checked_each_time_it_is_used() -> None:
    policy = DenyPolicy(parse_networks(DENY))
    resolver = DenyNetworksResolver(None, 100, 5.0)  # type: ignore[arg-type]  # a cache hit needs no reactor
    resolver.policy = policy
    dnscache["cached.test"] = "169.254.169.254"
    try:
        failure = _result(resolver.getHostByName("cached.test"))
    finally:
        del dnscache["cached.test"]
    assert failure.check(DeniedNetwork) and "169.254.0.0/16" in str(failure.value)


def test_a_lookup_that_fails_is_a_dns_failure_not_a_refusal() -> None:
    class Failing:
        def getHostByName(self, name: str, timeout: Any = ()) -> defer.Deferred[str]:  # noqa: N802
            return defer.fail(DNSLookupError(f"address {name!r} not found"))

    policy = DenyPolicy(parse_networks(DENY))
    failure = _result(DenyingResolver(Failing(), policy).getHostByName("nowhere.invalid"))
    assert failure.check(DNSLookupError) and not failure.check(DeniedNetwork)


class FakeReactor:
    """The resolver attributes of a Twisted reactor (``installResolver`` also sets ``nameResolver``)."""

    def __init__(self, resolver: Any) -> None:
        self.installResolver(resolver)

    def installResolver(self, resolver: Any) -> None:  # noqa: N802
        from twisted.internet._resolver import SimpleResolverComplexifier

        self.resolver = resolver
        self.nameResolver: Any = SimpleResolverComplexifier(resolver)

    def installNameResolver(self, resolver: Any) -> None:  # noqa: N802
        from twisted.internet._resolver import ComplexResolverSimplifier

        self.nameResolver = resolver
        self.resolver = ComplexResolverSimplifier(resolver)


def test_install_replaces_scrapy_s_default_and_wraps_and_names_any_other() -> None:
    reactor = FakeReactor(CachingThreadedResolver(None, 10, 7.0))  # type: ignore[arg-type]
    assert install(reactor) == ""
    assert type(reactor.resolver) is DenyNetworksResolver and reactor.resolver.timeout == 7.0
    assert isinstance(reactor.nameResolver, DenyingNameResolver)
    assert install(reactor) == ""  # once is enough
    assert type(reactor.resolver) is DenyNetworksResolver

    class MyResolver:
        def getHostByName(self, name: str, timeout: Any = ()) -> defer.Deferred[str]:  # noqa: N802
            return defer.succeed("127.0.0.1")

    reactor = FakeReactor(MyResolver())
    assert install(reactor).endswith(".MyResolver")
    assert isinstance(reactor.resolver, DenyingResolver)

    from scrapy.resolver import CachingHostnameResolver

    reactor = FakeReactor(None)
    reactor.installNameResolver(CachingHostnameResolver.__new__(CachingHostnameResolver))
    assert install(reactor) == "scrapy.resolver.CachingHostnameResolver"
    assert isinstance(reactor.nameResolver, DenyingNameResolver)
    assert isinstance(reactor.resolver, DenyingResolver)


def test_a_denied_address_from_a_name_resolver_fails_to_connect_as_a_refusal() -> None:
    """Twisted's HostnameEndpoint reports a name without addresses as a DNS failure: the denied address
    becomes a stand-in whose lookup, by the reactor's simple resolver, fails with DeniedNetwork."""
    from twisted.internet.address import IPv4Address

    class Names:
        def resolveHostName(self, receiver: Any, name: str, port: int = 0, *a: Any) -> None:  # noqa: N802
            receiver.resolutionBegan(None)
            receiver.addressResolved(IPv4Address("TCP", "127.0.0.1", port))
            receiver.addressResolved(IPv4Address("TCP", "93.184.216.34", port))
            receiver.resolutionComplete()

    class Receiver:
        def __init__(self) -> None:
            self.hosts: list[str] = []

        def resolutionBegan(self, resolution: Any) -> None:  # noqa: N802
            pass

        def addressResolved(self, address: Any) -> None:  # noqa: N802
            self.hosts.append(address.host)

        def resolutionComplete(self) -> None:  # noqa: N802
            pass

    policy = DenyPolicy(parse_networks(DENY))
    got = Receiver()
    DenyingNameResolver(Names(), policy).resolveHostName(got, "two.test", 80)
    assert got.hosts[1] == "93.184.216.34" and got.hosts[0].endswith(".invalid")
    failure = _result(DenyingResolver(Rebinding(), policy).getHostByName(got.hosts[0]))
    assert failure.check(DeniedNetwork) and "two.test resolves to 127.0.0.1" in str(failure.value)


# -- real crawls ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_two_card_lines_refuse_denied_networks_by_name_and_by_address(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    site = site_factory(pages=10)
    client = redis.Redis.from_url(redis_url)
    project = make_project(tmp_path, {"REDIS_URL": redis_url, "SCHEDULER_DENY_NETWORKS": DENY},
                           spiders=SPIDERS)
    by_name = site.page_url(2).replace("127.0.0.1", "localhost")
    project.crawl("open", args={"urls": f"{site.page_url(1)},{by_name}"})
    assert project.wait_all(60) == [0], project.logs()[-3000:]
    assert site.fetch_counts(status=None) == {}
    stats = project.stats(0)
    assert stats["deny_networks/refused"] == 2, stats
    assert stats["scheduler/rejected/denied_network"] == 1, stats  # 127.0.0.1, refused before any DNS
    # localhost: refused by the resolver, and reported as a refusal, not as a name that does not resolve
    assert stats["downloader/exception_type_count/scrapy_dist.egress.DeniedNetwork"] == 1, stats
    assert not any("CannotResolveHostError" in k for k in stats), stats
    rejected = client.lrange(CrawlKeys("open").queue + ":rejected", 0, -1)
    assert len(rejected) == 1 and b"denied_network" in rejected[0]
    assert "Refused to connect: localhost resolves to 127.0.0.1" in project.logs()


@pytest.mark.slow
def test_a_name_that_rebinds_to_loopback_is_not_fetched(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    site = site_factory(pages=10)
    project = make_project(
        tmp_path,
        {
            "REDIS_URL": redis_url,
            "ADDONS": {"scrapy_dist.Addon": 0},
            "SCHEDULER_DENY_NETWORKS": DENY,
            # no cache between two lookups: the second answer (127.0.0.1) is the one the download would use
            "DNSCACHE_ENABLED": False,
            "DOWNLOAD_TIMEOUT": 2,
            "RETRY_TIMES": 1,
        },
        spiders=SPIDERS,
    )
    port = site.url.rsplit(":", 1)[1]
    project.crawl("open", args={"urls": f"http://rebind.test:{port}/page/1"})
    assert project.wait_all(90) == [0], project.logs()[-3000:]
    assert site.fetch_counts(status=None) == {}
    assert project.stats(0)["deny_networks/refused"] == 1, project.logs()[-3000:]


@pytest.mark.slow
def test_a_proxy_in_a_denied_network_is_refused(tmp_path: Path, redis_url: str, site_factory: Any) -> None:
    site = site_factory(pages=10)
    client = redis.Redis.from_url(redis_url)
    project = make_project(tmp_path, {"REDIS_URL": redis_url, "ADDONS": {"scrapy_dist.Addon": 0},
                                      "SCHEDULER_DENY_NETWORKS": DENY}, spiders=SPIDERS)
    port = site.url.rsplit(":", 1)[1]
    # the target is a public address: the proxy is what is refused
    project.crawl("open", args={"urls": "http://93.184.216.34/a", "proxy": f"http://localhost:{port}"})
    project.crawl("open", args={"urls": "http://93.184.216.34/b", "proxy": f"http://127.0.0.1:{port}"})
    assert project.wait_all(60) == [0, 0], project.logs()[-3000:]
    assert site.fetch_counts(status=None) == {}  # the site, as a proxy, was never asked
    letters = [parse_record(r) for r in client.lrange(CrawlKeys("open").deadletter, 0, -1)]
    rejected = client.lrange(CrawlKeys("open").queue + ":rejected", 0, -1)
    # by name: the resolver refused the connection to the proxy; by address: refused before the download
    assert [x.reason for x in letters] + [b"denied_network" in r for r in rejected] in (
        ["denied_network", True], ["denied_network", "denied_network"]), (letters, rejected)


@pytest.mark.slow
def test_a_dns_failure_is_reported_as_one(tmp_path: Path, redis_url: str) -> None:
    project = make_project(tmp_path, {"REDIS_URL": redis_url, "ADDONS": {"scrapy_dist.Addon": 0},
                                      "SCHEDULER_DENY_NETWORKS": DENY, "RETRY_TIMES": 0}, spiders=SPIDERS)
    project.crawl("open", args={"urls": "http://does-not-exist.invalid/"})
    assert project.wait_all(60) == [0], project.logs()[-3000:]
    stats = project.stats(0)
    assert "deny_networks/refused" not in stats, stats
    assert stats.get("downloader/exception_type_count/scrapy.exceptions.CannotResolveHostError") == 1, stats
    assert "SCHEDULER_DENY_NETWORKS" not in project.logs()


@pytest.mark.slow
def test_a_resolver_of_the_user_s_own_is_wrapped_and_named_once(
    tmp_path: Path, redis_url: str, site_factory: Any
) -> None:
    site = site_factory(pages=10)
    project = make_project(tmp_path, {
        "REDIS_URL": redis_url, "SCHEDULER_DENY_NETWORKS": DENY, "RETRY_ENABLED": False,
        "TWISTED_DNS_RESOLVER": "scrapy.resolver.CachingHostnameResolver",  # IPv6-capable, a name resolver
    }, spiders=SPIDERS)
    by_name = [site.page_url(i).replace("127.0.0.1", "localhost") for i in (1, 2)]
    project.crawl("open", args={"urls": ",".join(by_name)})
    assert project.wait_all(60) == [0], project.logs()[-3000:]
    assert site.fetch_counts(status=None) == {}
    stats = project.stats(0)
    assert stats["deny_networks/refused"] >= 2, stats
    assert stats["downloader/exception_type_count/scrapy_dist.egress.DeniedNetwork"] == 2, stats
    logs = project.logs()
    assert logs.count("'scrapy.resolver.CachingHostnameResolver' is not scrapy-dist's") == 1, logs[-3000:]


def test_a_proxy_of_the_environment_in_a_denied_network_is_named_once_per_variable(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import scrapy_dist.egress as resolver

    monkeypatch.setattr(resolver, "_warnings", RateLimitedLog.once(resolver.logger))
    monkeypatch.setenv("HTTP_PROXY", "http://10.1.2.3:3128")
    monkeypatch.setenv("HTTPS_PROXY", "10.1.2.4:3128")
    monkeypatch.setenv("http_proxy", "http://proxy.example:3128")  # a name: checked on each connection
    monkeypatch.delenv("https_proxy", raising=False)
    with caplog.at_level("WARNING"):
        for _ in range(2):
            resolver._check_env_proxies(parse_networks(DENY))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "HTTP_PROXY: proxy 10.1.2.3 is in denied network 10.0.0.0/8" in lines[0]


def test_the_add_on_sets_the_process_resolver_unless_the_project_chose_one() -> None:
    from scrapy.settings import Settings

    from scrapy_dist.addon import Addon

    settings = Settings()
    Addon.update_pre_crawler_settings(settings)
    assert settings["TWISTED_DNS_RESOLVER"] == "scrapy_dist.egress.DenyNetworksResolver"
    mine = Settings({"TWISTED_DNS_RESOLVER": "scrapy.resolver.CachingHostnameResolver"})
    Addon.update_pre_crawler_settings(mine)
    assert mine["TWISTED_DNS_RESOLVER"] == "scrapy.resolver.CachingHostnameResolver"


@pytest.mark.parametrize("url, proxy, refused", [
    ("http://127.0.0.1:8000/", None, "host 127.0.0.1 is in denied network 127.0.0.0/8"),
    ("http://[::1]/", None, "host ::1 is in denied network ::1/128"),
    ("http://[::ffff:169.254.169.254]/", None, "169.254.0.0/16"),
    ("http://10.0.0.1./", None, "10.0.0.0/8"),
    ("http://93.184.216.34/", "127.0.0.1:8080", "proxy 127.0.0.1 is in denied network"),
    ("http://93.184.216.34/", "http://[fd00::1]:3128", "proxy fd00::1"),
    ("http://93.184.216.34/", "http://93.184.216.35:3128", ""),
    ("http://2130706433/", None, ""),  # not an address to Twisted either: the resolver answers 127.0.0.1
    ("http://localhost/", "http://proxy.example:3128", ""),  # names: the resolver's
])
def test_hosts_and_proxies_written_as_addresses_are_refused_before_any_dns(
    url: str, proxy: str | None, refused: str
) -> None:
    from scrapy import Request

    from scrapy_dist.egress import request_refusal

    request = Request(url, meta={"proxy": proxy} if proxy else {})
    why = request_refusal(request, parse_networks(DENY))
    assert (refused in why) if refused else why == "", why
