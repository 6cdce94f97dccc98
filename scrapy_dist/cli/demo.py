"""``scrapy-dist demo``: a live distributed crawl of a generated local site, a worker killed half way, and
a summary that must say 0 lost. The logic lives in :mod:`scrapy_dist.demo.run`; this is the command line.

Redis: ``--redis-url`` or ``$REDIS_URL`` if given, else the embedded Redis of the demo's project
(``example_project/.scrapy/scrapy_dist``) -- never the Redis of a project the command happens to run in.
"""

from __future__ import annotations

import click

from scrapy_dist.cli import ClientFactory, main, pass_redis, require_extra

# Where ClientFactory found Redis when the user named one explicitly.
_EXPLICIT = ("--redis-url", "REDIS_URL environment variable")


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
    from scrapy_dist.demo.run import Demo, DemoOptions

    options = DemoOptions(workers=workers, pages=pages, chaos=chaos, timeout=timeout)
    if redis.source in _EXPLICIT:
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
