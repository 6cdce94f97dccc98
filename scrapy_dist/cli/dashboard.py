"""``scrapy-dist dashboard SPIDER``: a live web page of the crawl (:mod:`scrapy_dist.monitor.dashboard`)."""

from __future__ import annotations

import asyncio
import contextlib

import click

from scrapy_dist.cli import ClientFactory, force_option, main, pass_redis, require_extra
from scrapy_dist.exceptions import ScrapyDistError


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
def dashboard(
    redis: ClientFactory, spider: str, host: str, port: int, token: str | None,
    allowed_hosts: tuple[str, ...], force: bool,
) -> None:
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
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
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
