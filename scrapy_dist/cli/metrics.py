"""``scrapy-dist metrics [SPIDER...]``: serve Prometheus metrics of crawls
(:mod:`scrapy_dist.monitor.metrics`)."""

from __future__ import annotations

import time

import click

from scrapy_dist.cli import ClientFactory, force_option, main, pass_redis, project_spiders, require_extra


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
