"""Watching and steering a crawl: ``scrapy-dist status|pause|resume|close <spider>``, ``metrics``
(Prometheus), ``dashboard`` (a live web page) and ``demo`` (a live crawl of a generated site)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib
import json
import time
from datetime import datetime, timezone
from typing import Any

import click
from rich.console import Group
from rich.live import Live
from rich.table import Column, Table
from rich.text import Text

from scrapy_dist import seeds as nearmiss
from scrapy_dist.cli import ClientFactory, console, json_safe, main, pass_redis, printable, spider_command
from scrapy_dist.cli.dead import requeue_letters, requeue_targets, select
from scrapy_dist.demo import DEMO_LEASE_SECONDS, Demo, DemoOptions
from scrapy_dist.frontier import layout
from scrapy_dist.monitor import read_status
from scrapy_dist.redis.outage import READ_ERRORS, describe

_STATE_STYLE = {"running": "green", "lost": "bold red", "closed": "dim"}
_WORKER_FIGURES = ("pages", "items", "errors", "leases", "pages_per_min")


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):  # a stat that is not a number: garbage from Redis
        return printable(value, 40)
    return f"{value:,.1f}" if isinstance(value, float) else f"{value:,}"


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    return f"{seconds / 60:.0f}m ago" if seconds < 7200 else f"{seconds / 3600:.0f}h ago"


def back_in(leases: dict[str, Any]) -> str:
    """When held leases come back to the queue: ``back in the queue in 42 s, the last in 58 s``."""
    first, last = leases.get("first_in"), leases.get("last_in")
    if first is None:
        return "back in the queue when the leases expire"
    if not last:
        return "their leases have run out: back in the queue at the next sync of any worker"
    text = f"back in the queue in {first:,.0f} s"
    return text + (f", the last in {last:,.0f} s" if last - first >= 1 else "")


def _held(leases: dict[str, Any], state: str) -> Text:
    """Leases not in flight (some are held): prefetched by running workers, and those of lost workers."""
    paused = " (paused: held, not crawled)" if state == "paused" else ""
    parts = [f"{leases['prefetched']:,} prefetched{paused}"] if leases["prefetched"] else []
    if leases["other"]:
        parts.append(f"{leases['other']:,} by lost or just-started workers ({back_in(leases)})")
    return Text(", ".join(parts))


def held_text(status: dict[str, Any]) -> str:
    """``31 leased requests held by lost workers, back in ...`` while a stopped crawl holds leases."""
    leases = status.get("leases") or {}
    if status["state"] != "stopped" or not (n := leases.get("other")):
        return ""
    text = f"{n:,} leased request{'s' if n != 1 else ''} held by lost workers, {back_in(leases)}"
    return text + ("; a worker must run to requeue them" if leases.get("first_in") is not None else "")


def idle_text(status: dict[str, Any]) -> str:
    """``idle, next revisit in N s`` for a long-running crawl between two rounds of revisits, else ``""``."""
    front, next_in = status["frontier"], (status.get("revisits") or {}).get("next_in")
    idle = not (front["queued"] or front["inflight"]) and next_in is not None
    return f"idle, next revisit in {next_in:,.0f} s" if idle else ""


def render(status: dict[str, Any]) -> Group:
    """The status as rich renderables: a headline, the crawl's figures and the workers table."""
    rates, errors, front, seeds = status["rates"], status["errors"], status["frontier"], status["seeds"]
    spider, state = printable(status["spider"], 120), status["state"]
    idle = idle_text(status) or held_text(status)
    headline = Text.assemble(
        (spider, "bold"), "  ", (state, "bold yellow" if state == "paused" else "bold"), "  ",
        (f"{idle}  " if idle else ""), f"{_num(rates['pages_per_min'])} pages/min  ",
        "error rate " + ("-" if rates["error_rate"] is None else f"{rates['error_rate']:.1%}"),
        f" ({errors['errors']:,} errors / {errors['attempts']:,} attempts in {errors['window']:,.0f}s)"
        if errors["window"] else "")
    overview = Table(Column(style="bold"), Column(justify="right"), Column(style="bold"),
                     Column(justify="right"), show_header=False, box=None, padding=(0, 2))
    stats, shards, leases = status["stats"], status.get("shards", 1), status.get("leases") or {}
    overview.add_row(f"Queued ({shards} shards)" if shards > 1 else "Queued", _num(front["queued"]),
                     "Pages", _num(stats.get("response_received_count", 0)))
    known = leases.get("in_flight") is not None  # else (an older worker) every lease counts as in flight
    overview.add_row("In flight", _num(leases["in_flight"] if known else front["inflight"]),
                     "Items", _num(stats.get("item_scraped_count", 0)))
    overview.add_row("Delayed", _num(front["delayed"]), "Dead letters", _num(status["deadletter"]))
    revisits = status.get("revisits") or {}
    if revisits.get("scheduled") or revisits.get("next_in") is not None:
        overview.add_row("Revisits", _num(revisits.get("scheduled", 0)), "", "")
    overview.add_row("Seeds waiting", _num(seeds["waiting"] + seeds["processing"]),
                     "Rejected", f"{seeds['rejected']:,} seeds, {status['rejected']['queue']:,} queue")
    lines = [Text.assemble(("Filter  ", "bold"), _filter_text(status["filter"]))]
    if known and (leases["prefetched"] or leases["other"]):
        lines.append(Text.assemble(("Held  ", "bold"), _held(leases, state)))
    lines += [Text.assemble(("Seeds elsewhere  ", "bold yellow"), nearmiss.NearMiss(**hint).hint()
                            + " (no crawl reads that key)") for hint in status.get("seed_hints") or []]
    if errors["reasons"]:
        top = ", ".join(f"{printable(r, 80)} {n:,}" for r, n in list(errors["reasons"].items())[:5])
        lines.append(Text.assemble(("Top errors  ", "bold"), top))
    n = status["workers_summary"]
    figures = ("Seen", "Pages", "Items", "Errors", "Leases", "Pages/min")
    workers = Table(Column("Worker", no_wrap=True), "State", *(Column(f, justify="right") for f in figures),
                    title=f"Workers: {n['running']:,} running, {n['lost']:,} lost, {n['closed']:,} closed",
                    title_justify="left")
    for w in status["workers"][:50]:
        st = w["state"] + (f" ({printable(w['finish_reason'], 60)})" if w["finish_reason"] else "")
        workers.add_row(Text(printable(w["id"], 120)), Text(st, style=_STATE_STYLE.get(w["state"], "")),
                        _ago(w["seen_ago"]), *(_num(w[k]) for k in _WORKER_FIGURES))
    if len(status["workers"]) > 50:
        workers.caption = f"... and {len(status['workers']) - 50} more (see --json)"
    parts: list[Any] = [workers if status["workers"] else Text(f"Workers: none yet (scrapy crawl {spider})")]
    if status.get("domains"):
        columns = ("Backlog", "In flight", "Delay", "Concurrency", "Next in")
        domains = Table(Column("Domain", no_wrap=True), *(Column(f, justify="right") for f in columns),
                        title="Busiest domains (crawl-wide politeness)", title_justify="left")
        for d in status["domains"]:
            domains.add_row(Text(printable(d["domain"], 120)), _num(d["backlog"]), _num(d["in_flight"]),
                            f"{d['delay']:g}s", str(d["concurrency"] or "-"), f"{d['next_in']:.1f}s")
        parts.append(domains)
    garbage = status.get("garbage") or {}
    what = [printable(p, 120) for p in garbage.get("control", [])]
    if garbage.get("workers"):
        what.append(f"{garbage['workers']:,} worker hashes with garbage fields (shown as -)")
    if garbage.get("stats"):
        what.append(f"{garbage['stats']:,} stats fields (out of range, overlong names, over the limit)")
    if what:
        lines.append(Text.assemble(("Ignored garbage  ", "bold yellow"), "; ".join(what)))
    stamp = datetime.fromtimestamp(status["time"], tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    if status.get("redis"):
        stamp += f"  Redis {status['redis']['url']} ({status['redis']['source']})"
    return Group(headline, Text(stamp, style="dim"), overview, *lines, *parts)


def _filter_text(f: dict[str, Any] | None) -> str:
    if f is None:
        return "-"
    if f["kind"] == "garbage":
        return "unreadable (the filter's recorded parameters are garbage)"
    if f["kind"] != "bloom":
        return f"exact, {f['items']:,} fingerprints"
    ttl = f"; forgets after {f['ttl']:g} s ({f['generations']} generations)" if f.get("ttl") else ""
    return (f"bloom, {f['items']:,} of {f['capacity']:,} ({f['fill']:.2%} full), estimated false positives"
            f" {f['fpr_estimate']:.2g}{ttl}")


@spider_command
@click.option("--json", "as_json", is_flag=True, help="Print JSON (one object per refresh with --watch).")
@click.option("--watch", is_flag=True, help="Refresh until interrupted (Ctrl-C).")
@click.option("--interval", default=2.0, type=click.FloatRange(0.1),
              help="Seconds between refreshes with --watch.")
def status(redis: ClientFactory, spider: str, as_json: bool, watch: bool, interval: float,
           force: bool) -> None:
    """Show the crawl of SPIDER: frontier, seeds, dead letters, filter, rates, workers and stats."""
    keys = redis.crawl(spider, force, notice=False)  # the output names the Redis
    client = redis.client()
    extra = {"redis": {"url": redis.target.masked_url, "source": redis.source},  # read once, not per refresh
             "seed_hints": [dataclasses.asdict(m) for m in redis.seed_hints(client, keys)]}

    def read() -> dict[str, Any]:
        return {**read_status(client, keys, default_interval=redis.dist.monitoring.interval or 5.0), **extra}
    if not watch:
        if as_json:
            click.echo(json_safe(json.dumps(read(), indent=2)))
        else:
            console().print(render(read()))
        return
    with contextlib.suppress(KeyboardInterrupt):
        if as_json:
            while True:
                try:
                    data = read()
                except READ_ERRORS as exc:  # one object per refresh all the same, saying why
                    data = {"spider": spider, "time": time.time(),
                            "error": f"Redis unavailable ({describe(exc)})"}
                click.echo(json_safe(json.dumps(data)))
                time.sleep(interval)
        with Live(render(read()), console=console(), auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                try:
                    live.update(render(read()), refresh=True)
                except READ_ERRORS as exc:
                    live.update(Text(f"Redis unavailable ({exc}); retrying every {interval:g}s", style="red"),
                                refresh=True)


@spider_command
def pause(redis: ClientFactory, spider: str, force: bool) -> None:
    """Pause the crawl of SPIDER: every worker stops taking new requests (within a second)."""
    keys = redis.crawl(spider, force)
    layout.pause_crawl(redis.client(), keys.control, by="cli")
    click.echo(f"Paused {spider!r}: workers finish what they hold and take nothing new. Resume with"
               f" `scrapy-dist resume {spider}`.")


@spider_command
def resume(redis: ClientFactory, spider: str, force: bool) -> None:
    """Resume the crawl of SPIDER (after `scrapy-dist pause` or an error monitor pause)."""
    keys = redis.crawl(spider, force)
    layout.resume_crawl(redis.client(), keys.control, keys.errors)
    click.echo(f"Resumed {spider!r}: workers take new requests again (the error window starts afresh).")


def _reason(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    if not layout.REASON.fullmatch(value):
        raise click.BadParameter(f"{value!r}: letters, digits and _.:- only, at most 64 characters")
    return value


@spider_command
@click.option("--reason", default="shutdown", callback=_reason,
              help="The finish reason the workers close with.")
def close(redis: ClientFactory, spider: str, reason: str, force: bool) -> None:
    """Close the crawl of SPIDER: every running worker closes gracefully (within a few seconds), also
    those of a crawl that never closes on its own (SCHEDULER_IDLE_BEFORE_CLOSE = None)."""
    keys, client = redis.crawl(spider, force), redis.client()
    layout.close_crawl(client, keys.control, reason)
    control = layout.parse_control(client.hgetall(keys.control))
    ended = layout.end_chains(client, keys.shards(control.shards or 1), control.politeness == "cluster")
    click.echo(f"Closing {spider!r}: every running worker closes (reason {reason}); what they hold goes"
               f" back to the queue, and {ended:,} scheduled revisits end. Workers started from now on crawl"
               f" again (`scrapy-dist resume {spider}` clears the decision).")


@functools.partial(spider_command, spider=click.Argument(["spiders"], nargs=-1))
@click.option("--port", default=9410, type=click.IntRange(0, 65535),
              help="TCP port of /metrics (0: any free port, printed).")
@click.option("--host", default="127.0.0.1",
              help="Address to listen on (0.0.0.0: every interface; the metrics name hosts and URLs).")
@click.option("--cache", "cache_seconds", default=5.0, type=click.FloatRange(0, 3600),
              help="Seconds a reading of Redis is reused: several scrapers cost one read.")
@click.option("--top-domains", default=10, type=click.IntRange(0, 100),
              help="Busiest domains exported with their backlog (bounds the label's cardinality).")
def metrics(redis: ClientFactory, spiders: tuple[str, ...], port: int, host: str, cache_seconds: float,
            top_domains: int, force: bool) -> None:
    """Serve Prometheus metrics of the crawls of SPIDER... (inside a project and with none named: every
    spider of the project) on http://HOST:PORT/metrics until Ctrl-C."""
    if not (names := list(spiders) or redis.spiders() or []):
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
    _wait_for_ctrl_c()
    server.shutdown()


@spider_command
@click.option("--host", default="127.0.0.1",
              help="Address to listen on; anything but loopback needs --token.")
@click.option("--port", default=9420, type=click.IntRange(0, 65535),
              help="TCP port (0: any free port, printed).")
@click.option("--token", envvar="SCRAPY_DIST_DASHBOARD_TOKEN", default=None,
              help="Secret the page's Pause / Resume / Requeue buttons must send (else read-only).")
@click.option("--allow-host", "allowed_hosts", multiple=True, metavar="NAME",
              envvar="SCRAPY_DIST_DASHBOARD_HOSTS",
              help="Another host name the page is opened by (a DNS name of this machine, a proxy's); the"
              " dashboard answers only to loopback names, the --host address and these. Repeatable.")
def dashboard(redis: ClientFactory, spider: str, host: str, port: int, token: str | None,
              allowed_hosts: tuple[str, ...], force: bool) -> None:
    """Serve a live dashboard of the crawl of SPIDER (charts of the last hour, workers, domains, dead
    letters) on http://HOST:PORT/ until Ctrl-C."""
    keys = redis.crawl(spider, force)
    dashboards = require_extra("scrapy_dist.monitor.dashboard", "aiohttp", "dashboard")
    dashboards.check_binding(host, token)
    with redis.client() as client:
        async def requeue() -> str:
            letters, _ = await asyncio.to_thread(select, client, keys.deadletter, None)
            targets, refused = requeue_targets(letters, redis.dist, keys)
            done = await requeue_letters(redis, keys, targets) if targets else 0
            return f"requeued {done}, kept {len(refused)}"
        dash = dashboards.Dashboard(client, keys, token=token, requeue=requeue, host=host,
                                    allowed_hosts=allowed_hosts)
        try:
            served = dashboards.DashboardThread(dash, port=port)
        except OSError as exc:
            raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        mode = "the buttons need the token" if token else "read-only: no --token"
        click.echo(f"Dashboard of {spider!r} on {served.url} ({mode}; Ctrl-C stops)")
        _wait_for_ctrl_c()
        served.close()


def require_extra(module: str, package: str, extra: str) -> Any:
    """Import ``module`` of the optional extra ``extra``, or stop with one line naming what to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise click.ClickException(
            f"{package} is not installed: pip install 'scrapy-dist[{extra}]'") from None


def _wait_for_ctrl_c() -> None:
    with contextlib.suppress(KeyboardInterrupt):
        while True:
            time.sleep(3600)


@main.command()
@click.option("--workers", default=3, type=click.IntRange(1, 32),
              help="Worker processes (`scrapy crawl demo`).")
@click.option("--pages", default=5000, type=click.IntRange(2, 1_000_000), help="Pages in the generated site.")
@click.option("--chaos/--no-chaos", default=True, help="SIGKILL a worker half way and start a fresh one.")
@click.option("--timeout", default=170.0, type=click.FloatRange(1),
              help="Seconds before the demo gives up (stops the workers, exits 1).")
@click.option("--dashboard", "dashboard_port", type=click.IntRange(0, 65535), default=None, is_flag=False,
              flag_value=9420, help="Also serve the live dashboard (read-only) on 127.0.0.1:PORT (9420).")
@click.option("--lease-seconds", envvar="SCRAPY_DIST_DEMO_LEASE_SECONDS", show_envvar=True,
              type=click.FloatRange(1, 3600), default=DEMO_LEASE_SECONDS,
              help="The workers' SCHEDULER_LEASE_SECONDS: how long a killed worker's leases hold pages.")
@pass_redis
def demo(redis: ClientFactory, dashboard_port: int | None, **given: Any) -> None:
    """Crawl a generated local site with WORKERS processes sharing one frontier; show it live; summarize.

    Exits 1 if a page was lost, a worker failed or the timeout passed; 130 on Ctrl-C."""
    options = DemoOptions(**given)
    if redis.source in ("--redis-url", "REDIS_URL environment variable"):
        redis.check()  # an unreachable Redis is one "Error:" line, before anything else is printed
        options.redis_url, options.redis_source = redis.url, redis.source
    dash = (None if dashboard_port is None
            else require_extra("scrapy_dist.monitor.dashboard", "aiohttp", "dashboard"))
    runner = Demo(options)
    runner.connect()
    with contextlib.ExitStack() as stack:
        if dash is not None:
            try:
                served = dash.DashboardThread(dash.Dashboard(runner.client, runner.keys), port=dashboard_port)
            except OSError as exc:
                runner.shutdown()
                raise click.ClickException(f"cannot serve the dashboard: {exc}") from None
            stack.callback(served.close)
            click.echo(f"Dashboard (read-only): {served.url}")
        raise SystemExit(runner.run())
